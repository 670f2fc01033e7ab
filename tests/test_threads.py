"""hpcsgd.threads: each rank's BLAS and Numba threads are decided before the pools start --
train.threads, else OMP_NUM_THREADS, else SLURM_CPUS_PER_TASK, else the rank's cores divided
among the ranks sharing them -- and the trainer logs what its pools really use; under a real
mpiexec of 1, 2 and 4 ranks on this machine with nothing set in the environment."""
import os
import re
import subprocess
import sys

import pytest

from conftest import MPIEXEC, REPO, make_archive
from hpcsgd import threads

VARS = threads.VARIABLES + ("MPIR_CVAR_ENABLE_HEAVY_YIELD", "SLURM_JOB_ID", "SLURM_CPUS_PER_TASK")


def test_the_decision_follows_its_order():
    mask = set(range(8))
    assert threads.plan(mask, 2, env={}) == (4, "8 core(s) in this rank's affinity mask, "
                                                "shared by 2 ranks on this node", False)
    assert threads.plan(mask, 1, env={})[0] == 8
    assert threads.plan(mask, 3, env={})[0] == 2          # 8 // 3
    assert threads.plan({0, 1}, 4, env={})[::2] == (1, True)   # 4 ranks on 2 cores
    slurm = {"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "3"}
    assert threads.plan(mask, 2, env=slurm)[:2] == (3, "SLURM_CPUS_PER_TASK")
    assert threads.plan(mask, 2, env={"SLURM_CPUS_PER_TASK": "3"})[0] == 4   # not under Slurm
    omp = dict(slurm, OMP_NUM_THREADS="5")
    assert threads.plan(mask, 2, env=omp)[:2] == (5, "OMP_NUM_THREADS in the environment")
    assert threads.plan(mask, 2, override=6, env=omp)[:2] == (6, "train.threads")


@pytest.fixture(scope="module")
def archive(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("threads"))
    make_archive(out, num_shards=2, utts_per_shard=10)
    return out


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_each_rank_runs_the_threads_it_should_under_mpiexec(archive, tmp_path, ranks):
    """Nothing in the environment: cores // ranks each (at least 1), the pools really use it,
    and 4 ranks on fewer cores are warned about."""
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    run = str(tmp_path / "run")
    cmd = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", "hpcsgd.cli",
           "train", f"data.train={archive}", f"train.run_dir={run}", "data.context=2",
           "model.hidden=[16]", "train.minibatch=64", "train.epochs=1",
           "data.block_frames=500", "data.buffer_frames=1500", "train.stop_after_frames=500"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cores = len(os.sched_getaffinity(0))
    want = max(1, cores // ranks)
    for r in range(ranks):
        log = open(os.path.join(run, "logs", f"rank{r:04d}.log")).read()
        line = re.search(r"threads: (\d+) thread\(s\) per rank \(([^;]*)\)(; warning[^;]*)?; "
                         r"Numba (\d+), OpenBLAS (\d+)", log)
        assert line, log
        assert int(line.group(1)) == want and int(line.group(4)) == want, line.group(0)
        assert line.group(5) == str(want), line.group(0)
        assert f"{cores} core(s)" in line.group(2)
        assert ("oversubscribed" in (line.group(3) or "")) == (ranks > cores), line.group(0)


def test_train_threads_overrides_the_environment(archive, tmp_path):
    run = str(tmp_path / "run")
    env = dict(os.environ, OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "hpcsgd.cli", "train", f"data.train={archive}",
           f"train.run_dir={run}", "data.context=2", "model.hidden=[16]", "train.threads=1",
           "data.block_frames=500", "train.stop_after_frames=300"]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "threads: 1 thread(s) per rank (train.threads); Numba 1, OpenBLAS 1" in log, log


def test_with_threads_both_pools_sleep_between_their_work():
    assert threads.environment(2, env={})["OMP_WAIT_POLICY"] == "PASSIVE"
    assert threads.environment(2, env={})["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert "OMP_WAIT_POLICY" not in threads.environment(1, env={})
    mine = threads.environment(2, env={"OMP_WAIT_POLICY": "ACTIVE"})
    assert "OMP_WAIT_POLICY" not in mine and mine["NUMBA_NUM_THREADS"] == "2"


def test_numba_imported_before_the_decision_takes_it_and_compiles_afterwards():
    """A config that names encoder layers imports Numba before the threads are decided (its
    variables then read as the default, the core count); apply() must make Numba re-read
    them before its pool starts, or the first compile after the pool started (a cold cache)
    raises "Cannot set NUMBA_NUM_THREADS to a different value"."""
    code = """
import os, sys
import numba
from numba import njit, prange
from hpcsgd import threads
want = 1 if numba.config.NUMBA_NUM_THREADS > 1 else 2
threads.apply(want)
threads.enforce(want)              # starts the pool, as the trainer does

@njit(parallel=True)               # not cached: compiled here, after the pool started
def total(x):
    s = 0.0
    for i in prange(x.size):
        s += x[i]
    return s

import numpy as np
assert total(np.ones(100)) == 100.0
assert numba.config.NUMBA_NUM_THREADS == want, (numba.config.NUMBA_NUM_THREADS, want)
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k not in VARS}
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr
