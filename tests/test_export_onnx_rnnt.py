"""`hpcsgd export --onnx` of RNN-T models (hpcsgd/export_onnx_rnnt.py): the encoder, decoder
and joiner graphs against hpcsgd's forward, prediction network and joint (float32 and
float64); a tiny RNN-T trained on the bundled demo corpus, exported and decoded by sherpa-onnx
from the FLAC files as hpcsgd's searches decode the archive's features. Quantization-aware
RNN-Ts: the integer graphs against hpcsgd's fake-quantized passes within a derived float32
bound (predictor_bound), sherpa-onnx decoding an untrained INT8 and INT4 one as hpcsgd's
greedy search does, and what is still refused."""
import collections
import os

import numpy as np
import pytest

from conftest import assert_float32_close
from test_export_onnx import sherpa_onnx_hyps, trained_and_exported
from hpcsgd.export import write_onnx
from hpcsgd import export_onnx, export_onnx_rnnt
from hpcsgd.model import build

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

LOG_1E_10 = -23.025850929940457   # what sherpa-onnx pads a batch of features with


def rnnt_model(encoder, predictor, joint_mode, seed=1, dtype=np.float32):
    describe = {"type": "rnnt", "input_dim": 40, "encoder": encoder, "num_tokens": 7,
                "predictor": predictor, "embed": 5, "joint": 9, "joint_mode": joint_mode,
                "activation": "relu"}
    model = build(describe, max_batch=256, dtype=dtype)
    params = model.new_params()
    model.init(params, np.random.default_rng(seed))
    return model, params


def session(proto):
    return ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])


def in_dtype(model, params, dtype):
    """The model rebuilt in `dtype` with the same weights (float64: the reference)."""
    twin = build(model.describe, max_batch=256, dtype=dtype)
    p = twin.new_params()
    p.flat[...] = params.flat
    return twin, p


@pytest.mark.parametrize("encoder, predictor, mode", [
    (["stack 3", "conv 8 k3 s2", "blstm 5"], ["lstm 6"], "add"),
    (["conv2d 3 16", "conformer 16 h4 f32 k5 in"], ["lstm 6", "lstm 4"], "mul"),
], ids=["blstm-add", "conformer-2lstm-mul"])
def test_encoder_decoder_joiner_equal_hpcsgd(encoder, predictor, mode):
    """encoder.onnx on a padded batch of 61 and 14 frames (the padding log(1e-10)) gives
    hpcsgd's encoder projection; decoder.onnx, given sherpa-onnx's windows of hypotheses of
    0 to 9 tokens, gives the prediction network after the blank and those tokens
    (Transducer.predict in float32, start + step in float64); joiner.onnx gives joint_logits.
    Each as far from the float64 reference as hpcsgd's float32 is (assert_float32_close)."""
    from test_export_onnx import hpcsgd_outputs
    model, params = rnnt_model(encoder, predictor, mode)
    out = model.layers[-1]
    rng = np.random.default_rng(0)
    mean = rng.normal(5, 2, 40).astype(np.float32)
    inv_std = rng.uniform(0.3, 2, 40).astype(np.float32)
    lengths = [61, 14]
    raw = np.full((2, 61, 40), LOG_1E_10, np.float32)
    for b, n in enumerate(lengths):
        raw[b, :n] = rng.normal(mean, 1 / inv_std, (n, 40))
    enc, enc_lens = session(export_onnx_rnnt.encoder_graph(model, params, mean, inv_std)).run(
        None, {"x": raw, "x_lens": np.array(lengths)})
    ref32 = hpcsgd_outputs(model.describe, params, (raw - mean) * inv_std, lengths, np.float32)
    x64 = (raw.astype(np.float64) - mean.astype(np.float64)) * inv_std.astype(np.float64)
    ref64 = hpcsgd_outputs(model.describe, params, x64, lengths, np.float64)
    assert enc_lens.tolist() == [len(r) for r in ref32]
    for b in range(2):
        assert_float32_close(enc[b, :enc_lens[b]], ref32[b], ref64[b])

    # the decoder: hypotheses of 0..9 tokens in sherpa-onnx's windows [-1 .. -1 0 y_1 .. y_u]
    hyps = [list(rng.integers(1, 7, u)) for u in (0, 1, 4, 9, 2)]
    C = export_onnx_rnnt.CONTEXT_SIZE
    y = np.full((len(hyps), C), -1, np.int64)
    for b, ys in enumerate(hyps):
        y[b, C - 1 - len(ys):] = [0] + ys
    dec, = session(export_onnx_rnnt.decoder_graph(model, params)).run(None, {"y": y})
    ids = np.array([k for ys in hyps for k in ys], np.int64)
    offsets = np.cumsum([0] + [len(ys) for ys in hyps])
    order, pos, plen, tok = out.predictor_batch(ids, offsets)
    pred32 = np.array(out.predict(params, tok, plen, model.ops))
    model64, params64 = in_dtype(model, params, np.float64)
    pred64 = []
    for ys in hyps:   # the search's own arithmetic: start, then a step per token
        pred, state = out.start(params64, 1)
        for k in ys:
            pred, state = out.step(params64, np.array([k]), state)
        pred64.append(pred[0])
    last32 = np.stack([pred32[len(ys) * len(hyps) + pos[b]] for b, ys in enumerate(hyps)])
    assert_float32_close(dec, last32, np.stack(pred64))

    # the joiner, on rows of the two outputs above
    e, d = np.repeat(enc[0, :5], 5, axis=0), np.tile(dec, (5, 1))
    logit, = session(export_onnx_rnnt.joiner_graph(model, params)).run(
        None, {"encoder_out": e, "decoder_out": d})
    assert_float32_close(logit, out.joint_logits(params, e, d),
                         out.joint_logits(params64, e.astype(np.float64), d.astype(np.float64)))


