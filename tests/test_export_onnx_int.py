"""`hpcsgd export --onnx` of quantization-aware CTC models (hpcsgd/export_onnx_int.py): the
integer graph's log-posteriors against hpcsgd's fake-quantized forward (eval mode) within the
float32 bound of the last GEMM, for INT8 (QDQ, fused by onnxruntime into MatMulIntegerToFloat)
and INT4 (int4 codes, cast and scaled: float MatMul and Conv) conv/dense and Conformer
encoders, untrained and trained on the demo corpus, and the INT4 file's size from its counts;
sherpa-onnx decoding the exports from the audio as hpcsgd decodes the features, and its
runtime computing the INT4 products exactly; the models it refuses, named.

The bound. Every GEMM input is quantized by the graph exactly as by hpcsgd (the same float32
product x * (1/s), round half to even, the same clamp), so wherever a quantizer's float input
is the same the codes are, and what came before it leaves no trace: the output layer's
input is quantized, so its codes are hpcsgd's unless one of its inputs (or one further down)
fell on a rounding boundary and float32 rounding tipped it (a flip). Without a flip the
log-posteriors differ only by the last GEMM, its bias and the log-softmax:
  z_j = sum_k a_k w_kj + b_j: hpcsgd's float32 sum errs by at most gamma_K sum_k |a_k w_kj|
  (gamma_K = K u / (1 - K u), u = 2^-24), onnxruntime's integer sum is exact then scaled by
  s_a s_w (2 roundings; INT4's float MatMul of s * k: gamma_K again), the bias one rounding each:
      |dz_j| <= e_j = (2 gamma_K + 3u) (sum_k |a_k w_kj| + |b_j|)
  log_softmax_j = z_j - log sum_i exp z_i moves by |dz_j| + max_i |dz_i|, plus each side's
  own rounding of the log-sum-exp ((V + 2) u + u max|z|) and of the subtraction (u |lp_j|).
A frame beyond that bound has a flip. How often: an input whose two float32 computations
differ by d flips with probability about 2 d / s per element; in the trained Conformer below
(8-bit steps s ~ 0.03 on inputs of magnitude ~1, d ~ 1e-6 of it, some 15000 quantized inputs
an utterance) that is ~0.5 flips an utterance at INT8, 16 times fewer at INT4, and the
attention spreads one flip to every frame of its utterance. So the untrained models' padded
batches (few inputs) are held to the bound at every frame, and the trained ones are compared
by their greedy hypotheses, the flips counted and printed."""
import collections
import os

import numpy as np
import pytest

from conftest import run_train
from test_export_onnx import padded_batch
from hpcsgd.export import write_onnx
from hpcsgd import export_onnx, export_onnx_int
from hpcsgd.decode import ctc
from hpcsgd.errors import UserError
from hpcsgd.model import build

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

U = 2.0 ** -24
CONV = ["stack 3", "conv 16 k3 s2", "dense 24"]
CONFORMER = ["conv2d 4 16", "conformer 16 h4 f32 k5", "conformer 16 h2 f24 k3 in"]


def qat(bits, scale="tensor"):
    return {"weights": "sawb", "weight_bits": bits, "activations": "pact",
            "activation_bits": bits, "weight_scale": scale}


def hpcsgd_outputs(model, params, feats):
    """hpcsgd's fake-quantized forward of one utterance (T, D): its log-posteriors, the
    output layer's quantized input a, and that layer's fake-quantized W and b."""
    lp = np.array(model.forward(params, feats, len(feats), lengths=[len(feats)]))
    out = model.layers[-1]
    a = np.array(model.aq[-1][:len(lp)])
    return lp, a, np.array(model.wq[out.W]), np.array(model.wq[out.b]).reshape(-1)


def beyond_bound(got, lp, a, w, b):
    """Frames where onnxruntime's log-posteriors `got` leave the module docstring's bound
    around hpcsgd's `lp` (rows: frames), a boolean per frame."""
    a, w, b, lp = (np.asarray(v, np.float64) for v in (a, w, b, lp))
    k, v = w.shape
    gamma = k * U / (1 - k * U)
    z = a @ w + b
    e = (2 * gamma + 3 * U) * (np.abs(a) @ np.abs(w) + np.abs(b))
    tol = (e + e.max(1, keepdims=True)
           + 2 * ((v + 2) * U + U * np.abs(z).max(1, keepdims=True) + U * np.abs(lp)))
    return (np.abs(np.asarray(got, np.float64) - lp) > tol).any(1)


def optimized_ops(proto, tmp_path):
    """The op types of onnxruntime's CPU provider's optimised graph (what it runs), its
    initializers' data types (what it folded them to), and its Convs whose weight is computed
    at every call rather than a folded constant."""
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    graph = onnx.load(so.optimized_model_filepath).graph
    constants = {t.name for t in graph.initializer}
    return (collections.Counter(n.op_type for n in graph.node),
            collections.Counter(t.data_type for t in graph.initializer),
            [n.name for n in graph.node if "Conv" in n.op_type and n.input[1] not in constants])


CASES = {"conv-int8": (CONV, qat(8), True), "conv-int4": (CONV, qat(4, "channel"), True),
         "conformer-int8": (CONFORMER, qat(8), True),
         "conformer-int4": (CONFORMER, qat(4, "channel"), True),
         # --onnx-int8: 4-bit codes in int8, the INT8 form
         "conformer-int4-as-int8": (CONFORMER, qat(4, "channel"), False)}


@pytest.mark.parametrize("case", list(CASES))
def test_integer_graph_equals_the_fake_quantized_forward(case, tmp_path):
    """Two utterances of 61 and 14 frames in one padded batch (the padding sherpa-onnx's
    log(1e-10)), an untrained QAT model: the graph's log-posteriors are hpcsgd's eval-mode
    forward's within the bound, every frame; the graph holds the integer ops, and
    onnxruntime's optimised graph runs MatMulIntegerToFloat (INT8, and INT4 with
    --onnx-int8) for every MatMul with a quantized weight, or (INT4) a float MatMul of the
    int4 codes' values, folded at load (no int4 initializer left), never MatMulNBits (its
    default accuracy_level 4 would requantize the inputs); the INT4 file's initializers are
    the nibbles, a step per unit and the float graph's remainder."""
    encoder, q, nbits = CASES[case]
    describe = {"type": "ctc", "input_dim": 40, "encoder": encoder, "num_tokens": 7,
                "activation": "relu", "qat": q}
    model = build(describe, max_batch=256)
    params = model.new_params()
    model.init(params, np.random.default_rng(1))
    mean, inv_std, lengths, raw = padded_batch()
    g = export_onnx_int.IntGraph(model, params, int4=nbits)
    proto = export_onnx.graph(model, model.wq, mean, inv_std, g=g)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    lp, lp_len = sess.run(None, {"x": raw, "x_lens": np.array(lengths, np.int64)})
    for b, n in enumerate(lengths):
        want = hpcsgd_outputs(model, params, (raw[b, :n] - mean) * inv_std)
        assert lp_len[b] == len(want[0])
        assert not beyond_bound(lp[b, :lp_len[b]], *want).any(), b
    floats = export_onnx.graph(model, params, mean, inv_std).graph   # MatMuls of a weight:
    weights = {init.name for init in floats.initializer}
    matmuls = sum(n.op_type == "MatMul" and n.input[1] in weights for n in floats.node)
    in_file = collections.Counter(n.op_type for n in proto.graph.node)
    ran, folded, unfolded_convs = optimized_ops(proto, tmp_path)
    assert in_file["QuantizeLinear"] == len(g.grids) and not ran["MatMulNBits"]
    assert ran["Conv"] + ran["FusedConv"] and not unfolded_convs   # float Convs, folded weights
    # what stays float: a Conformer block's attention products Q K^T and P V (and at INT4
    # every weight's MatMul, on the dequantized codes)
    attention = 2 * (len(encoder) - 1) if "conformer" in case else 0
    if q["weight_bits"] == 4 and nbits:
        assert proto.opset_import[0].version == 21 and proto.ir_version == 10
        assert not ran["MatMulIntegerToFloat"] and not folded[onnx.TensorProto.INT4]
        assert ran["MatMul"] + ran["FusedMatMul"] == matmuls + attention
        assert_int4_size(proto, floats, g)
    else:
        assert ran["MatMulIntegerToFloat"] == matmuls
        assert ran["MatMul"] + ran["FusedMatMul"] == attention


