"""CTC models in the trainer, under a real mpiexec: K ranks against one process on the same
global batches of whole utterances, 1-bit SGD against the two-residual loop, mixed precision
and bf16 against their single-process references, double buffering against its delayed-
update reference, a bit-exact resume mid-epoch, a move from 2 to 3 ranks mid-epoch, the probe,
the adaptive bit width, the cold start and QAT running on CTC, eval/infer/decode of the
checkpoint, and what the config refuses for CTC models with its reason."""
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import (TrainerRuns, assert_float32_close, assert_moves_from_2_to_3_ranks,
                      latest_arrays, make_archive, run_train)
from hpcsgd import checkpoint, config
from hpcsgd.errors import UserError


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    """3 shards of 10 utterances of 20..160 frames, phone tokens (8 and the blank), a token
    per 4 frames at most: feasible after a 2x subsampling but for repeats."""
    out = str(tmp_path_factory.mktemp("ctc_archive"))
    make_archive(out, num_shards=3, utts_per_shard=10, dim=4, min_len=20, max_len=160,
                 token_kinds=("phones", "chars"), num_tokens=9)
    return out


def options(arch, *extra):
    """A tiny DS2-like CTC model (a stride-2 convolution, a BLSTM), batches of up to 900
    frames in buckets of 1800, 1 epoch, constant lr, momentum; every step checks replicas."""
    return [f"data.train={arch}", "model.type=ctc", "model.encoder=[conv 6 k3 s2, blstm 5]",
            "model.activation=relu", "train.minibatch=900", "data.bucket_frames=1800",
            "train.epochs=1", "train.log_every_frames=1000", "optim.lr=0.001",
            "optim.momentum_tc=100", "schedule.type=constant", "train.check_every_steps=1",
            *extra]


RUNS = TrainerRuns(options, timeout=180)
train, reference, arrays = RUNS.train, RUNS.reference, latest_arrays


@pytest.mark.parametrize("K", [1, 2, 3])
def test_allreduce_equals_one_process_on_the_same_global_batches(K, arch, tmp_path,
                                                                 tmp_path_factory):
    """Every rank's utterances of a step together are the global batch: one process on their
    union (tests/mpi/reference_setup.py: merged longest first) is the same sum of gradients;
    one rank bit for bit, K ranks within float32 rounding of the float64 trajectory."""
    got = arrays(train(K, arch, tmp_path_factory))["params"]
    want = reference(K, "float", arch, tmp_path)["params"]
    if K == 1:
        np.testing.assert_array_equal(got, want)
    else:
        assert_float32_close(got, want, reference(K, "float", arch, tmp_path,
                                                  float64=True)["params"])
    assert not np.array_equal(got, reference(K, "float", arch, tmp_path,
                                             "train.stop_after_frames=500")["params"])


LN_ENCODER = "model.encoder=[conv 6 k3 s2 ln, conv 5 k5 d2 ln]"
IN_ENCODER = "model.encoder=[conv 6 k3 s2 in, conv 5 k5 d2 in]"


@pytest.mark.parametrize("encoder", [LN_ENCODER, IN_ENCODER], ids=["ln", "in"])
def test_a_normalized_convolution_model_trains_as_one_process(encoder, arch, tmp_path,
                                                              tmp_path_factory):
    """The all-convolutional encoder with layer or instance norms (W2L-like): 2 ranks within
    float32 rounding of one process on the same global batches (the norm's gain and shift
    exchanged with the rest; instance norm's statistics each utterance's, wherever it is
    dealt), and mixed precision on one rank bit for bit its reference (the same float16
    stores around the norm's kernels)."""
    got = arrays(train(2, arch, tmp_path_factory, encoder))["params"]
    assert_float32_close(got, reference(2, "float", arch, tmp_path, encoder)["params"],
                         reference(2, "float", arch, tmp_path, encoder,
                                   float64=True)["params"])
    mixed = (encoder, "train.precision=mixed", "train.loss_scale=static",
             "train.loss_scale_init=256")
    np.testing.assert_array_equal(arrays(train(1, arch, tmp_path_factory, *mixed))["params"],
                                  reference(1, "float", arch, tmp_path, *mixed)["params"])


