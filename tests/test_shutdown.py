"""Ending a run early, for real under mpiexec: a stop signal on any rank checkpoints all ranks
at one step and exits 75 (resuming ends bit-identical to an uninterrupted run); a stopped or
killed rank ends the job within a bound, naming the rank, with the last checkpoint intact."""
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import MPIEXEC, REPO, make_archive, run_mpi
from hpcsgd import checkpoint
from hpcsgd.shutdown import EXIT_INTERRUPTED, EXIT_REQUEUE, EXIT_WATCHDOG

ENV = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONUNBUFFERED="1",
           OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
TRAIN = [sys.executable, "-m", "mpi4py", "-m", "hpcsgd.cli", "train"]


def train_args(archive_dir, run_dir, *extra):
    # ~20 epochs of a small model: several seconds, so a signal lands mid-run
    return [f"data.train={archive_dir}", f"train.run_dir={run_dir}", "data.context=2",
            "model.hidden=[64, 64]", "train.minibatch=64", "train.epochs=16",
            "data.block_frames=500", "data.buffer_frames=1500", "train.log_every_frames=1000",
            "train.checkpoint_every_frames=20000", "optim.lr=0.01", *extra]


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("synth"))
    make_archive(out, num_shards=2, utts_per_shard=40)
    return out