def init_bytes(tensor):
    return len(tensor.raw_data) or onnx.numpy_helper.to_array(tensor).nbytes


def assert_int4_size(proto, floats, g):
    """The INT4 graph's initializers: each quantized weight as ceil(count / 2) bytes of int4
    nibbles and a float32 step per output unit, the rest no more than the float graph's
    initializers other than those weights, plus the Q/DQ scalars and shapes (at most 64
    bytes a quantized weight or input)."""
    int4 = [t for t in proto.graph.initializer if t.data_type == onnx.TensorProto.INT4]
    assert len(int4) == len(g.codes) == g.counts["weights_int4"]
    nibbles = sum(-(-codes.size // 2) for codes, _ in g.codes.values())
    steps = sum(4 * step.size for _, step in g.codes.values())
    assert sum(init_bytes(t) for t in int4) == nibbles
    weights = {name for name in g.codes}
    remainder = sum(init_bytes(t) for t in floats.initializer if t.name not in weights)
    total = sum(init_bytes(t) for t in proto.graph.initializer)
    assert total <= nibbles + steps + remainder + 64 * (len(g.codes) + len(g.grids))


def test_int4_packing():
    """A (37, 3) code matrix in [-8, 7] as an int4 tensor: 56 bytes (111 nibbles, the last
    high one 0), read back by onnx as the same codes; a code outside int4 is named."""
    codes = (np.arange(111).reshape(37, 3) % 16 - 8).astype(np.int8)
    t = export_onnx_int.int4_tensor(codes, "w")
    assert t.data_type == onnx.TensorProto.INT4 and list(t.dims) == [37, 3]
    assert len(t.raw_data) == 56 and t.raw_data[-1] >> 4 == 0
    assert np.array_equal(onnx.numpy_helper.to_array(t).astype(np.int8), codes)
    with pytest.raises(UserError, match=r"int4 holds \[-8, 7\]"):
        export_onnx_int.int4_tensor(np.array([[8]], np.int8), "w")


def test_sherpa_onnx_runtime_multiplies_int4_weights_exactly(tmp_path):
    """sherpa-onnx's own onnxruntime (and the Python one) runs export_onnx_int.codes_times_step (int4
    codes, Cast, times the step) -> MatMul in float32 on s * k: products of inputs and weights
    on power-of-two grids sum exactly in float32 in any order, so the result equals the
    float64 one bit for bit. The inputs include 2^-10 beside values near 4, which an int8
    requantization of the inputs per block (MatMulNBits at accuracy_level 4) would lose. The
    check sees one ulp: the same graph against a result one ulp off is told apart."""
    pytest.importorskip("sherpa_onnx")
    from test_export_onnx import marker_model, ort_marker, sherpa_marker
    rng = np.random.default_rng(0)
    k, n = 144, 24
    codes = rng.integers(-7, 8, (k, n)).astype(np.int8)
    step = np.full(n, 2.0 ** -4, np.float32)
    x = (rng.integers(-4096, 4097, (3, 5, k)) * 2.0 ** -10).astype(np.float32)
    x[..., ::7] = 2.0 ** -10
    want = (x.astype(np.float64) @ (codes * np.float64(2.0 ** -4))).astype(np.float32)
    off = want.copy()
    off[1, 2, 3] = np.nextafter(off[1, 2, 3], np.float32(np.inf))
    said = []
    for expect in (want, off):
        g = export_onnx.Graph()
        w = export_onnx_int.codes_times_step(g, codes, step, "w")
        ok = g.op("Equal", [g.op("MatMul", [g.const(x), w]), g.const(expect)])
        m = marker_model(g, ok, opset=21, ir_version=10)
        said.append((ort_marker(m), sherpa_marker(m, tmp_path / str(len(said)))))
    assert said == [(True, True), (False, False)]


@pytest.mark.parametrize("bits", [8, 4])
def test_a_weights_only_graph_equals_the_float_forward_on_its_weights(bits, tmp_path):
    """qat.activations none: nothing quantized between the weights, so the graph is the float
    graph on the fake-quantized weights, held to the float tests' criterion against the float
    model's float64 forward on those weights; its MatMuls read the codes (int8, or int4 at
    INT4) through Cast and Mul, which onnxruntime folds, not a DequantizeLinear it would
    rewrite as a MatMulNBits quantizing the float input to int8 (0.06 off in 2-norm, against
    7e-6)."""
    from conftest import assert_float32_close
    from test_export_onnx import hpcsgd_outputs as float_outputs
    describe = {"type": "ctc", "input_dim": 40, "encoder": CONV, "num_tokens": 7,
                "activation": "relu",
                "qat": {**qat(bits, "channel" if bits == 4 else "tensor"), "activations": "none"}}
    model = build(describe, max_batch=256)
    params = model.new_params()
    model.init(params, np.random.default_rng(1))
    mean, inv_std, lengths, raw = padded_batch()
    proto = export_onnx.graph(model, model.wq, mean, inv_std,
                              g=export_onnx_int.IntGraph(model, params))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    lp, lp_len = sess.run(None, {"x": raw, "x_lens": np.array(lengths, np.int64)})
    float_twin = {k: v for k, v in describe.items() if k != "qat"}
    for b, n in enumerate(lengths):
        x = (raw[b:b + 1, :n] - mean) * inv_std
        feats = np.ascontiguousarray(x[0], np.float32)
        want = np.array(model.forward(params, feats, n, lengths=[n]))
        ref64, = float_outputs(float_twin, model.wq, x.astype(np.float64), [n], np.float64)
        assert_float32_close(lp[b, :lp_len[b]], want, ref64)
    in_file = collections.Counter(n.op_type for n in proto.graph.node)
    assert in_file["Cast"] >= 2 and not in_file["QuantizeLinear"]
    assert proto.opset_import[0].version == (21 if bits == 4 else 17)
    ran, folded, _ = optimized_ops(proto, tmp_path)
    assert not ran["MatMulNBits"] and not ran["MatMulIntegerToFloat"]
    assert not folded[onnx.TensorProto.INT4]   # INT4: every weight folded to float32


def test_zero_points():
    """A grid's codes in int8: zero point 0 where they fit, else from -128 up; an 8-bit range
    without zero is named."""
    from hpcsgd.model.quantize import affine_grid, symmetric_grid
    assert export_onnx_int.zero_point(symmetric_grid(2.0, 8), "x") == 0
    assert export_onnx_int.zero_point(affine_grid(0.0, 1.0, 8), "x") == -128
    assert export_onnx_int.zero_point(affine_grid(0.5, 1.0, 4), "x") == 0
    with pytest.raises(UserError, match=r"in1: its grid's range \[1, 2\] \(codes "
                                        r"\[255, 510\], .*\) holds no zero"):
        export_onnx_int.zero_point(affine_grid(1.0, 2.0, 8), "in1")


def fake_qat_run(path, encoder, q):
    """A run directory with an initialised QAT model's checkpoint (no training)."""
    from test_export_onnx import fake_run
    return fake_run(path, {"type": "ctc", "input_dim": 4, "num_tokens": 5,
                           "activation": "relu", "encoder": encoder, "qat": q})


@pytest.mark.parametrize("encoder, q, words", [
    (["conv 8 k3", "dense 6"], {**qat(8), "activations": "max"}, "dynamic input grids"),
    (["conv 8 k3", "blstm 4"], qat(8), "encoder layer 'blstm 4' with quantized activations")])
def test_models_without_an_exact_integer_graph_are_named(encoder, q, words, tmp_path):
    run = fake_qat_run(tmp_path / "run", encoder, q)
    with pytest.raises(UserError, match=words):
        write_onnx(run, str(tmp_path / "onnx"))


# ---- trained on the demo corpus ------------------------------------------------------------

# A conv/dense CTC model stays on CTC's all-blank plateau on the demo corpus for the 20
# epochs a test can spend (float or QAT: [stack 3, conv 64 k5, conv 64 k5 d2, dense 64]
# decodes no phone): conv/dense graphs are checked untrained (above, and through sherpa-onnx
# below), the trained ones are Conformers
CONFORMER_TRAINED = "[conv2d 8 32, conformer 32 h4 f64 k7, conformer 32 h4 f64 k7]"
TRAINED = {"conformer-int8": (CONFORMER_TRAINED, qat(8), 12, 5e-6),   # qat, epochs, rate
           "conformer-int4": (CONFORMER_TRAINED, qat(4, "channel"), 12, 5e-6)}


@pytest.fixture(scope="module", params=list(TRAINED))
def trained(request, demo_tokens, tmp_path_factory):
    """A tiny phone CTC model trained with QAT from scratch on the demo corpus (a frame CE
    head beside CTC to leave the all-blank plateau sooner), exported by `hpcsgd export
    --onnx`: (case, run, out_dir, stdout)."""
    encoder, q, epochs, lr = TRAINED[request.param]
    base = tmp_path_factory.mktemp(request.param)
    run, out = str(base / "run"), str(base / "onnx")
    proc = run_train(1, [f"data.train={demo_tokens}/train", f"data.cv={demo_tokens}/cv",
                         f"train.run_dir={run}", "model.type=ctc", f"model.encoder={encoder}",
                         "data.tokens=phones", "model.frame_ce=0.5", "train.minibatch=2000",
                         f"train.epochs={epochs}", "optim.type=adam", f"optim.lr={lr}",
                         "optim.momentum_tc=0", "schedule.type=constant"]
                     + [f"qat.{k}={v}" for k, v in q.items()], timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import subprocess
    import sys
    from conftest import REPO
    cli = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "export", run, "--onnx", out],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    return request.param, run, out, cli.stdout


def test_trained_integer_graph_on_the_held_out_utterances(trained, demo_tokens):
    """The 40 held-out utterances' archive features, normalised by the graph (global CMVN):
    onnxruntime's greedy hypotheses are those of hpcsgd's fake-quantized forward on the same
    normalised features (at most 1 of 40 may differ: a flip next to a close decision); the
    frames beyond the bound (flips, the module docstring) and the largest difference there
    are printed (measured: INT8 9 of 40 utterances, |d log p| <= 0.08; INT4 none)."""
    from hpcsgd.data.loader import iter_utterances
    from hpcsgd.model_io import load_model
    from test_export_onnx import global_normalize
    case, run, out, _ = trained
    model, params, _ = load_model(run)
    normalize = global_normalize(f"{demo_tokens}/train")
    sess = ort.InferenceSession(os.path.join(out, "model.onnx"),
                                providers=["CPUExecutionProvider"])
    frames = flips = differ = tokens = flipped = 0
    largest = 0.0
    for utt, feats, _ in iter_utterances(f"{demo_tokens}/cv", cmvn="none", shuffle=False):
        raw = feats.astype(np.float32)
        got, _ = sess.run(None, {"x": raw[None], "x_lens": np.array([len(raw)], np.int64)})
        want = hpcsgd_outputs(model, params, np.ascontiguousarray(normalize(raw), np.float32))
        frames += len(want[0])
        beyond = beyond_bound(got[0], *want)
        flips += int(beyond.sum())
        flipped += bool(beyond.any())
        largest = max(largest, float(np.abs(got[0] - want[0]).max()))
        hyp = list(ctc.greedy_search(want[0]))
        tokens += len(hyp)
        differ += hyp != list(ctc.greedy_search(got[0]))
    print(f"{case}: {flips} of {frames} frames ({flipped} of 40 utterances) beyond the bound, "
          f"largest |d log p| {largest:.3g}; {differ} of 40 greedy hypotheses differ "
          f"({tokens} tokens)")
    assert tokens > 20   # not an all-blank model
    assert differ <= 1


def test_sherpa_onnx_decodes_the_int8_export_as_hpcsgd_does(trained, demo_tokens):
    """sherpa-onnx, loaded by the printed code, recognizes each held-out FLAC file of the
    INT8 (and INT4) exports as hpcsgd's greedy search on the archive's features with the same
    global normalisation, one stream at a time and in one padded batch."""
    pytest.importorskip("sherpa_onnx")
    from test_export_onnx import assert_sherpa_onnx_agrees, global_normalize, hpcsgd_greedy
    case, run, out, stdout = trained
    want = hpcsgd_greedy(run, f"{demo_tokens}/cv", global_normalize(f"{demo_tokens}/train"))
    assert_sherpa_onnx_agrees(stdout[stdout.index("import sherpa_onnx"):], want, batch=True)


@pytest.mark.parametrize("bits", [8, 4])
def test_sherpa_onnx_runs_an_untrained_conv_integer_graph(bits, demo_tokens, tmp_path):
    """An untrained (so never all-blank) QAT conv/dense CTC model over the demo's 40-dim
    fbank: sherpa-onnx's own runtime runs its INT8 (INT4) graph to hpcsgd's greedy
    hypotheses on the 40 held-out files, one at a time and in one padded batch."""
    pytest.importorskip("sherpa_onnx")
    from hpcsgd.data import archive
    from test_export_onnx import assert_sherpa_onnx_agrees, fake_run, global_normalize
    from test_export_onnx import hpcsgd_greedy
    train = f"{demo_tokens}/train"
    symbols = archive.read_tokens(train, "phones")
    run = fake_run(tmp_path / "run", {
        "type": "ctc", "input_dim": 40, "num_tokens": len(symbols), "activation": "relu",
        "encoder": ["stack 3", "conv 32 k3", "conv 32 k3 d2", "dense 32"],
        "qat": qat(bits, "channel" if bits == 4 else "tensor")}, symbols)
    done = write_onnx(run, str(tmp_path / "onnx"), stats=train)
    # the graph's own counts (4 weights, 5 quantized inputs), in the file's metadata too
    assert done["quantization"].startswith(f"INT{bits} weights (4 int{bits} tensors)")
    assert "; 5 GEMM inputs" in done["quantization"]
    props = {p.key: p.value for p in onnx.load(done["model"]).metadata_props}
    assert props["quantization"] == done["quantization"]
    assert_sherpa_onnx_agrees(done["code"],
                              hpcsgd_greedy(run, f"{demo_tokens}/cv", global_normalize(train)),
                              batch=True)


def test_onnx_int8_is_for_quantization_aware_models(tmp_path):
    """--onnx-int8 on a float model, and without --onnx, are named."""
    import subprocess
    import sys
    from conftest import REPO
    from test_export_onnx import CTC, fake_run
    run = fake_run(tmp_path / "run", {**CTC, "encoder": ["conv 8 k3"]})
    with pytest.raises(UserError, match="--onnx-int8: a float model"):
        write_onnx(run, str(tmp_path / "onnx"), int8=True)
    cli = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "export", run, "--int8", "--out",
                          str(tmp_path / "m.h5"), "--onnx-int8"], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert cli.returncode != 0 and "--onnx-int8: for --onnx only" in cli.stderr