@pytest.mark.parametrize("K", [2, 3])
def test_the_overlapped_allreduce_trains_what_one_buffer_does(K, arch, tmp_path,
                                                              tmp_path_factory):
    """exchange.overlap with a bucket per layer (the output's, the BLSTM's, the convolution's,
    each posted as the backward pass finishes it, a rank without utterances posting all three
    after) against one Allreduce of the whole buffer: 2 ranks bit for bit (one sum, a + b,
    whatever MPI's algorithm), 3 within float32 rounding of the float64 trajectory; the
    replicas checked every step."""
    serial = arrays(train(K, arch, tmp_path_factory, "exchange.overlap=false"))["params"]
    run = train(K, arch, tmp_path_factory, "exchange.overlap=true", "exchange.bucket_mb=0")
    got = arrays(run)["params"]
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "overlapped allreduce: 3 bucket(s)" in log
    if K == 2:
        np.testing.assert_array_equal(got, serial)
    else:
        assert_float32_close(got, reference(K, "float", arch, tmp_path)["params"],
                             reference(K, "float", arch, tmp_path, float64=True)["params"])
    assert "overlapped" not in open(os.path.join(
        train(K, arch, tmp_path_factory, "exchange.overlap=false"), "logs", "rank0000.log")).read()


def test_striped_onebit_on_one_rank_equals_the_two_residual_loop(arch, tmp_path,
                                                                 tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit")
    got = arrays(train(1, arch, tmp_path_factory, *extra))
    want = reference(1, "onebit", arch, tmp_path, *extra)
    np.testing.assert_array_equal(got["params"], want["params"])
    np.testing.assert_array_equal(got["rank0000/exchange/residual1"], want["residual1"])
    assert np.abs(want["residual2"]).sum() > 0


@pytest.mark.parametrize("precision", [
    ("train.precision=mixed", "train.loss_scale=static", "train.loss_scale_init=256"),
    ("train.precision=bf16",)])
def test_reduced_precision_equals_its_one_process_reference(precision, arch, tmp_path,
                                                            tmp_path_factory):
    """float16 (a static loss scale) and bfloat16 stores of a CTC model: one rank is the
    single-process reference bit for bit (the same rounding at the same places: the 16-bit
    logits into the CTC kernel, its gradient rounded once after the scale); not float32."""
    got = arrays(train(1, arch, tmp_path_factory, *precision))["params"]
    np.testing.assert_array_equal(got, reference(1, "float", arch, tmp_path, *precision)["params"])
    assert not np.array_equal(got, arrays(train(1, arch, tmp_path_factory))["params"])


def test_double_buffering_equals_the_delayed_update_reference(arch, tmp_path,
                                                              tmp_path_factory):
    """Halves of each rank's utterances (even and odd places), each exchanged while the next
    computes on weights N/2 stale: the delayed-update loop of one process on the same halves."""
    from conftest import run_reference
    got = arrays(train(2, arch, tmp_path_factory, "exchange.double_buffering=true"))["params"]
    out = str(tmp_path / "db.npz")
    script = os.path.join(os.path.dirname(__file__), "mpi", "double_buffering_reference.py")
    for dtype in ("32", "64"):
        run_reference(script, [out.replace(".npz", dtype + ".npz"), "2"]
                      + ["--float64"] * (dtype == "64") + options(arch))
    assert_float32_close(got, np.load(out.replace(".npz", "32.npz"))["params"],
                         np.load(out.replace(".npz", "64.npz"))["params"])


@pytest.mark.parametrize("double_buffering,dropout,frame_ce", [
    (False, 0.0, 0.0), (True, 0.0, 0.0), (False, 0.3, 0.0), (True, 0.3, 0.5)])
def test_striped_onebit_resumes_bit_exactly_mid_epoch(double_buffering, dropout, frame_ce, arch,
                                                      tmp_path, tmp_path_factory):
    """With SpecAugment, with dropout's masks (keyed by utterance and epoch), and with a
    frame CE head (its labels read with the features)."""
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "train.epochs=2",
             "data.specaugment=true", f"exchange.double_buffering={str(double_buffering).lower()}",
             f"model.dropout={dropout}", f"model.frame_ce={frame_ce}")
    full = arrays(train(2, arch, tmp_path_factory, *extra))
    cut = str(tmp_path / "cut")
    for stop in ("train.stop_after_frames=1500", "train.stop_after_frames=0"):
        proc = run_train(2, options(arch, f"train.run_dir={cut}", *extra, stop), timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if stop.endswith("=1500"):
            meta = checkpoint.read_meta(checkpoint.latest(cut))
            assert meta["epoch"] == 0 and 0 < sum(meta["offsets"])
    resumed = arrays(cut)
    assert set(full) == set(resumed)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)


