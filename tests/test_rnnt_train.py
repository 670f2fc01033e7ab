"""RNN-T models in the trainer, under a real mpiexec: K ranks against one process on the same
global batches, a bit-exact resume of the striped 1-bit exchange mid-epoch, the trainer's
features running on the transducer, eval and decode --greedy of the checkpoint, what the
config refuses with its reason, and a 2-rank 1-bit run that learns real speech."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import (TrainerRuns, assert_float32_close, latest_arrays, make_archive,
                      run_train)
from hpcsgd import checkpoint, config
from hpcsgd.errors import UserError


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    """3 shards of 10 utterances of 20..160 frames, phone tokens (8 and the blank)."""
    out = str(tmp_path_factory.mktemp("rnnt_archive"))
    make_archive(out, num_shards=3, utts_per_shard=10, dim=4, min_len=20, max_len=160,
                 token_kinds=("phones",), num_tokens=9)
    return out


def options(arch, *extra):
    """A tiny transducer (a stride-2 convolution and a BLSTM; a 4-cell LSTM predictor over
    3-value embeddings; a joint of 5), batches of up to 900 frames, 1 epoch, constant lr,
    momentum; every step checks replicas."""
    return [f"data.train={arch}", "model.type=rnnt", "model.encoder=[conv 6 k3 s2, blstm 5]",
            "model.predictor=[lstm 4]", "model.embed=3", "model.joint=5",
            "model.activation=relu", "train.minibatch=900", "data.bucket_frames=1800",
            "train.epochs=1", "train.log_every_frames=1000", "optim.lr=0.001",
            "optim.momentum_tc=100", "schedule.type=constant", "train.check_every_steps=1",
            *extra]


RUNS = TrainerRuns(options, timeout=180)
train, reference, arrays = RUNS.train, RUNS.reference, latest_arrays


@pytest.mark.parametrize("K", [1, 2])
def test_allreduce_equals_one_process_on_the_same_global_batches(K, arch, tmp_path,
                                                                 tmp_path_factory):
    """One rank bit for bit; 2 ranks within float32 rounding of the float64 trajectory."""
    got = arrays(train(K, arch, tmp_path_factory))["params"]
    want = reference(K, "float", arch, tmp_path)["params"]
    if K == 1:
        np.testing.assert_array_equal(got, want)
    else:
        assert_float32_close(got, want, reference(K, "float", arch, tmp_path,
                                                  float64=True)["params"])


@pytest.mark.parametrize("precision", [   # a scale of 16: the blank's bias gradient sums
    # about a blank per frame of the batch (450 here), 256 times that passes float16's 65504
    ("train.precision=mixed", "train.loss_scale=static", "train.loss_scale_init=16"),
    ("train.precision=bf16",)])
def test_reduced_precision_equals_its_one_process_reference(precision, arch, tmp_path,
                                                            tmp_path_factory):
    """float16 (a static loss scale) and bfloat16 stores of an RNN-T: one rank is the
    single-process reference bit for bit (the same roundings at the same places); not
    float32, but within its reach (the weights after an epoch differ by far less than they
    moved)."""
    got = arrays(train(1, arch, tmp_path_factory, *precision))["params"]
    np.testing.assert_array_equal(got, reference(1, "float", arch, tmp_path, *precision)["params"])
    f32 = arrays(train(1, arch, tmp_path_factory))["params"]
    assert not np.array_equal(got, f32)
    moved = np.abs(f32 - reference(1, "float", arch, tmp_path, "train.stop_after_frames=1")[
        "params"]).max()
    assert np.abs(got - f32).max() < moved


def test_striped_onebit_resumes_bit_exactly_mid_epoch(arch, tmp_path, tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "train.epochs=2",
             "data.specaugment=true")
    full = arrays(train(2, arch, tmp_path_factory, *extra))
    cut = str(tmp_path / "cut")
    for stop in ("train.stop_after_frames=1500", "train.stop_after_frames=0"):
        proc = run_train(2, options(arch, f"train.run_dir={cut}", *extra, stop), timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if stop.endswith("=1500"):
            meta = checkpoint.read_meta(checkpoint.latest(cut))
            assert meta["epoch"] == 0 and 0 < sum(meta["offsets"])
    resumed = arrays(cut)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)


@pytest.mark.parametrize("extra", [
    ("exchange.double_buffering=true",),
    ("exchange.aggregation=striped", "exchange.codec=kbit", "exchange.bits=mqgrad",
     "exchange.bits_every_steps=2"),
    ("exchange.aggregation=striped", "exchange.codec=dettmers", "rnnt.fastemit_lambda=0.01",
     "rnnt.joint_memory_mb=1"),
    ("train.probe_every_frames=2000", "train.probe_frames=900", "train.probe_max_minibatch=1800"),
    ("train.precision=mixed", "train.loss_scale=backoff", "train.loss_scale_init=65536"),
], ids=["double_buffering", "mqgrad", "dettmers_fastemit_subbatched", "probe", "backoff"])
def test_trainer_features_run_on_rnnt(extra, arch, tmp_path):
    """Double buffering (halves of the utterances), the adaptive bit width, Dettmers' codec
    with FastEmit and a joint in sub-batches, the automatic minibatch size: 2 ranks, a
    finite loss, replicas identical every step."""
    run = str(tmp_path / "run")
    proc = run_train(2, options(arch, f"train.run_dir={run}", "train.epochs=2", *extra),
                     timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    assert len(epochs) == 2 and all(np.isfinite(e["train_rnnt_per_token"]) for e in epochs)
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "rnnt: the joint's largest sub-batch held" in log


def test_eval_and_greedy_decode_agree(arch, tmp_path, tmp_path_factory):
    """eval's greedy token error rate (the trainer's CV measure) is decode --greedy's phone
    error rate on the same archive; decode --beam-size runs the beam search; infer and a beam
    of 0 are refused with the reason."""
    run = train(1, arch, tmp_path_factory)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    ev = subprocess.run(cli + ["eval", run, "--data", arch, "--json", str(tmp_path / "e.json")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ev.returncode == 0, ev.stderr
    assert "RNNT loss" in ev.stdout
    result = json.load(open(tmp_path / "e.json"))
    assert result["tokens"] == json.load(open(os.path.join(arch, "index.json")))["tokens"][
        "phones"]["total_tokens"]
    assert np.isfinite(result["per_token"]) and 0 < result["per_token"] < 20
    dec = subprocess.run(cli + ["decode", run, "--data", arch, "--greedy", "--out",
                                str(tmp_path / "dec")], capture_output=True, text=True,
                         env=env, timeout=120)
    assert dec.returncode == 0, dec.stderr
    assert "RNN-T greedy search" in dec.stdout
    decoded = json.load(open(tmp_path / "dec" / "result.json"))
    assert abs(decoded["error_rate"] - 100 * result["token_error_rate"]) < 1e-9
    beam = subprocess.run(cli + ["decode", run, "--data", arch, "--beam-size", "4", "--nbest",
                                 "--ctm", "--out", str(tmp_path / "beam")], capture_output=True,
                          text=True, env=env, timeout=120)
    assert beam.returncode == 0, beam.stderr
    assert "modified beam search (beam 4" in beam.stdout
    assert json.load(open(tmp_path / "beam" / "result.json"))["search"] == "beam 4"
    # the n-best lists: at most 4 per utterance, scores falling, the first the hypothesis
    best = dict(line.rstrip("\n").partition(" ")[::2] for line in open(tmp_path / "beam" / "hyp.txt"))
    lists = {}
    for line in open(tmp_path / "beam" / "nbest.txt"):
        key, score, *words = line.split()
        utt, rank = key.rsplit("-", 1)
        lists.setdefault(utt, []).append((int(rank), float(score), " ".join(words)))
    assert set(lists) == set(best)
    # a CTM line per hypothesis phone, its start on the encoder's frames, in each one's order
    ctm = [line.split() for line in open(tmp_path / "beam" / "hyp.ctm")]
    assert [(u, p) for u, _, _, _, p in ctm] == [(u, p) for u in sorted(best)
                                                   for p in best[u].split()]
    assert all(float(s) >= 0 and float(d) > 0 for _, _, s, d, _ in ctm)
    for utt, entries in lists.items():
        assert [r for r, _, _ in entries] == list(range(1, len(entries) + 1)) and len(entries) <= 4
        assert all(a[1] >= b[1] for a, b in zip(entries, entries[1:]))
        assert entries[0][2] == best[utt]
    # shallow fusion with a token bigram of the training archive, tuned on halves of its speakers
    fused = subprocess.run(cli + ["decode", run, "--data", arch, "--beam-size", "4", "--lm-order",
                                  "2", "--tune", "--out", str(tmp_path / "fused")],
                           capture_output=True, text=True, env=env, timeout=300)
    assert fused.returncode == 0, fused.stderr
    assert "LM weight -> %PER at token bonus" in fused.stdout and "held out: %PER" in fused.stdout
    got = json.load(open(tmp_path / "fused" / "result.json"))
    assert got["lm"].startswith("a 2-gram of the phones tokens") and got["lm_weight"] > 0
    assert got["error_rate"] == min(t["error_rate"] for t in got["lm_tuning"])
    bad = subprocess.run(cli + ["decode", run, "--data", arch, "--beam-size", "0"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "K >= 1" in bad.stderr
    bad = subprocess.run(cli + ["infer", run, "--data", arch, "--out", str(tmp_path / "p")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode != 0 and "RNN-T model" in bad.stderr


def test_config_refuses_what_rnnt_cannot_do_yet(arch):
    base = [f"data.train={arch}", "model.type=rnnt", "model.encoder=[conv 6 k3 s2]"]
    for extra, words in ((["model.parallel=2"], "model parallelism splits"),
                         (["model.predictor=[blstm 4]"], "causal")):
        with pytest.raises(UserError, match=words):
            config.load(None, base + extra)


def test_onebit_rnnt_learns_real_speech_on_two_ranks(demo_tokens, tmp_path):
    """2 ranks, the striped 1-bit exchange with error feedback after a float32 cold start of
    6 epochs, replicas checked every step, 20 epochs of the demo's 32 training speakers: the
    training loss falls to below half of its first epoch's (5.1 -> 1.0/token on Zen 4), the
    held-out loss gets 0.5/token below the first epoch's in the 1-bit phase (3.66 -> 2.81) and
    held-out phones are recognized in its last epochs (greedy token error rate 90% there, below
    97%; 100% is all deletions, where the first 11 epochs stay)."""
    run = str(tmp_path / "run")
    frames = json.load(open(os.path.join(demo_tokens, "train", "index.json")))["total_frames"]
    proc = run_train(2, [f"data.train={demo_tokens}/train", f"data.cv={demo_tokens}/cv",
                         f"train.run_dir={run}", "model.type=rnnt",
                         "model.encoder=[stack 2, blstm 96, blstm 96]",
                         "model.predictor=[lstm 96]", "model.embed=32", "model.joint=96",
                         "train.minibatch=1500", "train.epochs=20", "optim.type=adam",
                         "optim.lr=2e-6", "optim.momentum_tc=0", "schedule.type=constant",
                         "exchange.aggregation=striped", "exchange.codec=onebit",
                         f"exchange.cold_start_frames={6 * frames}",
                         "train.check_every_steps=1", "train.log_every_frames=1000000"],
                     timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cold start over" in open(os.path.join(run, "logs", "rank0000.log")).read()
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    assert len(epochs) == 20
    train_loss = [e["train_rnnt_per_token"] for e in epochs]
    cv_loss = [e["cv_rnnt_per_token"] for e in epochs]
    assert train_loss[-1] < 0.5 * train_loss[0], train_loss
    assert min(cv_loss[-8:]) < cv_loss[0] - 0.5, cv_loss
    errors = [e["cv_token_error_rate"] for e in epochs]
    assert min(errors[-4:]) < 0.97, errors


def test_an_rnnt_starts_from_a_ctc_checkpoints_encoder(arch, tmp_path):
    """train.init_from a CTC run with the same encoder: the RNN-T's encoder layers are the
    CTC encoder's weights bit for bit, the prediction and joint networks keep their own init
    (train.init_from in process), and a run says so; a hybrid (frame label) checkpoint, or a
    CTC encoder of another shape, are refused by name."""
    from hpcsgd.model import build
    from hpcsgd.model_io import load_model
    from hpcsgd.train import init_from
    encoder = "model.encoder=[conv 6 k3 s2, blstm 5]"
    ctc = str(tmp_path / "ctc")
    proc = run_train(1, [f"data.train={arch}", "model.type=ctc", encoder, "train.epochs=1",
                         "train.minibatch=900", f"train.run_dir={ctc}",
                         "model.activation=relu"], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    _, src, src_meta = load_model(ctc)
    shape = {"type": "rnnt", "input_dim": src_meta["model"]["input_dim"],
             "encoder": src_meta["model"]["encoder"], "num_tokens": 9, "predictor": ["lstm 4"],
             "embed": 3, "joint": 5, "joint_mode": "add", "activation": "relu"}
    model = build(shape)
    params, fresh = model.new_params(), model.new_params()
    model.init(fresh, np.random.default_rng(0))
    params.flat[:] = fresh.flat
    what = init_from(model, params, ctc, {"tokens": {"kind": "phones", "inventory_hash": "?"}})
    assert "its encoder's layers" in what
    encoder_names = {s.name for layer in model.layers[:-1] for s in layer.specs()}
    assert encoder_names == {"enc.0.w", "enc.0.b", "enc.1.w", "enc.1.u_fwd", "enc.1.u_bwd",
                             "enc.1.b"}   # conv; BLSTM
    for spec in model.specs:
        want = src[spec.name] if spec.name in encoder_names else fresh[spec.name]
        np.testing.assert_array_equal(params[spec.name], want, err_msg=spec.name)
    run = str(tmp_path / "rnnt")
    proc = run_train(1, options(arch, f"train.run_dir={run}", f"train.init_from={ctc}"),
                     timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "its encoder's layers" in open(os.path.join(run, "logs", "rank0000.log")).read()
    other = str(tmp_path / "other")
    proc = run_train(1, options(arch, f"train.run_dir={other}", f"train.init_from={ctc}",
                                "model.encoder=[conv 6 k3 s2, blstm 4]"), timeout=180)
    assert proc.returncode == 2 and "is not this model's" in proc.stderr, proc.stderr
    dnn_arch = str(tmp_path / "frames")
    make_archive(dnn_arch, num_shards=1, utts_per_shard=6, dim=4)
    dnn = str(tmp_path / "dnn")
    proc = run_train(1, [f"data.train={dnn_arch}", "model.hidden=[5]", "train.epochs=1",
                         f"train.run_dir={dnn}"], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_train(1, options(arch, f"train.run_dir={other}", f"train.init_from={dnn}"),
                     timeout=180)
    assert proc.returncode == 2 and "a dnn model; an RNN-T starts from" in proc.stderr, \
        proc.stderr


def test_int4_qat_keeps_the_joint_float_and_its_export_decodes_the_same(arch, tmp_path):
    """The INT4 paper's recipe on 2 ranks (SAWB weights, BAC activations at 4 bits): the first
    encoder layer and the joint (encoder and predictor projections, the output layer) stay
    float, the other encoder layers and the prediction network (embedding, LSTM) are
    quantized, the predictor's hidden state on its fixed grid; the run trains to a finite
    loss, `hpcsgd export --int4` writes the integer model and decoding it gives the
    checkpoint's hypotheses, greedy and beam. The naive recipe (MAX everywhere, the first
    layer quantized too) trains as well."""
    from hpcsgd.model import build
    run = str(tmp_path / "qat")
    qat = ("qat.weights=sawb", "qat.weight_bits=4", "qat.activations=bac",
           "qat.activation_bits=4")
    proc = run_train(2, options(arch, f"train.run_dir={run}", "train.epochs=2", *qat),
                     timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    meta = checkpoint.read_meta(checkpoint.latest(run))
    assert meta["model"]["qat"]["first_layer"] == "float"
    model = build(meta["model"])
    assert sorted(model.quant.weights) == ["enc.1.u_bwd", "enc.1.u_fwd", "enc.1.w", "pred.embed",
                                           "pred.lstm.0.u", "pred.lstm.0.w"]
    assert model.quant.rules[0] == "none" and model.quant.rules[2] == "none"
    assert model.layers[-1].pred[0].hidden_grid is not None
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    assert all(np.isfinite(e["train_rnnt_per_token"]) for e in epochs)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    out = str(tmp_path / "int4.h5")
    ex = subprocess.run(cli + ["export", run, "--int4", "--out", out], capture_output=True,
                        text=True, env=env, timeout=120)
    assert ex.returncode == 0, ex.stderr
    for search in (["--greedy"], ["--beam-size", "3"]):
        hyps = []
        for source in (run, out):
            dec = str(tmp_path / f"dec{len(hyps)}{search[0]}")
            proc = subprocess.run(cli + ["decode", source, "--data", arch, *search, "--out",
                                         dec], capture_output=True, text=True, env=env,
                                  timeout=120)
            assert proc.returncode == 0, proc.stderr
            hyps.append(open(os.path.join(dec, "hyp.txt")).read())
        assert hyps[0] == hyps[1] and hyps[0].strip()
    naive = str(tmp_path / "naive")
    proc = run_train(2, options(arch, f"train.run_dir={naive}", "qat.weights=max",
                                "qat.weight_bits=4", "qat.activations=max",
                                "qat.activation_bits=4", "qat.first_layer=quantized"),
                     timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "enc.0.w" in build(checkpoint.read_meta(checkpoint.latest(naive))["model"]).quant.weights