def test_a_hypothesis_longer_than_the_window():
    """A hypothesis of context_size tokens or more (a window of 4 built for the test): the
    decoder runs the LSTM over the window's tokens from the zero state, without the blank
    start -- the documented truncation, and no error -- beside a short hypothesis in the same
    batch, exact. References: the predictor's float32 kernels over those inputs
    (Transducer.predict) and its float64 steps."""
    from hpcsgd.model.lengths import Lengths
    model, params = rnnt_model(["blstm 5"], ["lstm 6"], "add")
    out = model.layers[-1]
    C, ys = 4, [3, 1, 4, 1, 5, 2]
    dec, = session(export_onnx_rnnt.decoder_graph(model, params, context_size=C)).run(
        None, {"y": np.array([ys[-C:], [-1, -1, 0, 2]], np.int64)})
    _, p64 = in_dtype(model, params, np.float64)
    for row, inputs in ((0, ys[-C:]), (1, [0, 2])):
        pred32 = np.array(out.predict(params, np.array(inputs), Lengths([len(inputs)]),
                                      model.ops))
        state = [(np.zeros((1, l.cells)), np.zeros((1, l.cells))) for l in out.pred]
        for k in inputs:   # from the zero state, as Transducer.start does with the blank
            pred64, state = out.step(p64, np.array([k]), state)
        assert_float32_close(dec[row], pred32[-1], pred64[0])


@pytest.fixture(scope="module")
def exported(demo_tokens, tmp_path_factory):
    """A tiny phone RNN-T (stack 3, conv 32 k3, blstm 48; lstm 32 predictor) trained 16
    epochs on the demo corpus' 32 training speakers (about 40 s; the training loss from 4.4
    to about 2 per token), exported with `hpcsgd export --onnx`: (run, out_dir, the
    command's stdout)."""
    pytest.importorskip("sherpa_onnx")
    return trained_and_exported(tmp_path_factory.mktemp("onnx_rnnt"), demo_tokens, [
        "model.type=rnnt", "model.encoder=[stack 3, conv 32 k3, blstm 48]",
        "model.predictor=[lstm 32]", "model.embed=16", "model.joint=48", "train.epochs=16",
        "optim.lr=1e-5"], timeout=600)


