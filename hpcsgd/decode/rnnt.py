"""RNN-T search: greedy, batched over the utterances (icefall's greedy_search_batch).

An RNN-T model's forward gives each utterance's encoder projection enc (T' rows); the search
runs the prediction network one token at a time and the joint on (enc_t, pred):

    for each frame t, up to max_symbols times:
        k = argmax_k  Wo tanh(enc_t (+|*) pred) + bo     (model/transducer.py's joint)
        k = blank: next frame; else emit k, pred <- the predictor advanced by k

All utterances of a batch step together (the ones still emitting at this frame are the
rows of one small GEMM). The predictor's step is kernels_lstm's float64 reference step, on
the layer's weights: the same function the LSTM kernels are tested against.
"""
import numpy as np

from hpcsgd.model.kernels_joint import ADD
from hpcsgd.model.kernels_lstm import ref_forward_step

MAX_SYMBOLS = 3   # symbols one frame may emit (icefall's default max_sym_per_frame is 1-3)


def predictor_step(layer, p, tokens, state):
    """The predictor advanced by one token per row: tokens (n,) int; state: per LSTM layer
    (h, c) arrays (n, cells). -> (pred (n, joint) float64, the new state)."""
    x = np.asarray(p[layer.E], np.float64)[tokens]
    new = []
    for lstm, (h, c) in zip(layer.pred, state):
        _, c, h = ref_forward_step(x @ p[lstm.W], h @ p[lstm.U[0]], p[lstm.b], c)
        new.append((h, c))
        x = h
    return x @ p[layer.Wp] + p[layer.bp], new


def start_state(layer, p, n):
    """The predictor after the start symbol (the blank) for n utterances."""
    state = [(np.zeros((n, lstm.cells)), np.zeros((n, lstm.cells))) for lstm in layer.pred]
    return predictor_step(layer, p, np.zeros(n, np.int64), state)


def joint_logits(layer, p, enc, pred):
    """Logits (n, V) of rows of enc and pred (n, joint) each."""
    h = np.tanh(enc + pred if layer.mode == ADD else enc * pred)
    return h @ p[layer.Wo] + p[layer.bo]


def greedy_search(layer, p, enc, lengths, max_symbols=MAX_SYMBOLS, blank=0):
    """enc (T*nb, joint): the batch's encoder projection, time-major, of these Lengths ->
    one int64 token array per utterance."""
    nb, frames = lengths.nb, lengths.lengths
    pred, state = start_state(layer, p, nb)
    hyps = [[] for _ in range(nb)]
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
            out, new = predictor_step(layer, p, best, [(h[rows], c[rows]) for h, c in state])
            pred[rows] = out
            for (h, c), (h1, c1) in zip(state, new):
                h[rows], c[rows] = h1, c1
    return [np.asarray(h, np.int64) for h in hyps]
