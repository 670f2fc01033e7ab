"""The trainer end to end: config validation, learning on real speech, bit-exact resume,
divergence, checkpoint safety, eval/infer round trips, and K ranks under a real mpiexec."""
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import REPO, make_archive, run_mpi, run_train
from hpcsgd import checkpoint
from hpcsgd.errors import UserError

DEMO = os.path.join(REPO, "data_prep", "demo", "so762")
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
           MPIR_CVAR_ENABLE_HEAVY_YIELD="1")


def hpcsgd(*args, timeout=300, check=True):
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=ENV, cwd=REPO)
    if check:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def train_args(archive_dir, run_dir, *extra):
    return ["train", f"data.train={archive_dir}", f"train.run_dir={run_dir}", "data.context=2",
            "model.hidden=[16, 16]", "train.minibatch=64", "train.epochs=2",
            "data.block_frames=500", "data.buffer_frames=1500", "train.log_every_frames=1000",
            "optim.lr=0.01", *extra]


def final_params(run_dir):
    arrays, meta = checkpoint.load(checkpoint.latest(run_dir))
    return arrays, meta


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synth"))
    make_archive(out, num_shards=2, utts_per_shard=10)
    return out


@pytest.fixture(scope="module")
def demo_archive(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("demo"))
    hpcsgd("prep", DEMO, out, "--alignments", os.path.join(DEMO, "phones.ctm"),
           "--labels", os.path.join(DEMO, "labels.txt"), "--cv-speakers", "8")
    return out


# --- configuration -------------------------------------------------------------------------

def test_resolved_config_and_versions_are_saved(synth, tmp_path):
    run = str(tmp_path / "run")
    hpcsgd(*train_args(synth, run, "train.epochs=1"))
    with open(os.path.join(run, "config.yaml")) as f:
        text = f.read()
    assert "minibatch: 64" in text and "hidden:" in text
    with open(os.path.join(run, "versions.json")) as f:
        info = json.load(f)
    assert info["packages"]["numpy"] and info["git_revision"]
    assert os.path.isfile(os.path.join(run, "logs", "rank0000.log"))
    kinds = [json.loads(line)["kind"] for line in open(os.path.join(run, "metrics.jsonl"))]
    assert kinds[0] == "start" and "train" in kinds and kinds[-1] == "epoch"


# --- learning on real speech -----------------------------------------------------------------

def test_dnn_learns_real_speech_far_above_majority(demo_archive, tmp_path):
    run = str(tmp_path / "run")
    hpcsgd("train", f"data.train={demo_archive}/train", f"data.cv={demo_archive}/cv",
           f"train.run_dir={run}", "model.hidden=[256, 256]", "train.minibatch=256",
           "train.epochs=2", "optim.lr=0.001", "train.log_every_frames=100000", timeout=600)
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if '"epoch"' in line and json.loads(line)["kind"] == "epoch"]
    last = epochs[-1]
    # always-SIL is ~34% on these held-out speakers; a DNN that learns is far above it
    assert last["cv_frame_accuracy"] > last["cv_majority"] + 0.10, last
    assert epochs[-1]["train_ce"] < epochs[0]["train_ce"]
    # eval on the same archive reproduces the trainer's CV numbers
    out = str(tmp_path / "eval.json")
    proc = hpcsgd("eval", run, "--data", f"{demo_archive}/cv", "--json", out)
    result = json.load(open(out))
    assert abs(result["frame_accuracy"] - last["cv_frame_accuracy"]) < 1e-9
    assert np.asarray(result["confusion"]).sum() == result["frames"]
    assert "per-class accuracy" in proc.stdout
    hpcsgd("plot", run)
    assert os.path.getsize(os.path.join(run, "plots", "learning_curves.png")) > 10_000