def hpcsgd_searches(run, data, train, count, beam=True):
    """{utt: phones} of hpcsgd's greedy search (at most 1 and 3 symbols per frame) and
    modified beam search of 4 (unless not beam) on the first `count` utterances of the
    archive `data`, its raw features normalised with the global statistics of `train` (what
    the export folds into its encoder); a QAT model's searches on its fake-quantized
    weights, as hpcsgd decode's (transducer.on_host)."""
    from hpcsgd.data.loader import iter_utterances
    from hpcsgd.decode import rnnt
    from hpcsgd.model.lengths import Lengths
    from hpcsgd.model.transducer import on_host
    from hpcsgd.model_io import load_model
    model, params, meta = load_model(run)
    layer, weights, _ = on_host(model, params)
    symbols = np.array(meta["tokens"]["symbols"])
    mean, inv_std, _, _ = export_onnx.global_cmvn(train, "meanvar")
    hyps = {"greedy1": {}, "greedy3": {}, "beam4": {}}
    for utt, feats, _ in iter_utterances(data, cmvn="none", shuffle=False):
        if len(hyps["greedy1"]) == count:
            break
        x = np.ascontiguousarray((feats.astype(np.float32) - mean) * inv_std, np.float32)
        enc = np.array(model.forward(params, x, len(x), lengths=[len(x)]))
        n = Lengths([len(enc)])
        hyps["greedy1"][utt] = list(symbols[rnnt.greedy_search(layer, weights, enc, n, 1)[0]])
        hyps["greedy3"][utt] = list(symbols[rnnt.greedy_search(layer, weights, enc, n)[0]])
        if beam:
            hyps["beam4"][utt] = list(symbols[rnnt.beam_search(layer, weights, enc, n,
                                                                4)[0][0]])
    return hyps


def test_sherpa_onnx_decodes_the_audio_as_hpcsgd_does(exported, demo_tokens):
    """sherpa-onnx, loaded by the code `hpcsgd export` prints, recognizes each of 40 FLAC
    files (its own fbank from the audio, the global CMVN inside the encoder graph), one
    stream at a time and in one padded batch, as hpcsgd's greedy search with at most one
    symbol per frame (sherpa-onnx's rule) does on the archive's features normalised with the
    same statistics; its modified_beam_search with 4 active paths as hpcsgd's beam search of
    4. The files are the training archive's first 40 utterances: this is the two decoders'
    parity, not accuracy, and a model this small emits phones on the speakers it trained on
    (on the held-out ones it stays near all-blank). Printed: how many differ from hpcsgd's
    greedy of up to 3 symbols per frame (hpcsgd decode's) and from `hpcsgd decode --greedy`
    (also per-speaker CMVN)."""
    from hpcsgd.families import family
    from hpcsgd.model_io import load_model
    from hpcsgd.outputs import ctc_posteriors
    run, out, stdout = exported
    train = f"{demo_tokens}/train"
    want = hpcsgd_searches(run, train, train, 40)
    code = stdout[stdout.index("import sherpa_onnx"):]
    utts = list(want["greedy1"])
    greedy = sherpa_onnx_hyps(code, utts, "greedy_search", batch=True)
    assert greedy == want["greedy1"]
    assert sum(map(len, greedy.values())) > 20   # not an all-blank model
    beam = sherpa_onnx_hyps(code, utts, "modified_beam_search", batch=True)
    assert beam == want["beam4"]
    model, params, meta = load_model(run)
    encs, _ = ctc_posteriors(model, params, meta, train)
    encs = [(utt, enc) for utt, enc in encs if utt in greedy]
    per_speaker, _ = family("rnnt").search(model, params, encs, meta["tokens"])
    print(f"{sum(map(len, greedy.values()))} phones; sherpa-onnx greedy against hpcsgd's "
          f"greedy of <= 3 symbols per frame: "
          f"{sum(greedy[u] != want['greedy3'][u] for u in utts)} of {len(utts)} differ; "
          f"against hpcsgd decode --greedy (per-speaker CMVN): "
          f"{sum(greedy[u] != per_speaker[u] for u in utts)} differ")