def test_dropout_trains_as_one_process(arch, tmp_path, tmp_path_factory):
    """model.dropout: masks keyed by utterance, so 2 ranks train what one process does on the
    same global batches (within float32 rounding of the float64 trajectory); its resume:
    test_striped_onebit_resumes_bit_exactly_mid_epoch."""
    drop = ("model.dropout=0.3",)
    got = arrays(train(2, arch, tmp_path_factory, *drop))["params"]
    assert_float32_close(got, reference(2, "float", arch, tmp_path, *drop)["params"],
                         reference(2, "float", arch, tmp_path, *drop, float64=True)["params"])
    assert not np.allclose(got, arrays(train(2, arch, tmp_path_factory))["params"], rtol=1e-3)


def test_a_run_moves_mid_epoch_from_2_to_3_ranks(arch, tmp_path):
    """The rest of the epoch's batches dealt over three: the epoch trains every frame once
    (its frames add up to the archive's), residuals folded, replicas agree."""
    assert_moves_from_2_to_3_ranks(options, arch, tmp_path)


def test_a_resume_on_another_rank_count_trains_the_same_batches_not_the_same_bits(
        arch, tmp_path, tmp_path_factory):
    """What the docs promise of a resume at another rank count (docs/training.md): a CTC
    model's global batches do not depend on the ranks, so a float32 allreduce run stopped
    mid-epoch on 2 ranks and resumed on 1 trains the rest of the epoch's batches, every frame
    once, and ends within float32 rounding of the 2-rank run's float64 trajectory -- as close
    as the uninterrupted run is, not bit for bit (its partial sums add in another order; the
    same rank count is bit for bit: test_striped_onebit_resumes_bit_exactly_mid_epoch)."""
    cut = str(tmp_path / "cut")
    for K, stop in ((2, 1500), (1, 0)):
        proc = run_train(K, options(arch, f"train.run_dir={cut}",
                                    f"train.stop_after_frames={stop}"), timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if K == 2:
            meta = checkpoint.read_meta(checkpoint.latest(cut))
            assert meta["epoch"] == 0 and 0 < sum(meta["offsets"])
    assert "re-dealt from 2 to 1 ranks" in open(os.path.join(cut, "logs", "rank0000.log")).read()
    epochs = [json.loads(line) for line in open(os.path.join(cut, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    assert [e["frames"] for e in epochs] == [json.load(open(os.path.join(arch, "index.json")))
                                             ["total_frames"]]
    ref32 = reference(2, "float", arch, tmp_path)["params"]
    ref64 = reference(2, "float", arch, tmp_path, float64=True)["params"]
    resumed, full = arrays(cut)["params"], arrays(train(2, arch, tmp_path_factory))["params"]
    assert_float32_close(full, ref32, ref64)
    assert_float32_close(resumed, ref32, ref64)


@pytest.mark.parametrize("extra", [
    ("train.probe_every_frames=2000", "train.probe_frames=900", "train.probe_max_minibatch=1800"),
    ("exchange.aggregation=striped", "exchange.codec=kbit", "exchange.bits=mqgrad",
     "exchange.bits_every_steps=2"),
    ("exchange.aggregation=striped", "exchange.codec=onebit", "exchange.cold_start_frames=1000"),
    ("exchange.aggregation=striped", "exchange.codec=dettmers"),
    ("qat.weights=sawb", "qat.weight_bits=4", "qat.activations=bac", "qat.activation_bits=4"),
    ("train.precision=mixed", "train.loss_scale=backoff", "train.loss_scale_init=65536"),
    (LN_ENCODER, "exchange.aggregation=striped", "exchange.codec=onebit",
     "qat.weights=sawb", "qat.weight_bits=4", "qat.activations=bac", "qat.activation_bits=4"),
    (IN_ENCODER, "exchange.aggregation=striped", "exchange.codec=onebit",
     "exchange.double_buffering=true", "train.precision=bf16", "train.loss_scale=none"),
], ids=["probe", "mqgrad", "cold_start", "dettmers", "qat", "backoff", "ln_onebit_qat",
        "in_onebit_db_bf16"])
def test_trainer_features_run_on_ctc(extra, arch, tmp_path):
    """The automatic minibatch size (in frames of whole utterances), the adaptive bit width,
    the cold start, Dettmers' codec, quantization-aware training and a backoff loss scaler
    train a CTC model on 2 ranks to a finite loss, replicas identical every step."""
    run = str(tmp_path / "run")
    proc = run_train(2, options(arch, f"train.run_dir={run}", "train.epochs=2", *extra),
                     timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert len(epochs) == 2 and all(np.isfinite(e["train_ctc_per_token"]) for e in epochs)
    if "probe" in str(extra):
        probes = [r for r in records if r["kind"] == "probe"]
        assert probes and all(np.isfinite(v) for v in probes[0]["criteria"].values())


def test_eval_infer_and_greedy_decode_agree(arch, tmp_path, tmp_path_factory):
    """eval's greedy token error rate (the trainer's CV measure) is decode --greedy's phone
    error rate on the same archive; infer writes (T', V) log-posteriors per utterance at the
    model's 2x subsampled rate."""
    run = train(1, arch, tmp_path_factory)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    ev = subprocess.run(cli + ["eval", run, "--data", arch, "--json", str(tmp_path / "e.json")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ev.returncode == 0, ev.stderr
    result = json.load(open(tmp_path / "e.json"))
    assert result["tokens"] == json.load(open(os.path.join(arch, "index.json")))["tokens"][
        "phones"]["total_tokens"]
    dec = subprocess.run(cli + ["decode", run, "--data", arch, "--greedy", "--out",
                                str(tmp_path / "dec")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert dec.returncode == 0, dec.stderr
    decoded = json.load(open(tmp_path / "dec" / "result.json"))
    assert abs(decoded["error_rate"] - 100 * result["token_error_rate"]) < 1e-9
    out = str(tmp_path / "post")
    p = subprocess.run(cli + ["infer", run, "--data", arch, "--out", out, "--format", "hdf5",
                              "--output", "logpost"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    with h5py.File(out + ".h5") as f:
        offsets, values = f["utt_offsets"][()], f["values"][()]
    frames = np.concatenate([np.diff(o) for o in _utt_frames(arch)])
    assert np.array_equal(np.diff(offsets), -(-frames // 2)[np.argsort(-frames, kind="stable")])
    np.testing.assert_allclose(np.exp(values).sum(axis=1), 1, rtol=1e-5)
    bad = subprocess.run(cli + ["infer", run, "--data", arch, "--out", out, "--output",
                                "loglik"], capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "posteriors over tokens" in bad.stderr


def _utt_frames(arch):
    from hpcsgd.data import archive
    index = archive.read_index(arch)
    return [archive.read_shard_meta(os.path.join(index["dir"], s["file"]))["utt_offsets"]
            for s in index["shards"]]


def test_config_refuses_what_ctc_cannot_do(arch):
    base = [f"data.train={arch}", "model.type=ctc", "model.encoder=[conv 6 k3 s2]"]
    for extra, words in ((["model.parallel=2"], "model parallelism splits"),
                         (["train.device=cuda", "train.cuda_graphs=true"], "new shape"),
                         (["model.encoder=[]"], "needs its encoder"),
                         (["model.encoder=[conv 6 k3 x2]"], "encoder layer")):
        with pytest.raises(UserError, match=words):
            config.load(None, base + extra)
    with pytest.raises(UserError, match="stride 1"):
        config.load(None, [f"data.train={arch}", "model.type=tdnn",
                           "model.encoder=[conv 6 k3 s2]"])
    with pytest.raises(UserError, match="model.dropout: models of whole utterances only"):
        config.load(None, [f"data.train={arch}", "model.dropout=0.2"])
    with pytest.raises(UserError, match="model.frame_ce: a head of the CTC model"):
        config.load(None, [f"data.train={arch}", "model.frame_ce=0.3"])


def test_a_frame_ce_head_trains_beside_the_ctc_loss(arch, tmp_path):
    """model.frame_ce on 2 ranks with dropout and double buffering: replicas identical every
    step, the head's CE and frame accuracy in the log and metrics; the checkpoint carries
    the head (Wf, bf over the archive's 5 frame labels), eval and greedy decoding read the
    CTC softmax as without it. An archive without frame labels is refused, named."""
    run = str(tmp_path / "run")
    proc = run_train(2, options(arch, f"train.run_dir={run}", "train.epochs=2",
                                "model.frame_ce=0.5", "model.dropout=0.2",
                                "exchange.double_buffering=true"), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in records if r["kind"] == "train"]
    assert steps and all(r["frame_ce"] > 0 and 0 <= r["frame_accuracy"] <= 1 for r in steps)
    assert "frame ce" in open(os.path.join(run, "logs", "rank0000.log")).read()
    arrays, meta = checkpoint.load(checkpoint.latest(run))
    assert meta["model"]["frame_labels"] == 5
    from hpcsgd.model import build
    net = build(meta["model"], max_batch=64)
    head = net.layers[-1]
    assert [s.shape for s in head.specs()[2:]] == [(10, 5), (1, 5)]   # Wf, bf over blstm 5
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    ev = subprocess.run(cli + ["eval", run, "--data", arch, "--json", str(tmp_path / "e.json")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ev.returncode == 0, ev.stderr
    dec = subprocess.run(cli + ["decode", run, "--data", arch, "--greedy", "--out",
                                str(tmp_path / "dec")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert dec.returncode == 0, dec.stderr
    assert abs(json.load(open(tmp_path / "dec" / "result.json"))["error_rate"]
               - 100 * json.load(open(tmp_path / "e.json"))["token_error_rate"]) < 1e-9
    text_only = str(tmp_path / "text_only")
    make_archive(text_only, num_shards=1, utts_per_shard=4, dim=4, token_kinds=("phones",),
                 num_tokens=9, frame_labels=False)
    proc = run_train(1, options(text_only, f"train.run_dir={tmp_path / 'r'}",
                                "model.frame_ce=0.5"))
    assert proc.returncode == 2 and text_only in proc.stderr and "--alignments" in proc.stderr, \
        proc.stderr


def test_bad_inputs_are_named(arch, tmp_path):
    """A CV archive with another token inventory, an archive without the token kind asked
    for, a frame model on an archive without frame labels: a clear error, exit 2."""
    other = str(tmp_path / "other")
    make_archive(other, num_shards=1, utts_per_shard=4, dim=4, token_kinds=("phones",),
                 num_tokens=5, frame_labels=False)
    for extra, words in (([f"data.cv={other}"], "token inventory differs"),
                         (["data.tokens=bpe"], "no bpe tokens")):
        proc = run_train(1, options(arch, f"train.run_dir={tmp_path / 'r'}", *extra))
        assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    proc = run_train(1, [f"data.train={other}", f"train.run_dir={tmp_path / 'f'}"])
    assert proc.returncode == 2 and "without frame labels" in proc.stderr, proc.stderr


@pytest.fixture(scope="module")
def demo_text_only(tmp_path_factory):
    """The bundled so762 demo corpus prepped from its transcripts alone (no --alignments):
    phones from CMUdict, characters; no frame labels."""
    from conftest import REPO
    out = str(tmp_path_factory.mktemp("demo_text") / "archive")
    demo = os.path.join(REPO, "data_prep", "demo", "so762")
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "prep", demo, out, "--labels",
                           os.path.join(demo, "labels.txt"), "--cv-speakers", "8",
                           "--num-shards", "2", "--jobs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    index = json.load(open(os.path.join(out, "train", "index.json")))
    assert not index["frame_labels"] and set(index["tokens"]) == {"phones", "chars"}
    return out


def test_a_text_only_corpus_trains_a_ctc_model_with_onebit_on_two_ranks(demo_text_only,
                                                                        tmp_path):
    """Real speech, no alignment anywhere: 2 ranks, the striped 1-bit exchange with error
    feedback after a float32 cold start through CTC's plateau (12 epochs; 1-bit from the
    start stays in it far longer, experiments/ctc_so762.md), replicas checked every step. It learns
    in the 1-bit phase (its training loss falls by a tenth and more: 3.04 -> 2.54 on Zen 4),
    its held-out loss ends well below the first epoch's, and held-out phones are recognized."""
    run = str(tmp_path / "run")
    frames = json.load(open(os.path.join(demo_text_only, "train", "index.json")))["total_frames"]
    proc = run_train(2, [f"data.train={demo_text_only}/train", f"data.cv={demo_text_only}/cv",
                         f"train.run_dir={run}", "model.type=ctc",
                         "model.encoder=[stack 2, blstm 96, blstm 96]", "train.minibatch=1500",
                         "train.epochs=22", "optim.type=adam", "optim.lr=1.3e-6",
                         "optim.momentum_tc=0", "schedule.type=constant",
                         "exchange.aggregation=striped", "exchange.codec=onebit",
                         f"exchange.cold_start_frames={12 * frames}",
                         "train.check_every_steps=1", "train.log_every_frames=1000000"],
                     timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cold start over" in open(os.path.join(run, "logs", "rank0000.log")).read()
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    assert len(epochs) == 22
    cold_end, last = epochs[11], epochs[-1]
    assert last["train_ctc_per_token"] < 0.9 * cold_end["train_ctc_per_token"], \
        [e["train_ctc_per_token"] for e in epochs]
    assert last["cv_ctc_per_token"] < epochs[0]["cv_ctc_per_token"] - 0.3, \
        [e["cv_ctc_per_token"] for e in epochs]
    assert last["cv_token_error_rate"] < 0.97, [e["cv_token_error_rate"] for e in epochs]


def test_int4_qat_ctc_model_exports_and_evaluates_as_trained(arch, tmp_path, tmp_path_factory):
    """Quantization-aware training of a CTC model (SAWB weights, BAC inputs, 4 bits), its
    integer export, and eval of the export: the same loss and token errors as the
    fake-quantized checkpoint (the export's weights are the grid's values exactly)."""
    qat = ("qat.weights=sawb", "qat.weight_bits=4", "qat.activations=bac",
           "qat.activation_bits=4")
    run = train(1, arch, tmp_path_factory, *qat)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    out = str(tmp_path / "int4.h5")
    p = subprocess.run(cli + ["export", run, "--int4", "--out", out], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    results = []
    for model in (run, out):
        js = str(tmp_path / f"{len(results)}.json")
        p = subprocess.run(cli + ["eval", model, "--data", arch, "--json", js],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        results.append(json.load(open(js)))
    assert results[0]["ctc_per_token"] == pytest.approx(results[1]["ctc_per_token"], rel=1e-6)
    assert results[0]["token_error_rate"] == results[1]["token_error_rate"]


def test_init_from_part_encoder_takes_another_inventorys_encoder(arch, tmp_path,
                                                               tmp_path_factory):
    """train.init_from_part=encoder: a character CTC model starts from a phone CTC model's
    encoder, every encoder weight equal to the checkpoint's, its output layer from its own
    init (a zero rate keeps the weights as they started); without the option the other
    inventory is refused, naming it."""
    from hpcsgd.model_io import load_model
    phones = train(1, arch, tmp_path_factory)
    chars = str(tmp_path / "chars")
    start = options(arch, f"train.run_dir={chars}", "data.tokens=chars",
                    f"train.init_from={phones}", "optim.lr=0", "train.stop_after_frames=900")
    proc = run_train(1, start)
    assert proc.returncode == 2 and "its outputs are phones" in proc.stderr \
        and "train.init_from_part=encoder" in proc.stderr, proc.stderr
    proc = run_train(1, start + ["train.init_from_part=encoder"])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(its encoder's layers; CTCOutput's weights from their init)" in open(
        os.path.join(chars, "logs", "rank0000.log")).read()
    model, got, _ = load_model(chars)
    _, theirs, _ = load_model(phones)
    encoder = [s.name for layer in model.layers[:-1] for s in layer.specs()]
    output = [s.name for s in model.layers[-1].specs()]
    assert encoder and all(np.array_equal(got[n], theirs[n]) for n in encoder)
    assert not any(got[n].shape == theirs[n].shape and np.array_equal(got[n], theirs[n])
                   for n in output)


def test_average_is_the_mean_of_the_last_checkpoints(arch, tmp_path, tmp_path_factory):
    """`hpcsgd average RUN --last 3`: the mean of the 3 newest checkpoints' weights, taken in
    float64 and rounded once to float32; eval and decode take the file (decode writing beside
    it under its name), train.init_from starts from it and train.resume refuses it; asking for
    more checkpoints than the run kept, or a checkpoint of another model among them: named,
    exit 2."""
    run = train(1, arch, tmp_path_factory, "train.epochs=2", "train.checkpoint_every_frames=900",
                "train.keep_checkpoints=20")
    found = checkpoint.all_checkpoints(run)
    assert len(found) >= 4
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    out = str(tmp_path / "avg3.h5")
    p = subprocess.run(cli + ["average", run, "--last", "3", "--out", out], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    weights = [checkpoint.load(c, names=("params",))[0]["params"] for c in found[-3:]]
    want = np.mean(np.array(weights, np.float64), axis=0)
    with h5py.File(out) as f:
        got = f["params"][()]
        assert json.loads(f.attrs["meta"])["averaged"] == [os.path.abspath(c)
                                                           for c in found[-3:]]
    assert got.dtype == np.float32 and not np.array_equal(got, weights[-1])
    # one rounding to float32 of a float64 mean (itself within a few float64 ulps)
    half_ulp = 0.5 * np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert np.all(np.abs(got - want) <= half_ulp * (1 + 1e-9))
    p = subprocess.run(cli + ["eval", out, "--data", arch, "--json", str(tmp_path / "e.json")],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert np.isfinite(json.load(open(tmp_path / "e.json"))["ctc_per_token"])
    p = subprocess.run(cli + ["decode", out, "--data", arch, "--greedy"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert os.path.isfile(tmp_path / "decode" / f"avg3_greedy_{os.path.basename(arch)}"
                          / "result.json")
    proc = run_train(1, options(arch, f"train.run_dir={tmp_path / 'init'}",
                                f"train.init_from={out}", "train.stop_after_frames=900"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_train(1, options(arch, f"train.run_dir={tmp_path / 'resume'}",
                                f"train.resume={out}"))
    assert proc.returncode == 2 and "an averaged model" in proc.stderr, proc.stderr
    p = subprocess.run(cli + ["average", run, "--last", "99", "--out", out], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2 and f"it has {len(found)} checkpoint(s)" in p.stderr, p.stderr
    other = str(tmp_path / "ckpt-other")
    shutil.copytree(found[-1], other)
    manifest = json.load(open(os.path.join(other, "manifest.json")))
    manifest["meta"]["model"]["encoder"] = ["conv 6 k3 s2", "blstm 7"]
    json.dump(manifest, open(os.path.join(other, "manifest.json"), "w"))
    p = subprocess.run(cli + ["average", found[-1], other, "--out", out], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2 and f"checkpoint {other}: its model" in p.stderr, p.stderr