def test_blstm_learns_real_speech_far_above_majority(demo_archive, tmp_path):
    """jobs/configs/so762_blstm.yaml's recipe, smaller (one layer of 64 cells per direction),
    on the bundled demo: far above always-SIL on held-out speakers after 3 epochs, and eval
    reproduces the trainer's CV on the chunks."""
    run = str(tmp_path / "run")
    hpcsgd("train", "--config", os.path.join(REPO, "jobs", "configs", "so762_blstm.yaml"),
           f"data.train={demo_archive}/train", f"data.cv={demo_archive}/cv",
           f"train.run_dir={run}", "model.cells=[64]", "train.minibatch=1280",
           "train.epochs=3", "train.log_every_frames=100000", timeout=600)
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if '"epoch"' in line and json.loads(line)["kind"] == "epoch"]
    last = epochs[-1]
    assert last["cv_frame_accuracy"] > last["cv_majority"] + 0.10, last
    assert epochs[-1]["train_ce"] < epochs[0]["train_ce"]
    out = str(tmp_path / "eval.json")
    hpcsgd("eval", run, "--data", f"{demo_archive}/cv", "--json", out)
    assert abs(json.load(open(out))["frame_accuracy"] - last["cv_frame_accuracy"]) < 1e-9


def test_infer_posteriors_sum_to_one_and_loglik_uses_priors(demo_archive, tmp_path):
    run = str(tmp_path / "run")
    hpcsgd("train", f"data.train={demo_archive}/train", f"train.run_dir={run}",
           "model.hidden=[32]", "train.epochs=1", "train.stop_after_frames=5000")
    post, ll = str(tmp_path / "post"), str(tmp_path / "ll")
    hpcsgd("infer", run, "--data", f"{demo_archive}/cv", "--out", post, "--output", "posteriors")
    hpcsgd("infer", run, "--data", f"{demo_archive}/cv", "--out", ll, "--output", "loglik")
    with h5py.File(post + ".h5") as f:
        p = f["values"][()]
        offsets = f["utt_offsets"][()]
        utts = [u.decode() for u in f["utt_ids"][()]]
    with h5py.File(ll + ".h5") as f:
        loglik = f["values"][()]
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=1e-5)
    counts = np.asarray(final_params(run)[1]["label_counts"], np.float64)
    log_prior = np.log(np.maximum(counts / counts.sum(), 1e-8))
    np.testing.assert_allclose(loglik, np.log(p) - log_prior, atol=2e-4)
    import kaldiio
    ark = dict(kaldiio.load_scp(ll + ".scp"))
    assert len(ark) == len(utts) and offsets[-1] == len(p)
    np.testing.assert_array_equal(ark[utts[3]], loglik[offsets[3]:offsets[4]])


# --- checkpoints and resume ------------------------------------------------------------------

@pytest.mark.parametrize("adagrad", ["off", "aggregate"])
def test_killed_and_resumed_run_ends_bit_identical(synth, tmp_path, adagrad):
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    extra = (f"optim.adagrad={adagrad}", "optim.momentum_tc=500")
    hpcsgd(*train_args(synth, full, *extra))
    total = json.load(open(os.path.join(synth, "index.json")))["total_frames"]
    hpcsgd(*train_args(synth, cut, *extra, f"train.stop_after_frames={total * 3 // 2}"))
    stopped, meta = final_params(cut)
    assert meta["epoch"] == 1 and 0 < sum(meta["offsets"]) < total  # killed mid-epoch 1
    hpcsgd(*train_args(synth, cut, *extra))                                  # resume=auto
    a, b = final_params(full)[0], final_params(cut)[0]
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert not np.array_equal(stopped["params"], a["params"])
    # the resumed epoch reports all its steps, those before the stop too (the checkpoint
    # keeps the epoch's sums): the same frame accuracy (integer counts), the same CE up to
    # regrouping a float64 sum of a few dozen steps (relative error below 1e-14)
    want, got = epoch_records(full), epoch_records(cut)
    assert len(got) == len(want) == 2
    for w, g in zip(want, got):
        assert g["train_frame_accuracy"] == w["train_frame_accuracy"]
        np.testing.assert_allclose(g["train_ce"], w["train_ce"], rtol=1e-12)


def epoch_records(run):
    return [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
            if r["kind"] == "epoch"]