def test_the_export_writes_what_sherpa_onnx_reads(exported):
    """Three graphs with the icefall transducer export's inputs and outputs, the metadata
    sherpa-onnx's loader reads (the decoder's vocab_size and context_size), the CTC export's
    keys, and tokens.txt with <blk> at 0; the printed call names the transducer loader."""
    import onnx
    run, out, stdout = exported
    lines = open(os.path.join(out, "tokens.txt")).read().splitlines()
    assert lines[0] == "<blk> 0"
    names = {"encoder": (["x", "x_lens"], ["encoder_out", "encoder_out_lens"]),
             "decoder": (["y"], ["decoder_out"]),
             "joiner": (["encoder_out", "decoder_out"], ["logit"])}
    for part, (inputs, outputs) in names.items():
        proto = onnx.load(os.path.join(out, f"{part}.onnx"))
        assert [i.name for i in proto.graph.input] == inputs
        assert [o.name for o in proto.graph.output] == outputs
        props = {p.key: p.value for p in proto.metadata_props}
        assert props["vocab_size"] == str(len(lines)) and props["subsampling_factor"] == "3"
        assert props["predictor"] == "lstm 32" and props["joint_mode"] == "add"
    assert props["checkpoint"].startswith(run)
    decoder = onnx.load(os.path.join(out, "decoder.onnx"))
    assert {p.key: p.value for p in decoder.metadata_props}["context_size"] == \
        str(export_onnx_rnnt.CONTEXT_SIZE)
    assert 'model_type="transducer"' in stdout and "snip_edges=True" in stdout


# ---- quantization-aware RNN-T models: the integer graphs --------------------------------

U = 2.0 ** -24


def gamma(k):
    return k * U / (1 - k * U)


def qat(bits, scale="tensor", activations="pact"):
    return {"weights": "sawb", "weight_bits": bits, "activations": activations,
            "activation_bits": bits, "weight_scale": scale}


def activation_error():
    """The largest absolute error of onnxruntime's Sigmoid and Tanh (float32) on a sweep of
    [-20, 20], at least hpcsgd's float32 kernels' (a few ulp of 1: kernels_lstm.ftanh): what
    either side may err by per gate."""
    from onnx import TensorProto, helper
    x = np.linspace(-20, 20, 400001, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Sigmoid", ["x"], ["s"]), helper.make_node("Tanh", ["x"], ["t"])],
        "act", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [None]) for n in "st"])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    proto.ir_version = 8
    s, t = session(proto).run(None, {"x": x})
    x64 = x.astype(np.float64)
    return max(np.abs(s - 1 / (1 + np.exp(-x64))).max(), np.abs(t - np.tanh(x64)).max(),
               8 * U)


def gemm_bound(a, w, b, da=0.0):
    """How far two float32 evaluations of a @ w + b (a, w on the grids both read, a's own
    difference da between them) may differ, per output: the integer CTC tests' bound (each
    side's sum within gamma_K of the exact one, the scales and the bias 3 roundings) and the
    difference carried in, |da| @ |w| (1 + gamma_K)."""
    a, w, b, da = (np.asarray(v, np.float64) for v in (a, w, b, da))
    k = w.shape[0] + 1
    return ((2 * gamma(k) + 3 * U) * (np.abs(a) @ np.abs(w) + np.abs(b).reshape(-1))
            + (1 + gamma(k)) * (np.abs(da) @ np.abs(w) if da.ndim else 0.0))