@pytest.fixture(scope="module")
def uninterrupted(archive, tmp_path_factory):
    run = str(tmp_path_factory.mktemp("full"))
    proc = run_mpi(2, TRAIN[1:] + train_args(archive, run), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return checkpoint.load(checkpoint.latest(run))[0]["params"]


def start(num_ranks, archive, run, *extra):
    cmd = [MPIEXEC, "-n", str(num_ranks)] if num_ranks else []
    return subprocess.Popen(cmd + (TRAIN if num_ranks else TRAIN[:1] + TRAIN[3:])
                            + train_args(archive, run, *extra), cwd=REPO, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_training(run, rank, proc, timeout=120, checkpointed=False):
    """The pid of `rank` once the training loop has logged progress (handlers installed)
    and, if asked, written a checkpoint."""
    log = os.path.join(run, "logs", f"rank{rank:04d}.log")
    rank0 = os.path.join(run, "logs", "rank0000.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0]
        try:
            pid = re.search(r"pid (\d+) on", open(log).read())
            if pid and "frames/s" in open(rank0).read() \
                    and (not checkpointed or checkpoint.latest(run)):
                return int(pid.group(1))
        except FileNotFoundError:
            pass
        time.sleep(0.05)
    pytest.fail(f"no training progress in {run} after {timeout} s")


def finish(proc, timeout):
    """Exit code and output; a hang becomes a failure (and the job's processes are killed)."""
    try:
        out = proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out = proc.communicate()[0]
        pytest.fail(f"job still running {timeout} s after the event:\n{out}")
    return proc.returncode, out


@pytest.mark.parametrize("target,signame", [("rank 1", "SIGUSR1"), ("mpiexec", "SIGTERM")])
def test_signal_checkpoints_all_ranks_and_the_resumed_run_is_bit_identical(
        archive, uninterrupted, tmp_path, target, signame):
    run = str(tmp_path / "run")
    proc = start(2, archive, run)
    pid = wait_for_training(run, 1, proc)
    os.kill(pid if target == "rank 1" else proc.pid, getattr(signal, signame))
    code, out = finish(proc, 60)
    assert code == EXIT_REQUEUE, out
    assert "MPI_Abort" not in out   # a clean exit 75 (srun would report an abort as killed tasks)
    logs = [open(os.path.join(run, "logs", f"rank{r:04d}.log")).read() for r in (0, 1)]
    stops = [re.search(r"stopping on .* at step (\d+), frame ([\d,]+): checkpoint (\S+);", t)
             for t in logs]
    assert all(stops), logs
    assert stops[0].groups() == stops[1].groups()   # both ranks stopped at the same step
    assert f"stopping on {signame}" in logs[1]
    path = stops[0].group(3)
    assert checkpoint.latest(run) == path
    stopped = checkpoint.load(path)[0]["params"]
    assert not np.array_equal(stopped, uninterrupted)   # it really stopped early

    # the requeued job: the same command, resume=auto
    proc = start(2, archive, run)
    code, out = finish(proc, 300)
    assert code == 0, out
    assert "resumed from " + path in open(os.path.join(run, "logs", "rank0000.log")).read()
    np.testing.assert_array_equal(checkpoint.load(checkpoint.latest(run))[0]["params"],
                                  uninterrupted)


def test_single_process_run_stops_on_sigterm(archive, tmp_path):
    run = str(tmp_path / "run")
    proc = start(0, archive, run)
    os.kill(wait_for_training(run, 0, proc), signal.SIGTERM)
    code, out = finish(proc, 60)
    assert code == EXIT_REQUEUE, out
    assert "stopping on SIGTERM" in out
    assert checkpoint.load(checkpoint.latest(run))[1]["frames"] > 0


def test_stopped_rank_is_named_and_the_job_ends_within_the_watchdog_bound(archive, tmp_path):
    """SIGSTOP: the rank is alive to the launcher but makes no progress, so only the watchdog
    can end the job (the case a launcher's own death detection cannot see). With 3 ranks the
    aborting rank names the stopped one first ("not running") and the other survivor as
    "blocked"."""
    run, timeout = str(tmp_path / "run"), 4
    proc = start(3, archive, run, f"train.watchdog_s={timeout}")
    pid = wait_for_training(run, 1, proc, checkpointed=True)
    before = set(os.listdir(checkpoint.checkpoint_dir(run)))
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        code, out = finish(proc, timeout + 30)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    elapsed = time.monotonic() - t0
    assert code == EXIT_WATCHDOG, out
    assert elapsed < timeout + 10, elapsed
    assert re.search(r"rank [02]: no progress for \d+ s in step \d+ [^:]*: rank 1 not running "
                     rf"for \d+ s \(pid {pid} on [^;]*; rank [02] blocked for \d+ s", out), out
    # the checkpoints written before are intact (no half-written file became 'latest')
    path = checkpoint.latest(run)
    assert os.path.basename(path) in before | set(os.listdir(checkpoint.checkpoint_dir(run)))
    assert checkpoint.load(path)[1]["frames"] > 0
    assert not [f for f in os.listdir(checkpoint.checkpoint_dir(run)) if f.endswith(".tmp")]


def test_killed_rank_ends_the_job_at_once(archive, tmp_path):
    run = str(tmp_path / "run")
    proc = start(2, archive, run)
    pid = wait_for_training(run, 1, proc, checkpointed=True)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    code, out = finish(proc, 30)
    assert code != 0 and time.monotonic() - t0 < 10
    # hydra names the dead process, or (when the surviving rank's MPI call fails first and it
    # aborts the job) that rank does, from the peer's heartbeat file. The third way it ends:
    # the survivor was reading the dead peer's memory (MPICH's CMA single copy), which MPICH
    # treats as fatal inside the call, before any error handler of ours runs; its message is
    # the peer's "no such process" (errno 3), without a rank.
    assert f"PID {pid}" in out or "process_vm_readv failed (errno 3)" in out, out
    assert checkpoint.load(checkpoint.latest(run))[1]["frames"] > 0
    # heartbeats are rewritten in place: a killed job leaves no temporary file behind
    assert not [f for f in os.listdir(os.path.join(run, "logs")) if ".tmp" in f]


def test_a_peer_whose_process_is_gone_is_named_from_its_heartbeat(tmp_path):
    """What the surviving rank says when its MPI call fails: the peers on this host whose
    pid no longer exists (a live peer, another host's peer or a missing file: not named)."""
    import socket
    from hpcsgd.shutdown import HEARTBEAT_BYTES, gone_peers
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # killed but not yet reaped by its launcher: a zombie, which signal 0 still reaches
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{zombie.pid}/stat") and time.monotonic() < deadline \
            and open(f"/proc/{zombie.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    host = socket.gethostname()
    for r, pid, h in ((1, dead.pid, host), (2, os.getpid(), host), (3, dead.pid, "elsewhere"),
                      (4, zombie.pid, host)):
        line = f"1.0 1.0 {pid} {h} training step 3".ljust(HEARTBEAT_BYTES - 1) + "\n"
        (tmp_path / f"rank{r:04d}.heartbeat").write_text(line)
    try:
        assert gone_peers(str(tmp_path), 0, 5) == [f"rank 1 (PID {dead.pid} on {host})",
                                                   f"rank 4 (PID {zombie.pid} on {host})"]
    finally:
        zombie.wait()
    assert gone_peers(str(tmp_path), 1, 2) == []   # itself is never a peer


def test_ctrl_c_checkpoints_every_rank_and_stops_without_a_traceback(archive, tmp_path):
    """Ctrl-C in a terminal signals the whole foreground process group (mpiexec and every
    rank): all ranks checkpoint at one step and exit 130; no KeyboardInterrupt anywhere."""
    run = str(tmp_path / "run")
    proc = start(2, archive, run)
    wait_for_training(run, 1, proc)
    os.killpg(proc.pid, signal.SIGINT)
    code, out = finish(proc, 60)
    assert code == EXIT_INTERRUPTED, out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    logs = [open(os.path.join(run, "logs", f"rank{r:04d}.log")).read() for r in (0, 1)]
    stops = [re.search(r"stopping on SIGINT at step (\d+), frame ([\d,]+): checkpoint (\S+);", t)
             for t in logs]
    assert all(stops) and stops[0].groups() == stops[1].groups(), logs
    assert checkpoint.latest(run) == stops[0].group(3)
    assert "Ctrl-C again to abort at once" in out


def test_a_second_ctrl_c_ends_the_process_at_once():
    """After the first SIGINT the default action is back: the second one ends the process
    (killed by SIGINT), wherever it is, with nothing printed but the first notice."""
    code = """
import os, signal, time
from hpcsgd.shutdown import StopSignal
stop = StopSignal(say=lambda m: print("said:", m, flush=True))
os.kill(os.getpid(), signal.SIGINT)
time.sleep(0.2)
print("code", stop.code, stop.received, signal.getsignal(signal.SIGINT) == signal.SIG_DFL,
      flush=True)
os.kill(os.getpid(), signal.SIGINT)
time.sleep(5)
print("still running", flush=True)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=REPO, env=ENV)
    assert proc.returncode == -signal.SIGINT, proc.stdout + proc.stderr
    assert "said: SIGINT: checkpointing at the next step" in proc.stdout
    assert "code 2 SIGINT True" in proc.stdout and "still running" not in proc.stdout
    assert "Traceback" not in proc.stderr
