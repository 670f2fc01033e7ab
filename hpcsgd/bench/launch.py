"""Running a benchmark's rank side under MPI, the same way for every MPI benchmark:

    mpiexec [emulated-cluster options] -n K python -m MODULE ARGS --json OUT

with the venv's MPICH (the mpiexec beside this Python). Threads per rank follow the trainer's
rule (hpcsgd/threads.py: --threads, OMP_NUM_THREADS, SLURM_CPUS_PER_TASK, else this
process's cores // K), set in every thread variable of the ranks; with more ranks than cores
MPIR_CVAR_ENABLE_HEAVY_YIELD=1, because a waiting MPICH rank busy-polls a core otherwise.
Inside an emulated cluster (hpcsgd/bench/emucluster.py: cluster() sets EMUCLUSTER_MPIEXEC_ARGS)
the command gets the hydra options that put rank i in network namespace i, so every MPI
benchmark runs across the emulated link unchanged. Rank 0 of MODULE writes OUT
(write_result); the parent reads it back.
"""
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile

from hpcsgd import threads

MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


class LaunchError(RuntimeError):
    pass


def cores():
    """The cores this process may run on (its affinity mask), which the ranks share."""
    return len(threads.affinity())


def threads_per_rank(k):
    """The trainer's rule (hpcsgd/threads.py) for k ranks sharing these cores."""
    return threads.plan(threads.affinity(), k)[0]


def link_gbps():
    """The emulated link rate in Gbit/s when running inside bench --emulate, else None."""
    rate = os.environ.get("EMUCLUSTER_GBPS")
    return float(rate) if rate else None


def run_group(cmd, env=None, timeout=None):
    """Run cmd in its own process group; on a timeout or an exception (a signal turned into
    one) end that group only -- mpiexec and everything it started -- then re-raise."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise


def mpirun(k, module, args, timeout=1800, n_threads=None, per_host=1):
    """`mpiexec -n k python -m module args --json OUT` -> the dict rank 0 wrote to OUT.
    per_host: on an emulated cluster, consecutive ranks per host (a model group's M: its
    traffic stays inside a host, the data-parallel exchange crosses the links)."""
    t = str(n_threads or threads_per_rank(k))
    env = dict(os.environ, PYTHONUNBUFFERED="1", **threads.environment(int(t)))
    if k > cores():
        env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
    extra = shlex.split(os.environ.get("EMUCLUSTER_MPIEXEC_ARGS", ""))
    if "-ppn" in extra:
        extra[extra.index("-ppn") + 1] = str(per_host)
    with tempfile.TemporaryDirectory(prefix="hpcsgd-bench-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = [MPIEXEC, *extra, "-n", str(k), sys.executable, "-m", module, *map(str, args),
               "--json", out]
        try:
            rc = run_group(cmd, env, timeout)
        except subprocess.TimeoutExpired:
            raise LaunchError(f"mpiexec -n {k} {module}: no result after {timeout} s") from None
        if rc != 0:
            raise LaunchError(f"mpiexec -n {k} {module} failed (exit {rc})")
        with open(out) as f:
            result = json.load(f)
    result["threads_per_rank"] = int(t)
    return result


def write_result(comm, result, path):
    """Rank 0 writes the rank side's result (the parent's mpirun reads it)."""
    if comm.Get_rank() == 0:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