def predictor_bound(out, wq, inputs, eps):
    """The prediction network over one hypothesis' inputs [blank, y_1 .. y_u], stepped in
    float64 on the grids of training (model/transducer.py: each LSTM input above the first
    and h_(t-1) on [-1, 1] where QAT quantizes them; the embedding's rows on the weights'
    grid) -> (its pred (joint,), how far two float32 evaluations may differ, per value).
    Where a value is quantized both read the same codes (no flip), so nothing before it
    counts; elsewhere the difference propagates: the gate pre-activations as gemm_bound
    (x W + b + h U, one sum), sigmoid and tanh by their slopes 1/4 and 1 plus each side's
    `eps`, c = f c' + i g and h = o tanh(c) term by term (their products' second-order terms
    and 2 x 3 roundings included), then the float projection pred = h Wp + bp."""
    from hpcsgd.model.lstm import on_grid
    from hpcsgd.model.quantize import symmetric_grid
    p = {k: np.asarray(v, np.float64) for k, v in wq.items()}
    x, dx = p[out.E][inputs], np.zeros((len(inputs), out.embed))
    sig = lambda v: 1 / (1 + np.exp(-v))   # noqa: E731
    for k, lstm in enumerate(out.pred):
        if k and out.input_bits:
            x, dx = on_grid(x, symmetric_grid(1.0, out.input_bits)), np.zeros_like(dx)
        hc, wu = lstm.cells, np.concatenate([p[lstm.W], p[lstm.U[0]]])
        h, c, dh, dc = (np.zeros(hc) for _ in range(4))
        ys, dys = [], []
        for t in range(len(inputs)):
            hin, dhin = h, dh
            if lstm.hidden_grid is not None:
                hin, dhin = on_grid(h[None], lstm.hidden_grid)[0], np.zeros(hc)
            a = np.concatenate([x[t], hin])
            v = a @ wu + p[lstm.b][0]
            dv = gemm_bound(a, wu, p[lstm.b], np.concatenate([dx[t], dhin]))
            i, f, g, o = (v[q * hc:(q + 1) * hc] for q in range(4))
            di, df, dg, do = (dv[q * hc:(q + 1) * hc] for q in range(4))
            i, f, o, g = sig(i), sig(f), sig(o), np.tanh(g)
            di, df, do, dg = di / 4 + 2 * eps, df / 4 + 2 * eps, do / 4 + 2 * eps, dg + 2 * eps
            c_prev, dc_prev, c = c, dc, f * c + i * g
            dc = (f * dc_prev + np.abs(c_prev) * df + df * dc_prev + i * dg + np.abs(g) * di
                  + di * dg + 6 * U * (np.abs(f * c_prev) + np.abs(i * g)))
            tc = np.tanh(c)
            dtc = dc + 2 * eps
            h = o * tc
            dh = np.abs(tc) * do + o * dtc + do * dtc + 2 * U * np.abs(h)
            ys.append(h)
            dys.append(dh)
        x, dx = np.array(ys), np.array(dys)
    pred = x[-1] @ p[out.Wp] + p[out.bp][0]
    return pred, gemm_bound(x[-1], p[out.Wp], p[out.bp], dx[-1])


# encoders whose last layer is a dense one with a quantized input, so that what comes before
# it (the Conformer's float residual stream too) leaves no trace but through its codes
QAT_CASES = {
    "conv-int8": (["stack 3", "conv 16 k3 s2", "dense 24"], ["lstm 6", "lstm 4"], "add",
                  qat(8), True),
    "conformer-int4": (["conv2d 3 16", "conformer 16 h4 f32 k5", "dense 24"],
                       ["lstm 6", "lstm 4"], "mul", qat(4, "channel"), True),
    # --onnx-int8: the 4-bit codes as int8
    "conformer-int4-as-int8": (["conv2d 3 16", "conformer 16 h4 f32 k5", "dense 24"],
                               ["lstm 6"], "add", qat(4, "channel"), False),
    # weights only: the LSTMs are ONNX's float LSTM on the fake-quantized weights
    "conv-int8-weights": (["stack 3", "conv 16 k3 s2", "dense 24"], ["lstm 6", "lstm 4"],
                          "add", qat(8, activations="none"), True),
    # and at INT4: every GEMM's input float, the int4 codes cast and scaled
    "conv-int4-weights": (["stack 3", "conv 16 k3 s2", "dense 24"], ["lstm 6", "lstm 4"],
                          "add", qat(4, "channel", activations="none"), True),
}


