"""RNN-T search (hpcsgd.decode.rnnt): greedy and modified beam search on a transducer whose
outputs are made by hand (the known best path), and on random tiny transducers against
brute-force enumeration of every alignment with at most one symbol per frame (an exhaustive
beam finds the most probable token sequence and its summed probability; it is never worse
than greedy's)."""
import itertools

import numpy as np
import pytest

from hpcsgd.decode import rnnt as search
from hpcsgd.model.flat import FlatParams, as_specs
from hpcsgd.model.lengths import Lengths
from hpcsgd.model.transducer import Transducer


def _model(v, joint, seed, mode="add"):
    layer = Transducer(4, v, ["lstm 3"], embed=2, joint=joint, joint_mode=mode)
    params = FlatParams(as_specs(layer.specs()), np.float32)
    layer.init(params.views, np.random.default_rng(seed))
    return layer, params


def test_hand_made_outputs_give_the_known_path():
    """No history (Wp = 0, bp = 0: the predictor's output is 0), Wo = 6 I: frame t's logits
    are 6 tanh(enc_t), enc_t = 3 e_k favours token k (0: the blank). Greedy emits each
    frame's token as often as it may (the history changes nothing); beam search, one symbol
    per frame, the frames' tokens."""
    v = 4
    layer, params = _model(v, v, 0)
    params[layer.Wp][...] = 0
    params[layer.bp][...] = 0
    params[layer.Wo][...] = 6 * np.eye(v, dtype=np.float32)
    params[layer.bo][...] = 0
    best = [1, 0, 2, 2, 0, 3]
    enc = np.zeros((len(best), v), np.float32)
    enc[np.arange(len(best)), best] = 3
    lengths = Lengths([len(best)])
    tokens = [k for k in best if k]
    emitted = []
    got = search.greedy_search(layer, params, enc, lengths, max_symbols=1, emitted=emitted)[0]
    assert got.tolist() == tokens
    assert emitted[0].tolist() == [t for t, k in enumerate(best) if k]   # the frames' tokens
    got = search.greedy_search(layer, params, enc, lengths)[0]
    assert got.tolist() == [k for k in tokens for _ in range(search.MAX_SYMBOLS)]
    for beam in (1, 4, 8):
        emitted = []
        hyp, _ = search.beam_search(layer, params, enc, lengths, beam, emitted=emitted)
        assert hyp[0].tolist() == tokens
        assert emitted[0].tolist() == [t for t, k in enumerate(best) if k]


def brute_force(layer, params, enc_b):
    """{token tuple: log of the summed probability of its alignments with at most one symbol
    per frame} of one utterance (every one of V^T emission sequences)."""
    v = layer.num_tokens
    total = {}
    for path in itertools.product(range(v), repeat=len(enc_b)):
        ys, logp = (), 0.0
        for t, k in enumerate(path):
            pred, _ = _pred_of(layer, params, ys)
            lp = search._log_softmax(search.joint_logits(layer, params, enc_b[t:t + 1], pred))
            logp += lp[0, k]
            if k:
                ys = ys + (k,)
        total[ys] = np.logaddexp(total.get(ys, -np.inf), logp)
    return total


def _pred_of(layer, params, ys):
    """The predictor's output after [blank, *ys], one step at a time."""
    pred, state = search.start_state(layer, params, 1)
    for k in ys:
        pred, state = search.predictor_step(layer, params, np.array([k]), state)
    return pred, state


@pytest.mark.parametrize("seed,mode", [(1, "add"), (2, "mul"), (3, "add")])
def test_exhaustive_beam_finds_the_most_probable_sequence_and_beats_greedy(seed, mode):
    """Two utterances of 4 and 3 frames, V = 3, the encoder output random: a beam wider than
    every hypothesis a frame can have (V^T) is exhaustive, so its answer is the brute force's
    most probable token sequence with the same summed log-probability (float64 search, float32
    weights: equal to 1e-9), at least that of greedy's (one symbol per frame) sequence."""
    v, frames = 3, [4, 3]
    layer, params = _model(v, 5, seed, mode)
    rng = np.random.default_rng(seed + 10)
    params.flat[...] *= 3   # sharper outputs: the sequences' probabilities differ more
    enc = rng.standard_normal((max(frames) * 2, 5)).astype(np.float32)
    lengths = Lengths(frames)
    hyps, scores = search.beam_search(layer, params, enc, lengths, beam=v ** max(frames))
    greedy = search.greedy_search(layer, params, enc, lengths, max_symbols=1)
    for b, f in enumerate(frames):
        table = brute_force(layer, params, enc[np.arange(f) * 2 + b])
        best = max(table, key=table.get)
        assert tuple(hyps[b].tolist()) == best
        assert scores[b] == pytest.approx(table[best], abs=1e-9)
        assert table[tuple(greedy[b].tolist())] <= table[best]