def test_resume_under_two_ranks_is_bit_identical(synth, tmp_path):
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    proc = run_train(2, train_args(synth, full, "train.check_every_steps=1")[1:], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    total = json.load(open(os.path.join(synth, "index.json")))["total_frames"]
    proc = run_train(2, train_args(synth, cut, f"train.stop_after_frames={total // 2}")[1:],
                     timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_train(2, train_args(synth, cut)[1:], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    np.testing.assert_array_equal(final_params(full)[0]["params"], final_params(cut)[0]["params"])
    for w, g in zip(epoch_records(full), epoch_records(cut)):   # the sums of both ranks kept
        assert g["train_frame_accuracy"] == w["train_frame_accuracy"]
        np.testing.assert_allclose(g["train_ce"], w["train_ce"], rtol=1e-12)
    assert "2 rank(s)" in open(os.path.join(full, "logs", "rank0001.log")).read()


def test_checkpoint_of_another_model_shape_is_refused(synth, tmp_path):
    run = str(tmp_path / "run")
    hpcsgd(*train_args(synth, run, "train.epochs=1"))
    proc = hpcsgd(*train_args(synth, run, "model.hidden=[8]"), check=False)
    assert proc.returncode == 2
    assert "checkpoint" in proc.stderr and "model" in proc.stderr and "hidden" in proc.stderr


def test_resume_refuses_an_archive_with_another_label_inventory(synth, tmp_path):
    """Same number of labels, other symbols: the checkpoint's inventory hash must match."""
    run = str(tmp_path / "run")
    hpcsgd(*train_args(synth, run, "train.epochs=1"))
    other = str(tmp_path / "other")
    make_archive(other, num_shards=2, utts_per_shard=10, label_prefix="P")
    proc = hpcsgd(*train_args(other, run), check=False)
    assert proc.returncode == 2
    assert "label_inventory_hash" in proc.stderr and "checkpoint" in proc.stderr


def test_eval_refuses_an_archive_with_another_inventory(synth, tmp_path):
    run = str(tmp_path / "run")
    hpcsgd(*train_args(synth, run, "train.epochs=1"))
    other = str(tmp_path / "other")
    make_archive(other, num_shards=1, num_labels=7)
    proc = hpcsgd("eval", run, "--data", other, check=False)
    assert proc.returncode == 2 and "label inventory" in proc.stderr


def test_diverging_loss_stops_naming_the_step_without_a_bad_checkpoint(synth, tmp_path):
    run = str(tmp_path / "run")
    proc = hpcsgd(*train_args(synth, run, "optim.lr=10", "model.activation=relu",
                              "model.hidden=[256, 256]", "optim.momentum_tc=0",
                              "train.checkpoint_every_frames=200"), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cross-entropy is" in proc.stderr and "step" in proc.stderr
    ckpt_dir = checkpoint.checkpoint_dir(run)
    for name in os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []:
        if name.endswith(".h5"):
            arrays, _ = checkpoint.load(os.path.join(checkpoint.checkpoint_dir(run), name))
            assert np.isfinite(arrays["params"]).all(), name


@pytest.mark.parametrize("factor, stops", [(0.5, True), (0, False)])
def test_a_blown_up_cross_entropy_stops_the_run_at_the_first_log_line(synth, tmp_path, factor,
                                                                      stops):
    """An untrained model's CE is about ln(labels): with the limit at half of that, the first
    log window is 'diverged'; factor 0 never stops."""
    run = str(tmp_path / "run")
    proc = hpcsgd(*train_args(synth, run, f"train.diverged_ce_factor={factor}",
                              "train.epochs=1"), check=False)
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    if not stops:
        assert proc.returncode == 0, proc.stderr
        assert [r for r in records if r["kind"] == "epoch"]
        return
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert re.search(r"step \d+ \(epoch 0, frame 1,0\d\d\): training diverged: cross-entropy "
                     r"is [\d.]+ nats/frame over the last 1,0\d\d frames, above "
                     r"train.diverged_ce_factor 0.5 x ln\(\d+ labels\)", proc.stderr), proc.stderr
    assert not [r for r in records if r["kind"] in ("train", "epoch")]


# --- K ranks under a real mpiexec -------------------------------------------------------------

@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_stay_bit_identical_every_step(synth, tmp_path, ranks):
    run = str(tmp_path / "run")
    proc = run_mpi(ranks, ["-m", "mpi4py", "-m", "hpcsgd.cli"] + train_args(
        synth, run, "train.check_every_steps=1", "train.epochs=1"), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    logs = [open(os.path.join(run, "logs", f"rank{r:04d}.log")).read() for r in range(ranks)]
    assert all(f"{ranks} rank(s)" in text for text in logs)


def test_a_failing_rank_aborts_the_job_instead_of_hanging(tmp_path):
    """Rank 1 reads a corrupt shard; the job must end non-zero, naming the file, not hang."""
    out = str(tmp_path / "arch")
    make_archive(out, num_shards=2, utts_per_shard=10)
    path = os.path.join(out, "shard-00001.h5")
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    proc = run_mpi(2, ["-m", "mpi4py", "-m", "hpcsgd.cli"] + train_args(out, str(tmp_path / "run")),
                   timeout=120)
    assert proc.returncode != 0
    assert "shard-00001.h5" in proc.stderr


def test_a_resume_skips_a_truncated_newest_checkpoint(synth, tmp_path):
    """A half-copied rank file in the newest checkpoint (the previous one intact): the run
    resumes from the previous one on every rank, says which it skipped and why, and ends
    with the weights of an uninterrupted run (the same steps again, the same bits)."""
    run = str(tmp_path / "run")
    proc = run_train(2, train_args(synth, run, "train.epochs=2")[1:], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    whole = final_params(run)[0]["params"]
    newest = checkpoint.latest(run)
    path = os.path.join(newest, checkpoint.rank_file(1))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    proc = run_train(2, train_args(synth, run, "train.epochs=2")[1:], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert f"checkpoint {newest} skipped" in log and "rank0001.h5" in log
    assert "resumed from" in log and "epoch 1" in log
    np.testing.assert_array_equal(final_params(run)[0]["params"], whole)


def test_a_cv_set_smaller_than_one_block_per_rank_is_evaluated_by_three_ranks(synth, tmp_path):
    """The CV loader sizes its blocks so every rank gets one (the training default, 8192
    frames, would leave this 2-shard set with 2 blocks for 3 ranks); the sums are the same as
    one process evaluating the whole set."""
    run = str(tmp_path / "run")
    proc = run_train(3, train_args(synth, run, f"data.cv={synth}", "train.epochs=1")[1:],
                     timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    epoch = [json.loads(l) for l in open(os.path.join(run, "metrics.jsonl"))
             if '"epoch"' in l and json.loads(l)["kind"] == "epoch"][-1]
    out = str(tmp_path / "eval.json")
    hpcsgd("eval", run, "--data", synth, "--json", out)
    result = json.load(open(out))
    assert result["frame_accuracy"] == pytest.approx(epoch["cv_frame_accuracy"], abs=1e-12)
    assert result["ce"] == pytest.approx(epoch["cv_ce"], rel=1e-9)


# --- the run directory ---------------------------------------------------------------------

def test_a_fresh_start_cleans_what_a_run_without_a_checkpoint_left(synth, tmp_path):
    """An earlier attempt that died before its first checkpoint left logs and metrics: a
    fresh start removes them (and says so), so `hpcsgd plot` shows one run."""
    run = str(tmp_path / "run")
    os.makedirs(os.path.join(run, "logs"))
    with open(os.path.join(run, "metrics.jsonl"), "w") as f:
        f.write(json.dumps({"kind": "train", "frames": 999999, "ce": 9.9}) + "\n")
    open(os.path.join(run, "logs", "rank0000.log"), "w").write("an old attempt\n")
    hpcsgd(*train_args(synth, run, "train.epochs=1"))
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert records[0]["kind"] == "start" and max(r.get("frames", 0) for r in records) < 999999
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "an old attempt" not in log and "never reached a checkpoint: removed" in log


def test_a_resumed_run_keeps_only_its_own_metrics(synth, tmp_path):
    """Records the interrupted attempt wrote after its last checkpoint are dropped: the
    resumed run trains those frames again and records them once."""
    run = str(tmp_path / "run")
    hpcsgd(*train_args(synth, run, "train.stop_after_frames=1500"))
    frames = final_params(run)[1]["frames"]
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:   # the attempt went on, then died
        f.write(json.dumps({"kind": "train", "frames": frames + 10, "ce": 9.9}) + "\n")
    hpcsgd(*train_args(synth, run))
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    assert not [r for r in records if r.get("ce") == 9.9]
    train = [r["frames"] for r in records if r["kind"] == "train"]
    assert train == sorted(train) and len(train) == len(set(train))


def test_a_fresh_start_over_another_runs_checkpoints_is_refused(synth, tmp_path):
    run = str(tmp_path / "run")
    hpcsgd(*train_args(synth, run, "train.epochs=1"))
    proc = hpcsgd(*train_args(synth, run, "train.resume=none"), check=False)
    assert proc.returncode == 2
    assert f"{run} holds checkpoints of another run" in proc.stderr, proc.stderr
    assert checkpoint.latest(run)   # nothing deleted


def test_a_run_dir_whose_checkpoints_are_all_broken_names_each_one(synth, tmp_path):
    """Every checkpoint unreadable: not "checkpoints of another run ... or resume
    (train.resume=auto)", which is already set, but each checkpoint skipped, with the file at
    fault and why; nothing deleted."""
    run = str(tmp_path / "run")
    hpcsgd(*train_args(synth, run))
    older, newest = checkpoint.all_checkpoints(run)
    shared = os.path.join(newest, checkpoint.SHARED)
    with open(shared, "r+b") as f:
        f.truncate(os.path.getsize(shared) // 2)
    os.unlink(os.path.join(older, checkpoint.MANIFEST))
    proc = hpcsgd(*train_args(synth, run), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "none of its 2 checkpoint(s) reads back whole" in proc.stderr, proc.stderr
    assert f"skipped {newest}: " in proc.stderr and f"({shared})" in proc.stderr
    assert f"skipped {older}: No such file or directory " \
           f"({os.path.join(older, checkpoint.MANIFEST)})" in proc.stderr
    assert "another run" not in proc.stderr and "train.resume=auto)" not in proc.stderr
    assert "Traceback" not in proc.stderr and os.path.isfile(shared)


def test_a_run_dir_that_is_a_file_or_cannot_be_made_is_a_one_line_error(synth, tmp_path):
    """Not the OSError's traceback (FileExistsError, [Errno 30] on a read-only file system):
    one line naming the path and the cause."""
    afile = tmp_path / "afile"
    afile.write_text("not a run\n")
    for run, cause in ((afile, f"train.run_dir {afile}: an existing file, not a directory"),
                       (afile / "run", f"train.run_dir {afile / 'run'}: cannot create it: "
                                       f"Not a directory")):
        proc = hpcsgd(*train_args(synth, run, "train.epochs=1"), check=False)
        assert proc.returncode == 2 and proc.stderr.startswith(
            f"hpcsgd train: rank 0: error: {cause}"), proc.stderr
        assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert afile.read_text() == "not a run\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_run_dir_in_a_read_only_directory_is_a_one_line_error(synth, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    os.chmod(locked, 0o555)
    try:
        for run, cause in ((locked / "run", "cannot create it: Permission denied"),
                           (locked, "cannot write in it: Permission denied")):
            proc = hpcsgd(*train_args(synth, run, "train.epochs=1"), check=False)
            assert proc.returncode == 2 and proc.stderr.startswith(
                f"hpcsgd train: rank 0: error: train.run_dir {run}: {cause}"), proc.stderr
            assert len(proc.stderr.splitlines()) == 1, proc.stderr
    finally:
        os.chmod(locked, 0o755)


def test_a_read_only_file_system_is_named(tmp_path, monkeypatch):
    """make_run_dir on the errors of a read-only file system (what a chmod cannot show to root)."""
    import errno

    from hpcsgd.metrics import make_run_dir

    def read_only(path, *args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path))

    run = str(tmp_path / "run")
    monkeypatch.setattr(os, "makedirs", read_only)
    assert make_run_dir(run) == (f"train.run_dir {run}: cannot create it: Read-only file "
                                 f"system ({tmp_path}); name a directory this job can write")
    monkeypatch.undo()
    os.makedirs(run)
    monkeypatch.setattr("builtins.open", read_only)
    assert make_run_dir(run).startswith(f"train.run_dir {run}: cannot write in it: Read-only")


def test_an_error_is_in_the_rank_log_too(synth, tmp_path):
    run = str(tmp_path / "run")
    proc = hpcsgd(*train_args(synth, run, "optim.lr=10", "model.activation=relu",
                              "model.hidden=[256, 256]", "optim.momentum_tc=0"), check=False)
    assert proc.returncode == 2
    assert "hpcsgd train: rank 0: error:" in proc.stderr
    assert "error:" in open(os.path.join(run, "logs", "rank0000.log")).read()