@pytest.mark.parametrize("case", list(QAT_CASES))
def test_integer_graphs_equal_the_fake_quantized_forward(case, tmp_path):
    """An untrained QAT RNN-T, the three graphs through onnxruntime against hpcsgd's
    fake-quantized passes (the weights each pass runs on, Network.pass_weights), within the
    bound of the float32 arithmetic after the last quantized value (gemm_bound,
    predictor_bound: the integer CTC tests' derivation, carried through the float ops
    that follow):
      encoder.onnx on a padded batch of 61 and 14 frames: hpcsgd's forward (the encoder
        projection enc), after the last encoder layer's quantized input a: its GEMM, ReLU,
        then the float projection (QAT keeps the joint float);
      decoder.onnx on sherpa-onnx's windows of hypotheses of 0 to 9 tokens: Transducer.predict
        (the training kernels) after the blank and those tokens, through the recurrence;
      joiner.onnx: joint_logits (float32), tanh (each side's eps) then the output GEMM.
    The graphs hold what QAT quantizes: the encoder's and the decoder's weights as codes
    (int8 behind DequantizeLinear, or Cast and Mul before a float input; at INT4 int4 tensors
    Cast and Mul, the graph opset 21 / IR 10, all folded to float32 when onnxruntime loads
    it), the predictor's h_(t-1) through a Scan LSTM where the activations are quantized
    (ONNX's LSTM where they are not), nothing in the joiner; no MatMulNBits, in the file or
    in onnxruntime's optimised graph."""
    from hpcsgd import export_onnx_int
    from test_export_onnx import hpcsgd_outputs, padded_batch
    from test_export_onnx_int import optimized_ops
    encoder, predictor, mode, q, nbits = QAT_CASES[case]
    describe = {"type": "rnnt", "input_dim": 40, "encoder": encoder, "num_tokens": 7,
                "predictor": predictor, "embed": 5, "joint": 9, "joint_mode": mode,
                "activation": "relu", "qat": q}
    model = build(describe, max_batch=256)
    params = model.new_params()
    model.init(params, np.random.default_rng(1))
    out = model.layers[-1]
    eps = activation_error()
    mean, inv_std, lengths, raw = padded_batch()
    protos = {part: build_(model, model.wq, g=export_onnx_int.IntGraph(model, params, nbits))
              for part, build_ in (("encoder", lambda m, p, g: export_onnx_rnnt.encoder_graph(
                                       m, p, mean, inv_std, g=g)),
                                   ("decoder", export_onnx_rnnt.decoder_graph))}
    protos["joiner"] = export_onnx_rnnt.joiner_graph(model, model.wq)
    wq = {name: np.array(model.wq[name]) for name in model.wq.views}

    enc, enc_lens = session(protos["encoder"]).run(None, {"x": raw, "x_lens": np.array(lengths)})
    dense = model.layers[-2]
    float_twin = {k: v for k, v in describe.items() if k != "qat"}
    for b, n in enumerate(lengths):
        feats = np.ascontiguousarray((raw[b, :n] - mean) * inv_std, np.float32)
        want = np.array(model.forward(params, feats, n, lengths=[n]))
        assert enc_lens[b] == len(want)
        if q["activations"] == "none":   # nothing quantized between the weights: the float
            # tests' criterion, the float64 reference the float model on the same weights
            x64 = (raw[b:b + 1, :n].astype(np.float64) - mean) * inv_std
            ref64, = hpcsgd_outputs(float_twin, model.wq, x64, [n], np.float64)
            assert_float32_close(enc[b, :enc_lens[b]], want, ref64)
            continue
        a = np.array(model.aq[-2][:len(want)], np.float64)   # the dense layer's quantized input
        z = a @ wq[dense.W] + wq[dense.b]
        dz = gemm_bound(a, wq[dense.W], wq[dense.b])
        bound = gemm_bound(np.maximum(z, 0), wq[out.W], wq[out.b], dz)
        got = enc[b, :enc_lens[b]]
        assert (np.abs(got - want) <= bound).all(), (b, np.abs(got - want).max())

    # the decoder: hypotheses of 0..9 tokens in sherpa-onnx's windows [-1 .. -1 0 y_1 .. y_u]
    rng = np.random.default_rng(0)
    hyps = [list(rng.integers(1, 7, u)) for u in (0, 1, 4, 9, 2)]
    C = export_onnx_rnnt.CONTEXT_SIZE
    y = np.full((len(hyps), C), -1, np.int64)
    for b, ys in enumerate(hyps):
        y[b, C - 1 - len(ys):] = [0] + ys
    dec, = session(protos["decoder"]).run(None, {"y": y})
    ids = np.array([k for ys in hyps for k in ys], np.int64)
    order, pos, plen, tok = out.predictor_batch(ids, np.cumsum([0] + [len(ys) for ys in hyps]))
    pred32 = np.array(out.predict(model.wq, tok, plen, model.ops))
    for b, ys in enumerate(hyps):
        want = pred32[len(ys) * len(hyps) + pos[b]]
        pred64, bound = predictor_bound(out, wq, [0] + ys, eps)
        assert (np.abs(dec[b] - want) <= bound).all(), (b, np.abs(dec[b] - want).max())
        assert (np.abs(pred64 - want) <= bound).all()   # the bound's own trajectory

    # the joiner, on rows of the two outputs above
    e, d = np.repeat(enc[0, :5], 5, axis=0), np.tile(dec, (5, 1))
    logit, = session(protos["joiner"]).run(None, {"encoder_out": e, "decoder_out": d})
    want = out.joint_logits(model.wq, e, d)   # float32: the same sum or product, tanh
    e64, d64 = e.astype(np.float64), d.astype(np.float64)
    h = np.tanh(e64 + d64 if mode == "add" else e64 * d64)
    # enc + pred (enc * pred) the same float32 operation on both sides, then each side's tanh
    bound = gemm_bound(h, wq[out.Wo], wq[out.bo], np.full(h.shape, 2 * eps))
    assert (np.abs(logit - want) <= bound).all(), np.abs(logit - want).max()

    ops = {part: collections.Counter(n.op_type for n in proto.graph.node)
           for part, proto in protos.items()}
    quantized_h = q["activations"] != "none"
    assert ops["decoder"]["Scan" if quantized_h else "LSTM"] == len(predictor)
    int4 = q["weight_bits"] == 4 and nbits
    for part, proto in protos.items():
        assert (proto.opset_import[0].version, proto.ir_version) == (
            (21, 10) if int4 and part != "joiner" else (17, 8)), part
        # the weights' codes (int4, or int8): the encoder's, the decoder's embedding and,
        # with quantized activations, its Scan LSTMs' W and U (ONNX's LSTM reads s * k)
        codes = collections.Counter(
            (t.data_type, "int4" if "_int4_" in t.name else "codes" if "_codes_" in t.name
             else None) for t in proto.graph.initializer)
        kind = (onnx.TensorProto.INT4, "int4") if int4 else (onnx.TensorProto.INT8, "codes")
        n_codes = {"decoder": 1 + 2 * len(predictor) * quantized_h, "joiner": 0}
        if part in n_codes:
            assert codes[kind] == n_codes[part], part
        else:
            assert codes[kind] > 0, part
        assert sum(codes[t, n] for t, n in codes if n) == codes[kind], part   # no other kind
        # onnxruntime rewrote no DequantizeLinear -> MatMul as an int8-activation MatMulNBits;
        # at INT4 it folded every int4 weight into float32
        ran, folded, _ = optimized_ops(proto, tmp_path)
        assert not ops[part]["MatMulNBits"] and not ran["MatMulNBits"], part
        if int4:
            assert not folded[onnx.TensorProto.INT4], part
    assert not {"QuantizeLinear", "DequantizeLinear", "Cast"} & set(ops["joiner"])