def test_a_narrow_beam_is_batched_like_one_utterance_at_a_time():
    """Utterances searched together give what each gives alone (rows of one GEMM)."""
    layer, params = _model(5, 6, 4)
    rng = np.random.default_rng(7)
    frames = [7, 5, 2]
    enc = rng.standard_normal((7 * 3, 6)).astype(np.float32)
    together, scores = search.beam_search(layer, params, enc, Lengths(frames), beam=3)
    for b, f in enumerate(frames):
        alone, score = search.beam_search(layer, params, enc[np.arange(f) * 3 + b],
                                          Lengths([f]), beam=3)
        assert alone[0].tolist() == together[b].tolist()
        assert score[0] == pytest.approx(scores[b], abs=1e-12)


# --- shallow fusion with a token n-gram (hpcsgd.decode.token_lm) ------------------------------

SENTENCES = [["a", "b"], ["a", "b", "b"], ["b", "a"], ["a"], ["b", "b", "a", "b"]]


def _token_lm(order, symbols=("<blk>", "a", "b")):
    from hpcsgd.decode import lm
    from hpcsgd.decode.token_lm import TokenLM
    model = lm.estimate(SENTENCES, order)
    return TokenLM(model, list(symbols)), model


@pytest.mark.parametrize("order", [1, 2, 3])
def test_token_lm_rows_are_the_arpa_models_log_probabilities(order):
    """Every history up to order-1 tokens: row(h)[k] = ln 10 * lm.logprob(h + (k,)) (the
    backoff reference), final(h) likewise for </s>; the blank column is 0."""
    from hpcsgd.decode import lm as arpa
    token_lm, model = _token_lm(order)
    names = {1: "a", 2: "b"}
    for n in range(order):
        for ys in itertools.product((1, 2), repeat=n):
            ctx = token_lm.context(ys)
            h = tuple(["<s>", *[names[k] for k in ys]][-(order - 1):]) if order > 1 else ()
            row = token_lm.row(ctx)
            assert row[0] == 0
            for k, w in names.items():
                want = np.log(10) * arpa.logprob(model["ngrams"], h + (w,))
                assert row[k] == pytest.approx(want, abs=1e-12)
            want = np.log(10) * arpa.logprob(model["ngrams"], h + ("</s>",))
            assert token_lm.final(ctx) == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("weight,bonus", [(0.5, 0.0), (1.0, 1.5), (2.0, 0.3)])
def test_exhaustive_beam_with_fusion_maximises_the_fused_score(weight, bonus):
    """The LM and the bonus depend on the token sequence only, so an exhaustive beam's
    answer is the brute force's argmax of the summed acoustic probability + weight * (ln
    P_lm(ys) + ln P_lm(</s> | ys)) + bonus * |ys|."""
    v, frames = 3, [4]
    layer, params = _model(v, 5, 5)
    params.flat[...] *= 3
    enc = np.random.default_rng(8).standard_normal((4, 5)).astype(np.float32)
    token_lm, _ = _token_lm(2)
    hyps, scores = search.beam_search(layer, params, enc, Lengths(frames), beam=v ** 4,
                                      lm=token_lm, lm_weight=weight, bonus=bonus)
    table = brute_force(layer, params, enc)

    def lm_score(ys):
        total = sum(token_lm.row(token_lm.context(ys[:i]))[k] for i, k in enumerate(ys))
        return total + token_lm.final(token_lm.context(ys))
    fused = {ys: logp + weight * lm_score(ys) + bonus * len(ys) for ys, logp in table.items()}
    best = max(fused, key=fused.get)
    assert tuple(hyps[0].tolist()) == best
    assert scores[0] + weight * token_lm.final(token_lm.context(best)) == \
        pytest.approx(fused[best], abs=1e-9)
    plain, _ = search.beam_search(layer, params, enc, Lengths(frames), beam=v ** 4)
    assert tuple(plain[0].tolist()) == max(table, key=table.get)
