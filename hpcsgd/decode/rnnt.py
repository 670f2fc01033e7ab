"""RNN-T search: greedy, batched over the utterances (icefall's greedy_search_batch).

An RNN-T model's forward gives each utterance's encoder projection enc (T' rows); the search
runs the prediction network one token at a time and the joint on (enc_t, pred):

    for each frame t, up to max_symbols times:
        k = argmax_k  Wo tanh(enc_t (+|*) pred) + bo     (model/transducer.py's joint)
        k = blank: next frame; else emit k, pred <- the predictor advanced by k

All utterances of a batch step together (the ones still emitting at this frame are the
rows of one small GEMM). The prediction network's step and the joint are the trained layer's
own (model/transducer.py: Transducer.start, step, joint_logits; its LSTMs' LSTM.step): this
module holds the searches, not a copy of the model.
"""
import numpy as np

MAX_SYMBOLS = 3   # symbols one frame may emit (icefall's default max_sym_per_frame is 1-3)


def predictor_step(layer, p, tokens, state):
    """The predictor advanced by one token per row (Transducer.step)."""
    return layer.step(p, tokens, state)


def start_state(layer, p, n):
    """The predictor after the start symbol (the blank) for n utterances (Transducer.start)."""
    return layer.start(p, n)


def joint_logits(layer, p, enc, pred):
    """Logits (n, V) of rows of enc and pred (n, joint) each (Transducer.joint_logits)."""
    return layer.joint_logits(p, enc, pred)


def greedy_search(layer, p, enc, lengths, max_symbols=MAX_SYMBOLS, blank=0, emitted=None):
    """enc (T*nb, joint): the batch's encoder projection, time-major, of these Lengths ->
    one int64 token array per utterance. emitted: a list to fill with each utterance's
    emission frame of every token (word timestamps)."""
    nb, frames = lengths.nb, lengths.lengths
    pred, state = start_state(layer, p, nb)
    hyps = [[] for _ in range(nb)]
    at = [[] for _ in range(nb)]
    for t in range(int(frames.max()) if nb else 0):
        rows = np.flatnonzero(frames > t)
        for _ in range(max_symbols):
            if not rows.size:
                break
            best = joint_logits(layer, p, enc[t * nb + rows], pred[rows]).argmax(axis=1)
            emit = best != blank
            rows, best = rows[emit], best[emit]
            if not rows.size:
                break
            for b, k in zip(rows, best):
                hyps[b].append(int(k))
                at[b].append(t)
            out, new = predictor_step(layer, p, best, [(h[rows], c[rows]) for h, c in state])
            pred[rows] = out
            for (h, c), (h1, c1) in zip(state, new):
                h[rows], c[rows] = h1, c1
    if emitted is not None:
        emitted[:] = [np.asarray(a, np.int64) for a in at]
    return [np.asarray(h, np.int64) for h in hyps]


def _log_softmax(logits):
    m = logits.max(axis=1, keepdims=True)
    return logits - (m + np.log(np.exp(logits - m).sum(axis=1, keepdims=True)))


def beam_search(layer, p, enc, lengths, beam=4, blank=0, lm=None, lm_weight=0.0, bonus=0.0,
                nbest=0, emitted=None):
    """Modified beam search (icefall's modified_beam_search): at most one symbol per frame;
    at each frame every hypothesis of an utterance is extended by the blank or by a token,
    the `beam` best (hypothesis, token) pairs of the utterance kept, and equal token sequences
    merged (their probabilities added). Batched: the hypotheses of all utterances at a frame
    are the rows of one joint GEMM and one predictor step. With a token n-gram `lm`
    (hpcsgd/decode/token_lm.py), shallow fusion: every token extension also scores
    lm_weight * ln P_lm(token | the hypothesis) + bonus (a token insertion reward: the LM's
    log-probabilities are all negative and the blank pays none, so without one fusion
    trades tokens for blanks), and the final ranking lm_weight * ln P_lm(</s> | it).
    -> (one int64 token array per utterance, its score summed over the merged alignments);
    with nbest > 0: per utterance its `nbest` best (tokens, score) pairs, best first (the score
    with the LM's </s> term), at most `beam`. emitted: a list to fill with the best
    hypothesis' emission frame of every token (of its most probable merged alignment)."""
    nb, frames = lengths.nb, lengths.lengths
    pred0, state0 = start_state(layer, p, 1)
    # per utterance: {tokens: [log-prob, pred (joint,), [(h, c) per LSTM layer], the frame
    # each token was emitted at (of the best alignment merged into it)]}
    hyps = [{(): [0.0, pred0[0], [(h[0], c[0]) for h, c in state0], ()]} for _ in range(nb)]
    for t in range(int(frames.max()) if nb else 0):
        live = [b for b in range(nb) if frames[b] > t]
        keys = [(b, ys) for b in live for ys in hyps[b]]
        preds = np.stack([hyps[b][ys][1] for b, ys in keys])
        encs = np.stack([enc[t * nb + b] for b, _ in keys])
        lp = _log_softmax(joint_logits(layer, p, encs, preds))
        scores = lp + np.array([hyps[b][ys][0] for b, ys in keys])[:, None]
        if lm is not None:      # the blank column of an LM row is 0: not scored
            scores += lm_weight * np.stack([lm.row(lm.context(ys)) for _, ys in keys])
            scores[:, 1:] += bonus
        grow, first = [], 0   # (b, new tokens, row of its parent, score) of the kept pairs
        new = {b: {} for b in live}
        for b in live:
            n = len(hyps[b])
            block = scores[first:first + n].ravel()
            top = np.argsort(-block, kind="stable")[:beam]
            for flat in top:
                row, k = first + flat // lp.shape[1], int(flat % lp.shape[1])
                ys = keys[row][1] if k == blank else keys[row][1] + (k,)
                if ys in new[b]:   # the same tokens by another alignment: add them up
                    new[b][ys][0] = np.logaddexp(new[b][ys][0], block[flat])
                elif k == blank:
                    new[b][ys] = [block[flat], *hyps[b][keys[row][1]][1:]]
                else:
                    new[b][ys] = [block[flat], None, None, hyps[b][keys[row][1]][3] + (t,)]
                    grow.append((b, ys, row, k))
            first += n
        if grow:   # the predictor advanced by each new token, one batched step
            rows = [row for _, _, row, _ in grow]
            state = [(np.stack([hyps[keys[r][0]][keys[r][1]][2][l][0] for r in rows]),
                      np.stack([hyps[keys[r][0]][keys[r][1]][2][l][1] for r in rows]))
                     for l in range(len(layer.pred))]
            out, state = predictor_step(layer, p, np.array([k for *_, k in grow]), state)
            for i, (b, ys, _, _) in enumerate(grow):
                new[b][ys][1] = out[i]
                new[b][ys][2] = [(h[i], c[i]) for h, c in state]
        for b in live:
            hyps[b] = new[b]
    final = (lambda ys: 0.0) if lm is None else (lambda ys: lm_weight * lm.final(lm.context(ys)))
    ranked = [sorted(((ys, float(v[0]) + final(ys)) for ys, v in h.items()),
                     key=lambda item: -item[1]) for h in hyps]
    if emitted is not None:
        emitted[:] = [np.asarray(hyps[b][r[0][0]][3], np.int64) for b, r in enumerate(ranked)]
    if nbest:
        return [[(np.asarray(ys, np.int64), sc) for ys, sc in r[:nbest]] for r in ranked]
    return ([np.asarray(r[0][0], np.int64) for r in ranked],
            np.array([float(hyps[b][r[0][0]][0]) for b, r in enumerate(ranked)]))