@pytest.mark.parametrize("encoder, q, streaming, words", [
    (["blstm 3"], qat(8), False, "encoder layer 'blstm 3' with quantized activations"),
    (["conv 8 k3", "dense 6"], qat(8, activations="max"), False, "dynamic input grids"),
    (["lstm 3"], qat(8, activations="none"), True,
     "--streaming: a quantization-aware model")], ids=["blstm", "dynamic", "streaming"])
def test_what_a_qat_rnnt_export_still_refuses_is_named(encoder, q, streaming, words, tmp_path):
    """A QAT RNN-T's integer graphs have the CTC export's limits (export_onnx_int.refusal):
    an encoder (B)LSTM with quantized activations (ONNX's LSTM cannot quantize h_(t-1); the
    prediction network's LSTMs are Scan loops that do), dynamic input grids; and the
    streaming graphs are float only. Each named, nothing written."""
    from test_export_onnx import fake_run
    from hpcsgd.errors import UserError
    run = fake_run(tmp_path / "run", {
        "type": "rnnt", "input_dim": 4, "num_tokens": 5, "activation": "relu",
        "encoder": encoder, "predictor": ["lstm 4"], "embed": 4, "joint": 6, "qat": q})
    with pytest.raises(UserError, match=words):
        write_onnx(run, str(tmp_path / "out"), streaming=streaming)
    assert not os.path.exists(tmp_path / "out")


