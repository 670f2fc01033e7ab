"""The (B)LSTM in the trainer: K ranks against one process on the same global minibatches,
1-bit SGD against the two-residual loop, bit-exact resume mid-epoch (striped 1-bit, double
buffering), a move from 2 to 3 ranks mid-epoch, eval/infer on chunks, clipping and the
divergence guard, all under a real mpiexec."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import (TRAIN, TrainerRuns, assert_float32_close, latest_arrays, make_archive,
                      run_mpi, run_train)
from hpcsgd import checkpoint



@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("lstm_archive"))
    make_archive(out, num_shards=2, utts_per_shard=8, min_len=5, max_len=90)
    return out


def options(arch, *extra):
    """A tiny BLSTM (2 layers of 6 cells, a bottleneck), chunks of 8 + 2 + 3 context frames,
    4 chunks per minibatch; 1 epoch, constant lr, momentum; every step checks the replicas."""
    return [f"data.train={arch}", "model.type=lstm", "model.cells=[6, 5]",
            "model.bottleneck=[7]", "data.chunk=8", "data.left_context=2",
            "data.right_context=3", "train.minibatch=32", "train.epochs=1",
            "data.block_frames=300", "data.buffer_frames=900", "train.log_every_frames=500",
            "optim.lr=0.01", "optim.momentum_tc=100", "schedule.type=constant",
            "train.check_every_steps=1", *extra]


RUNS = TrainerRuns(options, timeout=180)
train, reference, arrays = RUNS.train, RUNS.reference, latest_arrays


@pytest.mark.parametrize("K", [1, 2, 3])
def test_allreduce_equals_one_process_on_the_same_global_minibatches(K, arch, tmp_path,
                                                                     tmp_path_factory):
    got = arrays(train(K, arch, tmp_path_factory))["params"]
    want = reference(K, "float", arch, tmp_path)["params"]
    if K == 1:
        np.testing.assert_array_equal(got, want)   # the same arithmetic, in the same order
    else:   # K partial sums vs one sum over every rank's chunks: rounding only
        assert_float32_close(got, want, reference(K, "float", arch, tmp_path,
                                                  float64=True)["params"])
    assert not np.array_equal(got, reference(K, "float", arch, tmp_path,
                                             "train.stop_after_frames=64")["params"])


MIXED = ("train.precision=mixed", "train.loss_scale=static", "train.loss_scale_init=1024")


@pytest.mark.parametrize("K", [1, 2])
def test_mixed_precision_equals_one_mixed_process(K, arch, tmp_path, tmp_path_factory):
    """A mixed-precision BLSTM (float16 stores, a static loss scale): one rank is the
    single-process mixed reference bit for bit; two ranks round two partial weight gradients
    where one process rounds their sum, both the float64 trajectory plus float16 rounding."""
    got = arrays(train(K, arch, tmp_path_factory, *MIXED))
    want = reference(K, "float", arch, tmp_path, *MIXED)["params"]
    if K == 1:
        np.testing.assert_array_equal(got["params"], want)
    else:
        assert_float32_close(got["params"], want, reference(K, "float", arch, tmp_path, *MIXED,
                                                            float64=True)["params"])
    assert not np.array_equal(got["params"], arrays(train(K, arch, tmp_path_factory))["params"])


def test_striped_onebit_on_one_rank_equals_the_two_residual_loop(arch, tmp_path,
                                                                 tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit")
    got = arrays(train(1, arch, tmp_path_factory, *extra))
    want = reference(1, "onebit", arch, tmp_path, *extra)
    np.testing.assert_array_equal(got["params"], want["params"])
    np.testing.assert_array_equal(got["rank0000/exchange/residual1"], want["residual1"])
    np.testing.assert_array_equal(got["rank0000/exchange/residual2"], want["residual2"])
    assert np.abs(want["residual2"]).sum() > 0


@pytest.mark.parametrize("double_buffering", [False, True])
def test_striped_onebit_resumes_bit_exactly_mid_epoch_at_two_ranks(double_buffering, arch,
                                                                   tmp_path, tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "train.epochs=2",
             f"exchange.double_buffering={str(double_buffering).lower()}")
    full = arrays(train(2, arch, tmp_path_factory, *extra))
    cut = str(tmp_path / "cut")
    index = json.load(open(os.path.join(arch, "index.json")))
    for stop in ("train.stop_after_frames=96", "train.stop_after_frames=0"):
        proc = run_train(2, options(arch, f"train.run_dir={cut}", *extra, stop),
                         timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if stop.endswith("=96"):
            meta = checkpoint.read_meta(checkpoint.latest(cut))
            assert meta["epoch"] == 0 and 0 < sum(meta["offsets"]) < index["total_frames"]
    assert "resumed from" in open(os.path.join(cut, "logs", "rank0001.log")).read()
    resumed = arrays(cut)
    assert set(full) == set(resumed)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)


def test_a_run_moves_mid_epoch_from_2_to_3_ranks(arch, tmp_path):
    """The rest of the epoch is re-dealt in whole chunks: every chunk once (the epoch's
    frame slots add up to the archive's), residuals folded, replicas agree."""
    from hpcsgd.data.sequences import SequenceLoader
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit")
    run = str(tmp_path / "run")
    for K, stop in ((2, 96), (3, 0)):
        proc = run_train(K, options(arch, f"train.run_dir={run}", *extra,
                                    f"train.stop_after_frames={stop}"), timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "re-dealt from 2 to 3 ranks" in log and "folded into the new stripes" in log
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    loader = SequenceLoader(arch, chunk=8, left_context=2, right_context=3, block_frames=300,
                            buffer_frames=900, prefetch=False)
    assert [e["frames"] for e in epochs] == [int(loader.epoch_frames(0).sum())]


def test_eval_and_infer_on_chunks_agree(arch, tmp_path, tmp_path_factory):
    """eval's frame accuracy and CE (chunks, context outside the loss) equal those of infer's
    per-utterance log-posteriors on the same archive; --sequences whole gives every frame too."""
    run = train(1, arch, tmp_path_factory)
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    ev = subprocess.run(cli + ["eval", run, "--data", arch, "--json", str(tmp_path / "e.json")],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ev.returncode == 0, ev.stderr
    result = json.load(open(tmp_path / "e.json"))
    for mode in ("chunks", "whole"):
        out = str(tmp_path / mode)
        p = subprocess.run(cli + ["infer", run, "--data", arch, "--out", out, "--format", "hdf5",
                                  "--output", "logpost", "--sequences", mode],
                           capture_output=True, text=True, env=env, timeout=120)
        assert p.returncode == 0, p.stderr
        with h5py.File(out + ".h5") as f:
            logp = f["values"][:]
        labels = _labels(arch)
        assert len(logp) == len(labels) == result["frames"]
        if mode == "chunks":
            acc = float((logp.argmax(1) == labels).mean())
            ce = float(-logp[np.arange(len(labels)), labels].mean())
            assert abs(acc - result["frame_accuracy"]) < 1e-12
            assert abs(ce - result["ce"]) < 1e-5 * abs(result["ce"])


def _labels(arch):
    """The archive's labels in archive order (shard by shard)."""
    from hpcsgd.data import archive
    index = archive.read_index(arch)
    out = []
    for shard in index["shards"]:
        with archive.open_shard(os.path.join(index["dir"], shard["file"])) as f:
            out.append(f["labels"][:])
    return np.concatenate(out)


def test_a_too_high_learning_rate_is_caught_by_the_divergence_guard(arch, tmp_path):
    """No hang and no NaN weights: the run stops with the guard's message naming the step,
    every checkpoint it left is finite."""
    run = str(tmp_path / "run")
    proc = run_mpi(2, TRAIN + options(arch, f"train.run_dir={run}", "optim.lr=10",
                                      "model.cells=[64]", "optim.momentum_tc=0",
                                      "train.epochs=3", "train.checkpoint_every_frames=64"),
                   timeout=180)
    assert proc.returncode != 0
    assert ("training diverged" in proc.stderr or "cross-entropy is" in proc.stderr), proc.stderr
    assert "step" in proc.stderr
    ckpts = checkpoint.checkpoint_dir(run)
    for name in os.listdir(ckpts) if os.path.isdir(ckpts) else []:
        if name.endswith(".h5"):
            assert np.isfinite(checkpoint.load(os.path.join(ckpts, name))[0]["params"]).all()


def test_clipping_bounds_each_update(arch, tmp_path):
    """Without momentum a step moves the weights by lr x the (clipped) gradient: with
    train.clip_gradient_norm = c every step's move is at most lr x c x its labelled frames
    (<= the minibatch), and the log says how many steps were clipped."""
    from hpcsgd import config
    from hpcsgd.data.sequences import SequenceLoader
    from hpcsgd.model import build
    from hpcsgd.train import model_shape
    run = str(tmp_path / "run")
    extra = ("optim.momentum_tc=0", "train.clip_gradient_norm=0.01", "optim.lr=0.5",
             "train.stop_after_frames=32")
    proc = run_train(1, options(arch, f"train.run_dir={run}", *extra), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cfg = config.load(None, options(arch, f"train.run_dir={run}", *extra))
    model = build(model_shape(cfg, SequenceLoader(arch, chunk=8, prefetch=False)))
    init = model.new_params()
    model.init(init, np.random.default_rng(0))
    moved = np.linalg.norm(arrays(run)["params"] - init.flat)
    assert 0 < moved <= 0.5 * 0.01 * 32 * (1 + 1e-5)
    assert "clipped 1 of 1 gradients" in open(os.path.join(run, "logs", "rank0000.log")).read()


def test_the_probe_and_the_timeline_work_on_sequences(arch, tmp_path):
    """The minibatch-size probe tries sizes in whole chunks on every rank and the run goes
    on with the chosen one; the timeline records the steps; double buffering keeps the
    replicas identical (checked every step)."""
    run = str(tmp_path / "run")
    proc = run_train(2, options(arch, f"train.run_dir={run}",
                                "train.probe_every_frames=200", "train.probe_frames=64",
                                "train.probe_max_minibatch=128", "train.timeline=true",
                                "exchange.double_buffering=true"), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    probes = [r for r in records if r["kind"] == "probe"]
    assert probes and all(int(c) >= 32 for c in probes[0]["criteria"])
    assert all(np.isfinite(v) for v in probes[0]["criteria"].values())
    assert os.listdir(os.path.join(run, "timeline"))


def test_double_buffering_halves_whole_chunks(arch, tmp_path):
    """An odd number of chunks per rank (3 of 8 frames): the halves are 2 + 1 chunks, never a
    cut chunk; the run trains and its replicas agree every step."""
    run = str(tmp_path / "run")
    proc = run_train(2, options(arch, f"train.run_dir={run}", "train.minibatch=48",
                                "exchange.double_buffering=true"), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from hpcsgd.step import halves
    assert [int(h[0]) for h in halves(np.array([24]), 8)] == [16, 8]
