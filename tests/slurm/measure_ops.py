#!/usr/bin/env python
"""Measure how long operations take on a real (one-node) Slurm: signal -> checkpoint on disk ->
requeued -> resumed, and dead or hung rank -> job end. Root only (bin/slurm-cluster).

    .venv/bin/python tests/slurm/measure_ops.py [--reps 3] [--json out.json]

Starts its own cluster in a temporary directory (torn down at the end, also on errors), prepares
the bundled FSDD digits with jobs/prep.sbatch, then submits jobs/train.sbatch with
jobs/configs/fsdd_tiny.yaml (3 MPICH ranks, 2 Open MPI ranks on this 2-core machine) and times,
from the moment the signal is sent:
  * stop: `scancel --signal=USR1 --batch` -> the stop checkpoint's mtime, the job leaving RUNNING
    (requeued), running again, and rank 0 logging "resumed from";
  * kill: `kill -9` of rank 1 -> the job ends (srun with RANK_EXIT_WAIT_S 5 and the default 30;
    hydra's mpiexec; Open MPI's srun path); hang: `kill -STOP` of rank 1 -> the job ends by the
    trainer's watchdog (train.watchdog_s=5).
Docs: docs/benchmarks.md ("Operations"), docs/cluster.md.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tests"))
import test_slurm as T  # noqa: E402  (the tests' helpers: one way to drive the cluster)


def poll(cond, timeout, step=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(step)
    raise TimeoutError


def log_has(path, pattern):
    return os.path.exists(path) and re.search(pattern, open(path).read())


def stop_case(cluster, archive, family, name, **knobs):
    K = T.ranks_for(family)
    job, run = T.submit_train(cluster, family, name, archive, K, "train.epochs=100", **knobs)
    rank0 = os.path.join(run, "logs", "rank0000.log")
    poll(lambda: log_has(rank0, r"epoch 2 done"), 180)
    t0 = time.time()
    cluster.run("scancel", "--signal=USR1", "--batch", job)
    m = poll(lambda: log_has(rank0, r"stopping on SIGUSR1 .*: checkpoint (\S+);"), 60)
    ckpt = os.path.getmtime(m.group(1)) - t0
    poll(lambda: cluster.job(job).get("JobState") != "RUNNING", 60, 0.02)
    left = time.time() - t0
    poll(lambda: cluster.job(job).get("JobState") == "RUNNING", 120, 0.02)
    again = time.time() - t0
    poll(lambda: log_has(rank0, r"resumed from"), 120)
    resumed = time.time() - t0
    cluster.run("scancel", job)
    cluster.wait(job)
    return {"checkpoint_on_disk_s": ckpt, "job_left_running_s": left,
            "running_again_s": again, "resumed_s": resumed}


def end_case(cluster, archive, family, name, how, **knobs):
    K = T.ranks_for(family)
    watchdog = "train.watchdog_s=5" if how == "stop" else "train.watchdog_s=0"
    job, run = T.submit_train(cluster, family, name, archive, K, "train.epochs=400", watchdog,
                              **knobs)
    poll(lambda: log_has(os.path.join(run, "logs", "rank0000.log"), r"epoch 2 done"), 180)
    victim = T.rank_pid(run, 1)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        poll(lambda: cluster.job(job).get("JobState") in T.DONE, 120, 0.02)
        return {"job_end_s": time.monotonic() - t0}
    finally:
        try:
            os.kill(victim, signal.SIGKILL)
        except ProcessLookupError:
            pass
        cluster.run("scancel", job)


CASES = [
    ("stop  MPICH  srun --mpi=pmi2, 3 ranks", "stop", "mpich", {}),
    ("stop  MPICH  mpiexec (hydra), 3 ranks", "stop", "mpich", {"LAUNCHER": "mpiexec"}),
    ("stop  OpenMPI srun --mpi=pmix, 2 ranks", "stop", "openmpi", {}),
    ("kill  MPICH  srun, RANK_EXIT_WAIT_S=30 (default)", "kill", "mpich", {}),
    ("kill  MPICH  srun, RANK_EXIT_WAIT_S=5", "kill", "mpich", {"RANK_EXIT_WAIT_S": "5"}),
    ("kill  MPICH  mpiexec (hydra)", "kill", "mpich", {"LAUNCHER": "mpiexec"}),
    ("kill  OpenMPI srun, RANK_EXIT_WAIT_S=5", "kill", "openmpi", {"RANK_EXIT_WAIT_S": "5"}),
    ("kill  OpenMPI mpiexec", "kill", "openmpi", {"LAUNCHER": "mpiexec"}),
    ("hang  MPICH  srun, watchdog_s=5 (SIGSTOP)", "hang", "mpich", {}),
    ("hang  MPICH  mpiexec, watchdog_s=5 (SIGSTOP)", "hang", "mpich", {"LAUNCHER": "mpiexec"}),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write all samples here")
    args = ap.parse_args()
    why = T.slurm_unavailable() or T.ensure_openmpi()
    if why:
        sys.exit(f"measure_ops: {why}")
    root = tempfile.mkdtemp(prefix="hpcsgd-slurm-")
    results = {}
    try:
        subprocess.run([T.SLURM_CLUSTER, "start", root, "4"], check=True, env=T.clean_env(),
                       stdout=subprocess.DEVNULL)
        cluster = T.Cluster(root)
        out = os.path.join(cluster.work, "feats")
        env = cluster.env(DATA=T.FSDD, ALI=os.path.join(T.FSDD, "phn"), OUT=out, NUM_SHARDS="2",
                          SAMPLE_RATE="8000", LABELS=os.path.join(T.FSDD, "labels.txt"))
        proc = cluster.run("bash", T.PREP_SBATCH, env=env, cwd=cluster.work)
        cluster.wait(re.search(r"Submitted batch job (\d+)", proc.stdout).group(1))
        archive = out
        for i, (label, kind, family, knobs) in enumerate(CASES):
            samples = []
            for r in range(args.reps):
                name = f"m{i}-{r}"
                if kind == "stop":
                    samples.append(stop_case(cluster, archive, family, name, **knobs))
                else:
                    how = "kill" if kind == "kill" else "stop"
                    samples.append(end_case(cluster, archive, family, name, how, **knobs))
                print(f"{label}: {samples[-1]}", flush=True)
            results[label] = samples
    finally:
        subprocess.run([T.SLURM_CLUSTER, "stop", root], env=T.clean_env(),
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'case':50s} {'measure':22s} median   min    max   (s, {args.reps} runs)")
    for label, samples in results.items():
        for key in samples[0]:
            v = [s[key] for s in samples]
            print(f"{label:50s} {key:22s} {statistics.median(v):6.2f} {min(v):6.2f} {max(v):6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