# untrained, 12 utterances: a phone on one output frame in 5 (conv), in 2 (conformer)
BLANK_BIAS = 1.5


SHERPA_ENCODERS = {"conv": ["stack 3", "conv 32 k3", "dense 32"],
                   "conformer": ["conv2d 8 32", "conformer 32 h4 f64 k7"]}


@pytest.mark.parametrize("encoder", list(SHERPA_ENCODERS))
@pytest.mark.parametrize("bits", [8, 4])
def test_sherpa_onnx_decodes_a_qat_rnnt_as_hpcsgd_does(bits, encoder, demo_tokens, tmp_path):
    """An untrained (so never all-blank) QAT RNN-T over the demo's 40-dim fbank (a conv/dense
    and a Conformer encoder), exported by write_onnx (INT8; INT4: int4 codes, opset 21), the
    predictor's h_(t-1) quantized at every step:
    sherpa-onnx's transducer greedy_search, loaded by the printed code, recognizes the first
    12 held-out FLAC files, one stream at a time and in one padded batch, as hpcsgd's greedy
    search of at most one symbol per frame on the archive's features with the same global
    normalisation."""
    pytest.importorskip("sherpa_onnx")
    from hpcsgd.data import archive
    from test_export_onnx import fake_run
    train = f"{demo_tokens}/train"
    symbols = archive.read_tokens(train, "phones")

    def blank_bias(views):   # the blank's logit raised: a token every few frames, not each
        views["joint.out.b"][0, 0] = BLANK_BIAS

    run = fake_run(tmp_path / "run", {
        "type": "rnnt", "input_dim": 40, "num_tokens": len(symbols), "activation": "relu",
        "encoder": SHERPA_ENCODERS[encoder], "predictor": ["lstm 16"],
        "embed": 8, "joint": 16, "joint_mode": "add",
        "qat": qat(bits, "channel" if bits == 4 else "tensor")}, symbols, blank_bias)
    done = write_onnx(run, str(tmp_path / "onnx"), stats=train)
    assert "joiner: none" in done["quantization"]
    # the decoder's codes counted as built: the embedding and the Scan LSTM's W and U
    assert f"decoder: INT{bits} weights (3 int{bits} tensors)" in done["quantization"]
    for part in ("encoder", "decoder", "joiner"):   # INT4: opset 21 where the int4 tensors are
        proto = onnx.load(done[part])
        assert proto.opset_import[0].version == (21 if bits == 4 and part != "joiner" else 17)
        said = {p.key: p.value for p in proto.metadata_props}["quantization"]
        assert f"{part}: {said}" in done["quantization"]
    want = hpcsgd_searches(run, f"{demo_tokens}/cv", train, 12, beam=False)["greedy1"]
    got = sherpa_onnx_hyps(done["code"], list(want), "greedy_search", batch=True)
    print(f"{encoder} {bits} bits: {sum(map(len, want.values()))} phones in {len(want)} "
          f"utterances")
    assert got == want
    assert sum(map(len, want.values())) > 20   # not an all-blank model


def test_tokens_spell_unk_as_its_surface():
    """A BPE inventory's <unk> becomes ⁇ in tokens.txt (sherpa-onnx's transducer searches
    would take a symbol named <unk> for the blank); the rest as the CTC export writes it."""
    assert export_onnx_rnnt.transducer_tokens(["<blk>", "<unk>", "\u2581the", "s"], "bpe") == \
        "<blk> 0\n\u2047 1\n\u2581the 2\ns 3\n"
    assert export_onnx_rnnt.transducer_tokens(["<blk>", "AA"], "phones") == \
        "<blk> 0\n\u2581AA 1\n"
