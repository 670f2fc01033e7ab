"""`hpcsgd export --onnx`: the graph's log-posteriors against hpcsgd's forward pass (float32
and float64) on padded batches; a tiny CTC model trained on the bundled demo corpus, exported,
and decoded by sherpa-onnx from the FLAC files as hpcsgd decodes the archive's features; and
the models it refuses, named."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_float32_close, run_train
from hpcsgd import checkpoint, export_onnx
from hpcsgd.export import write_onnx
from hpcsgd.errors import UserError
from hpcsgd.model import build

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

ENCODERS = [["stack 3", "conv 8 k3 s2", "blstm 5", "lstm 4"],
            ["conv 6 k4 s3 ln", "conv 5 k5 d2 in", "dense 9", "blstm 3"],
            ["conv2d 3 16", "conformer 16 h4 f32 k5 in", "conformer 16 h2 f24 k3"]]


def hpcsgd_outputs(describe, params32, x, lengths, dtype):
    """Each utterance's (T', V) log-posteriors from hpcsgd's forward in `dtype`, the batch
    time-major with zero padding as the loader makes it."""
    model = build(describe, max_batch=256, dtype=dtype)
    params = model.new_params()
    params.flat[...] = params32.flat
    T, nb = max(lengths), len(lengths)
    rows = np.zeros((T, nb, x.shape[2]), dtype)
    for b, n in enumerate(lengths):
        rows[:n, b] = x[b, :n]
    out = np.array(model.forward(params, rows.reshape(T * nb, -1), T * nb, lengths=lengths))
    out_lengths = model.out_lengths(T * nb, lengths)
    return [out[np.arange(n) * nb + b] for b, n in enumerate(out_lengths.lengths)]


@pytest.mark.parametrize("encoder", ENCODERS, ids=["stack-conv-blstm-lstm", "ln-in-dense",
                                                    "conformer"])
def test_onnx_log_probs_equal_the_forward_pass(encoder):
    """Two utterances of 61 and 14 frames in one padded batch (the padding filled with
    sherpa-onnx's log(1e-10), which the graph must ignore), normalised by the graph with a
    mean and scale: onnxruntime's log-posteriors are as far from hpcsgd's float64 forward as
    hpcsgd's float32 forward is (conftest.assert_float32_close), utterance by utterance."""
    describe = {"type": "ctc", "input_dim": 40, "encoder": encoder, "num_tokens": 7,
                "activation": "relu"}
    model = build(describe, max_batch=256)
    params = model.new_params()
    model.init(params, np.random.default_rng(1))
    mean, inv_std, lengths, raw = padded_batch()
    proto = export_onnx.graph(model, params, mean, inv_std)
    session = ort.InferenceSession(proto.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    log_probs, out_lengths = session.run(None, {"x": raw, "x_lens": np.array(lengths)})
    ref32 = hpcsgd_outputs(describe, params, (raw - mean) * inv_std, lengths, np.float32)
    x64 = (raw.astype(np.float64) - mean.astype(np.float64)) * inv_std.astype(np.float64)
    ref64 = hpcsgd_outputs(describe, params, x64, lengths, np.float64)
    assert out_lengths.tolist() == [len(r) for r in ref32]
    for b in range(2):
        assert_float32_close(log_probs[b, :out_lengths[b]], ref32[b], ref64[b])
    # one utterance alone gives what it gives in the batch
    alone, _ = session.run(None, {"x": raw[1:, :14], "x_lens": np.array([14])})
    np.testing.assert_allclose(alone[0], log_probs[1, :out_lengths[1]], atol=1e-5)


@pytest.mark.parametrize("kind", ["mean", "meanvar"])
def test_per_utterance_cmvn_in_the_graph(kind):
    """--cmvn utterance: the graph normalises each utterance of a padded batch by its own
    statistics over its valid frames, as hpcsgd's CMVN would with that utterance as the
    speaker (data/splice.py: cmvn_from_stats), the forward after it as above."""
    from hpcsgd.data.splice import cmvn_from_stats
    describe = {"type": "ctc", "input_dim": 40, "encoder": ENCODERS[0], "num_tokens": 7,
                "activation": "relu"}
    model = build(describe, max_batch=256)
    params = model.new_params()
    model.init(params, np.random.default_rng(1))
    rng = np.random.default_rng(2)
    lengths = [23, 14]
    raw = np.full((2, 23, 40), -23.025850929940457, np.float32)
    normed32, normed64 = np.zeros((2, 23, 40), np.float32), np.zeros((2, 23, 40))
    for b, n in enumerate(lengths):
        raw[b, :n] = rng.normal(rng.normal(5, 2, 40), rng.uniform(0.5, 3, 40), (n, 40))
        x = raw[b, :n].astype(np.float64)
        stats = np.stack([np.append(x.sum(0), n), np.append((x * x).sum(0), 0)])[None]
        shift, scale = cmvn_from_stats(stats, kind == "meanvar")
        normed32[b, :n] = (raw[b, :n] + shift[0]) * scale[0]
        std = np.sqrt(x.var(0)) if kind == "meanvar" else 1.0
        normed64[b, :n] = (x - x.mean(0)) / std
    proto = export_onnx.graph(model, params, utterance=kind)
    session = ort.InferenceSession(proto.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
    log_probs, out_lengths = session.run(None, {"x": raw, "x_lens": np.array(lengths)})
    ref32 = hpcsgd_outputs(describe, params, normed32, lengths, np.float32)
    ref64 = hpcsgd_outputs(describe, params, normed64, lengths, np.float64)
    for b in range(2):
        assert_float32_close(log_probs[b, :out_lengths[b]], ref32[b], ref64[b])


def test_tokens_for_sherpa_onnx():
    """<blk> at 0; a phone gets sherpa-onnx's word-start mark (its text: phones separated by
    spaces), the chars' <space> becomes the mark itself, BPE pieces stay as they are."""
    assert export_onnx.sherpa_tokens(["<blk>", "AA", "B"], "phones") == \
        "<blk> 0\n\u2581AA 1\n\u2581B 2\n"
    assert export_onnx.sherpa_tokens(["<blk>", "<space>", "a"], "chars") == \
        "<blk> 0\n\u2581 1\na 2\n"
    assert export_onnx.sherpa_tokens(["<blk>", "\u2581the", "s"], "bpe") == \
        "<blk> 0\n\u2581the 1\ns 2\n"


@pytest.fixture(scope="module")
def exported(demo_tokens, tmp_path_factory):
    """A tiny phone CTC model (stack 3, conv 32 k3, blstm 48, a frame CE head to leave CTC's
    all-blank plateau sooner) trained 20 epochs on the demo corpus' 32 training speakers (about
    30 s), exported with `hpcsgd export --onnx`: (run, out_dir, the command's stdout)."""
    pytest.importorskip("sherpa_onnx")
    return trained_and_exported(tmp_path_factory.mktemp("onnx_export"), demo_tokens, [
        "model.type=ctc", "model.encoder=[stack 3, conv 32 k3, blstm 48]", "model.frame_ce=0.5",
        "train.epochs=20", "optim.lr=5e-6"], timeout=300)


def padded_batch():
    """Two utterances of 61 and 14 frames of 40 features, padded as sherpa-onnx pads a batch
    (log(1e-10)), and the mean and inverse standard deviation the graph normalises with ->
    (mean, inv_std, lengths, raw (2, 61, 40))."""
    rng = np.random.default_rng(0)
    mean = rng.normal(5, 2, 40).astype(np.float32)
    inv_std = rng.uniform(0.3, 2, 40).astype(np.float32)
    lengths = [61, 14]
    raw = np.full((2, 61, 40), -23.025850929940457, np.float32)
    for b, n in enumerate(lengths):
        raw[b, :n] = rng.normal(mean, 1 / inv_std, (n, 40))
    return mean, inv_std, lengths, raw


def trained_and_exported(base, demo_tokens, options, timeout):
    """A tiny model trained on the demo corpus with `options`, exported by the command ->
    (run, out_dir, the command's stdout)."""
    run, out = str(base / "run"), str(base / "onnx")
    proc = run_train(1, [f"data.train={demo_tokens}/train", f"data.cv={demo_tokens}/cv",
                         f"train.run_dir={run}", "data.tokens=phones", "train.minibatch=2000",
                         "optim.type=adam", "optim.momentum_tc=0", "schedule.type=constant",
                         *options], timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cli = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "export", run, "--onnx", out],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    return run, out, cli.stdout


def hpcsgd_greedy(run, cv, normalize):
    """{utt: phones} of hpcsgd's greedy search on the archive's raw features normalised by
    normalize(feats) (float64 -> float32), archive order."""
    from hpcsgd.data.loader import iter_utterances
    from hpcsgd.decode import ctc
    from hpcsgd.model_io import load_model
    model, params, meta = load_model(run)
    symbols = np.array(meta["tokens"]["symbols"])
    hyps = {}
    for utt, feats, _ in iter_utterances(cv, cmvn="none", shuffle=False):
        x = np.ascontiguousarray(normalize(feats.astype(np.float64)), np.float32)
        hyps[utt] = list(symbols[ctc.greedy_search(model.forward(params, x, len(x),
                                                                 lengths=[len(x)]))])
    return hyps


def global_normalize(train):
    mean, inv_std, _, _ = export_onnx.global_cmvn(train, "meanvar")
    return lambda x: (x.astype(np.float32) - mean) * inv_std


def utterance_normalize(x):
    from hpcsgd.data.splice import cmvn_from_stats
    stats = np.stack([np.append(x.sum(0), len(x)), np.append((x * x).sum(0), 0)])[None]
    shift, scale = cmvn_from_stats(stats, True)
    return (x.astype(np.float32) + shift[0]) * scale[0]


def sherpa_onnx_hyps(code, utts, method=None, batch=False):
    """{utt: symbols} of the recognizer `code` builds (what `hpcsgd export` prints, as a user
    would paste it; a transducer's decoding method set to `method`) from each demo FLAC file,
    one stream at a time; with batch, also all in one padded batch, which must agree."""
    import soundfile as sf
    names = {}
    exec(code if method is None else code.replace("'greedy_search'", repr(method)), names)
    recognizer = names["recognizer"]
    demo = os.path.join(REPO, "data_prep", "demo", "so762")
    audio = dict(line.split() for line in open(os.path.join(demo, "wav.scp")))
    hyps, streams = {}, []
    for utt in utts:
        samples, rate = sf.read(os.path.join(demo, audio[utt]), dtype="float32")
        one, batched = recognizer.create_stream(), recognizer.create_stream()
        for s in (one, batched):
            s.accept_waveform(rate, samples)
        recognizer.decode_stream(one)
        hyps[utt] = one.result.text.split()
        streams.append(batched)
    if batch:
        recognizer.decode_streams(streams)
        assert [s.result.text.split() for s in streams] == list(hyps.values())
    return hyps


def assert_sherpa_onnx_agrees(code, want, batch=False):
    """The recognizer `code` builds recognizes each demo FLAC file of `want`'s utterances as
    `want` says, one stream at a time (and with batch, all in one padded batch too)."""
    got = sherpa_onnx_hyps(code, list(want), batch=batch)
    for utt in want:
        assert got[utt] == want[utt], utt
    assert sum(map(len, want.values())) > 20   # not an all-blank model


def test_sherpa_onnx_decodes_the_audio_as_hpcsgd_does(exported, demo_tokens):
    """sherpa-onnx, loaded by the code `hpcsgd export` prints, recognizes each held-out FLAC
    file (its own fbank from the audio, the global CMVN inside the graph) as hpcsgd's greedy
    search does on the archive's features normalised with the same global statistics, one
    stream at a time and in one padded batch of 40. Against `hpcsgd decode --greedy`
    (per-speaker CMVN, what the model was trained with) the hypotheses differ: the count is
    printed."""
    from hpcsgd.decode import ctc
    from hpcsgd.model_io import load_model
    from hpcsgd.outputs import ctc_outputs
    run, out, stdout = exported
    cv = f"{demo_tokens}/cv"
    want = hpcsgd_greedy(run, cv, global_normalize(f"{demo_tokens}/train"))
    assert_sherpa_onnx_agrees(stdout[stdout.index("import sherpa_onnx"):], want, batch=True)
    model, params, meta = load_model(run)
    symbols = np.array(meta["tokens"]["symbols"])
    per_speaker = {utt: list(symbols[ctc.greedy_search(lp)])
                   for utt, lp in ctc_outputs(model, params, cv, meta["data"])}
    differ = sum(want[u] != per_speaker[u] for u in want)
    print(f"global vs per-speaker CMVN: {differ} of {len(want)} greedy hypotheses differ")


def test_sherpa_onnx_with_per_utterance_cmvn(exported, demo_tokens, tmp_path):
    """--cmvn utterance: sherpa-onnx recognizes each held-out file as hpcsgd's greedy search
    does on the archive's features normalised by the utterance's own statistics."""
    run, _, _ = exported
    done = write_onnx(run, str(tmp_path / "onnx"), cmvn="utterance")
    assert done["cmvn"].startswith("each utterance's own meanvar statistics")
    assert_sherpa_onnx_agrees(done["code"],
                              hpcsgd_greedy(run, f"{demo_tokens}/cv", utterance_normalize))


@pytest.mark.parametrize("scope", ["global", "utterance"])
def test_a_model_trained_as_it_deploys_decodes_alike(scope, demo_tokens, tmp_path):
    """A model trained with data.cmvn_scope global (the training archive's statistics, kept
    in the checkpoint) or utterance, exported with no --cmvn (the export normalises as the
    model trained): sherpa-onnx recognizes every held-out FLAC file exactly as `hpcsgd decode
    --greedy` does on the archive (ctc_outputs with the checkpoint's data meta), with no
    normalisation of its own in between."""
    pytest.importorskip("sherpa_onnx")
    from hpcsgd.data import cmvn as norm
    from hpcsgd.decode import ctc
    from hpcsgd.model_io import load_model
    from hpcsgd.outputs import ctc_outputs
    run, out, stdout = trained_and_exported(tmp_path, demo_tokens, [
        "model.type=ctc", "model.encoder=[stack 3, conv 32 k3, blstm 48]", "model.frame_ce=0.5",
        "train.epochs=12", "optim.lr=5e-6", f"data.cmvn_scope={scope}"], timeout=300)
    model, params, meta = load_model(run)
    if scope == "global":
        np.testing.assert_array_equal(meta["data"]["cmvn_stats"],
                                      norm.summed_stats(f"{demo_tokens}/train")[0])
        assert "the checkpoint's (data.cmvn_scope global" in stdout
    else:
        assert "each utterance's own meanvar statistics" in stdout
    symbols = np.array(meta["tokens"]["symbols"])
    want = {utt: list(symbols[ctc.greedy_search(lp)])
            for utt, lp in ctc_outputs(model, params, f"{demo_tokens}/cv", meta["data"])}
    assert_sherpa_onnx_agrees(stdout[stdout.index("import sherpa_onnx"):], want)


def test_sherpa_onnx_runs_a_conformer_graph(demo_tokens, tmp_path):
    """An (untrained, so never all-blank) Conformer CTC model over the demo's 40-dim fbank and
    phones: sherpa-onnx's runtime runs its graph (the front end, rotary attention, the
    depthwise convolution with an instance norm) to hpcsgd's hypotheses."""
    pytest.importorskip("sherpa_onnx")
    from hpcsgd.data import archive
    train = f"{demo_tokens}/train"
    symbols = archive.read_tokens(train, "phones")
    run = fake_run(tmp_path / "run", {
        "type": "ctc", "input_dim": 40, "num_tokens": len(symbols), "activation": "relu",
        "encoder": ["conv2d 4 32", "conformer 32 h4 f64 k7", "conformer 32 h4 f64 k7 in"]},
        symbols)
    done = write_onnx(run, str(tmp_path / "onnx"), stats=train)
    assert_sherpa_onnx_agrees(done["code"],
                              hpcsgd_greedy(run, f"{demo_tokens}/cv", global_normalize(train)),
                              batch=True)


def marker_model(g, ok, opset=export_onnx.OPSET, ir_version=export_onnx.IR_VERSION):
    """A CTC graph for sherpa-onnx's zipformer CTC loader around the checks built in Graph g:
    whatever the audio, every frame's best token is 1 ("yes") when every element of the
    bool tensor `ok` is true, else 2 ("no")."""
    from onnx import TensorProto, helper
    okf = g.op("ReduceMin", [g.op("Cast", [ok], to=1)], keepdims=0)
    row = g.op("Add", [g.op("Mul", [okf, g.const(np.array([0, 20, -20], np.float32))]),
                       g.const(np.array([0, -10, 10], np.float32))])
    shape = g.op("Concat", [g.op("Shape", ["x"], start=0, end=2),
                            g.const(np.array([3], np.int64))], axis=0)
    g.nodes.append(helper.make_node("LogSoftmax", [g.op("Expand", [row, shape])],
                                    ["log_probs"], axis=-1))
    g.nodes.append(helper.make_node("Identity", ["x_lens"], ["log_probs_len"]))
    graph = helper.make_graph(
        g.nodes, "marker", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 40]),
                            helper.make_tensor_value_info("x_lens", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT, ["N", "T", 3]),
         helper.make_tensor_value_info("log_probs_len", TensorProto.INT64, ["N"])], g.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = ir_version
    helper.set_model_props(proto, {"model_type": "zipformer2_ctc", "vocab_size": "3",
                                   "blank_id": "0", "subsampling_factor": "1"})
    return proto


def ort_marker(proto):
    """What a marker_model says in onnxruntime: True for "yes"."""
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    lp, _ = sess.run(None, {"x": np.zeros((1, 5, 40), np.float32),
                            "x_lens": np.array([5], np.int64)})
    return int(lp[0, 0].argmax()) == 1


def sherpa_marker(proto, out):
    """What a marker_model says in sherpa-onnx's runtime (its bundled onnxruntime), from half a
    second of noise: True for "yes"."""
    import onnx
    import sherpa_onnx
    from sherpa_onnx.lib._sherpa_onnx import OfflineRecognizer
    os.makedirs(out, exist_ok=True)
    onnx.save(proto, os.path.join(out, "model.onnx"))
    with open(os.path.join(out, "tokens.txt"), "w") as f:
        f.write("<blk> 0\nyes 1\nno 2\n")
    config = sherpa_onnx.OfflineRecognizerConfig(
        feat_config=sherpa_onnx.FeatureExtractorConfig(sampling_rate=16000, feature_dim=40),
        model_config=sherpa_onnx.OfflineModelConfig(
            zipformer_ctc=sherpa_onnx.OfflineZipformerCtcModelConfig(
                model=os.path.join(out, "model.onnx")),
            tokens=os.path.join(out, "tokens.txt"), num_threads=1),
        decoding_method="greedy_search")
    recognizer = OfflineRecognizer(config)
    stream = recognizer.create_stream()
    stream.accept_waveform(16000, np.random.default_rng(0).uniform(-0.1, 0.1, 8000)
                           .astype(np.float32))
    recognizer.decode_stream(stream)
    assert stream.result.text.split() in (["yes"], ["no"])
    return stream.result.text.split() == ["yes"]


def rope_graph(steps, dk, expect):
    """A marker_model: the graph's rotary tables (export_onnx.rope) for `steps` steps equal
    `expect` (cos, sin) element for element."""
    g = export_onnx.Graph()
    cos, sin = export_onnx.rope(g, g.const(np.int64(steps)), dk)
    ok = g.op("And", [g.op("Equal", [cos, g.const(expect[0])]),
                      g.op("Equal", [sin, g.const(expect[1])])])
    return marker_model(g, ok)


@pytest.mark.parametrize("dk", [4, 8, 36, 64])
def test_the_graph_computes_hpcsgd_rotary_tables(dk):
    """The rotary tables the graph computes from T (float64 angles, Sin and 1 - 2 sin^2(a/2),
    rounded once to float32) equal kernels_conformer.rope_tables element for element for
    T = 8192 (so every shorter length: a prefix), and for T = 30000 (no cap), in
    onnxruntime."""
    from hpcsgd.model.kernels_conformer import rope_tables
    for steps in (8192, 30000):
        g = export_onnx.Graph()
        cos, sin = export_onnx.rope(g, g.const(np.int64(steps)), dk)
        proto = helper_model(g, [cos, sin])
        sess = ort.InferenceSession(proto.SerializeToString(),
                                    providers=["CPUExecutionProvider"])
        got = sess.run(None, {})
        for a, b in zip(got, rope_tables(steps, dk, np.float32)):
            assert a.dtype == np.float32 and a.shape == b.shape == (steps, dk // 2)
            assert np.array_equal(a, b), (steps, int((a != b).sum()))


def helper_model(g, outputs):
    """Graph g as a model of no inputs and the float32 `outputs`."""
    from onnx import TensorProto, helper
    graph = helper.make_graph(g.nodes, "g", [], [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], g.inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", export_onnx.OPSET)])
    proto.ir_version = export_onnx.IR_VERSION
    return proto


def test_sherpa_onnx_runtime_computes_the_rotary_tables():
    """sherpa-onnx's bundled onnxruntime (it has float64 Sin, not Cos) computes the same
    tables: equal to rope_tables (dk 36, so762's Conformer's, T = 8192); a table one ulp off
    in one element is told apart."""
    pytest.importorskip("sherpa_onnx")
    import tempfile
    from hpcsgd.model.kernels_conformer import rope_tables
    cos, sin = rope_tables(8192, 36, np.float32)
    off = sin.copy()
    off[5000, 3] = np.nextafter(off[5000, 3], np.float32(np.inf))
    with tempfile.TemporaryDirectory() as tmp:
        assert ort_marker(rope_graph(8192, 36, (cos, sin)))
        assert sherpa_marker(rope_graph(8192, 36, (cos, sin)), os.path.join(tmp, "equal"))
        assert not sherpa_marker(rope_graph(8192, 36, (cos, off)), os.path.join(tmp, "off"))


def test_the_export_writes_what_sherpa_onnx_reads(exported):
    """tokens.txt is the model's inventory with <blk> at 0; the graph's inputs, outputs and
    metadata are the zipformer CTC loader's, and the feature options are recorded."""
    import onnx
    run, out, stdout = exported
    lines = open(os.path.join(out, "tokens.txt")).read().splitlines()
    meta = checkpoint.read_meta(checkpoint.latest(run))
    assert lines[0] == "<blk> 0" and len(lines) == len(meta["tokens"]["symbols"])
    proto = onnx.load(os.path.join(out, "model.onnx"))
    assert [i.name for i in proto.graph.input] == ["x", "x_lens"]
    assert [o.name for o in proto.graph.output] == ["log_probs", "log_probs_len"]
    props = {p.key: p.value for p in proto.metadata_props}
    assert props["model_type"] == "zipformer2_ctc" and props["subsampling_factor"] == "3"
    assert props["vocab_size"] == str(len(lines))
    feat = json.loads(props["sherpa_feat_config"])
    assert feat["snip_edges"] is True and feat["dither"] == 0 and not feat["normalize_samples"]
    assert json.loads(props["extractor_config"])["window_type"] == "povey"
    assert "snip_edges=True" in stdout and "OfflineZipformerCtcModelConfig" in stdout


def fake_run(path, describe, symbols=None, views=None):
    """A run directory with one checkpoint of a freshly initialised `describe` model, its
    tokens `symbols` (default 5 made-up phones); views(params' views) may change them."""
    model = build(describe, max_batch=64)
    params = model.new_params()
    model.init(params, np.random.default_rng(0))
    if views:
        views(params.views)
    symbols = symbols or ["<blk>"] + [f"p{i}" for i in range(1, 5)]
    meta = {"model": describe, "data": {"context": 0, "cmvn": "meanvar", "feature_dim": 4},
            "config": {"data.train": "nowhere"}, "label_inventory_hash": "-",
            "tokens": {"kind": "phones", "symbols": symbols, "inventory_hash": "-"}}
    checkpoint.save(str(path), 1, {"params": params.flat}, meta)
    return str(path)


CTC = {"type": "ctc", "input_dim": 4, "num_tokens": 5, "activation": "relu"}


@pytest.mark.parametrize("describe, words", [
    ({"type": "dnn", "input_dim": 4, "hidden": [6], "num_labels": 5, "activation": "relu"},
     "hybrid dnn model"),
    ({**CTC, "encoder": ["blstm 3"], "qat": {"weights": "max", "weight_bits": 8,
                                              "activations": "pact"}},
     "encoder layer 'blstm 3' with quantized activations"),
], ids=["hybrid", "qat"])   # quantization-aware RNN-Ts: test_export_onnx_rnnt.py
def test_models_it_cannot_export_are_named(describe, words, tmp_path):
    run = fake_run(tmp_path / "run", describe)
    with pytest.raises(UserError, match=words):
        write_onnx(run, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_a_layer_without_an_onnx_form_is_named():
    """A layer the graph builder does not know (every encoder kind has one today: a stand-in
    plays the next one) is refused by its spec."""
    from types import SimpleNamespace
    model = build({**CTC, "encoder": ["blstm 3"]})
    stand_in = SimpleNamespace(describe={**model.describe, "encoder": ["mystery 3"]},
                               layers=[object()] + model.layers[1:])
    assert "not yet exported: encoder layer 'mystery 3'" in \
        export_onnx.unsupported(stand_in, "RUN")


def test_a_missing_training_archive_asks_for_stats(tmp_path):
    run = fake_run(tmp_path / "run", {**CTC, "encoder": ["blstm 3"]})
    with pytest.raises(UserError, match="its training archive nowhere .* with --stats"):
        write_onnx(run, str(tmp_path / "out"))


def test_bad_command_lines_are_named(tmp_path):
    cli = [sys.executable, "-m", "hpcsgd.cli", "export"]
    missing = str(tmp_path / "no_run")
    for args, words in (([missing, "--onnx", str(tmp_path / "o")],
                         f"{missing}: no such run directory"),
                        ([missing, "--onnx", "o", "--out", "m.h5"], "--out is for --int8"),
                        ([missing, "--int8"], "--out MODEL.h5")):
        proc = subprocess.run(cli + args, capture_output=True, text=True, timeout=120,
                              cwd=REPO)
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
