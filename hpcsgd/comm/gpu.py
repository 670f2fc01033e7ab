"""GPU ranks' plumbing: which GPU a rank drives, whether the MPI library takes device buffers
(CUDA-aware MPI), how a device buffer goes through MPI either way, and NCCL for the float
allreduce.

    device_id, _ = bind_gpu(grid.node_rank)     # local rank -> GPU, once, before any allocation
    aware, why = mpi_cuda_aware("auto")         # ask the MPI library (or the config / env)
    stage = Staging(shape, dtype, "cuda", aware)  # what MPI gets for a device array
    comm.Allreduce(MPI.IN_PLACE, stage.to_mpi(dev_array)); stage.from_mpi(dev_array)
    nccl = Nccl(comm)                           # float allreduce on the device, async on a stream

CUDA-aware detection, in this order: the config key exchange.mpi_cuda_aware (true/false), the
environment variable HPCSGD_MPI_CUDA_AWARE=0/1, then the library itself: MPICH >= 4's
`MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)`, else Open MPI's / MVAPICH2's
`MPIX_Query_cuda_support()`, found by ctypes in the libmpi this process loaded. A library
with neither is taken as not CUDA-aware (the safe choice: staging always works).

MPI does not follow CUDA streams: every buffer handed to MPI is synchronised first (a device
sync point), whether MPI reads the device memory itself or a staged host copy of it.
"""
import ctypes
import os

import numpy as np

from hpcsgd.device import cupy_module, synchronize

MPIX_GPU_SUPPORT_CUDA = 0   # mpi.h of MPICH 4.x / 5.x
ENV_CUDA_AWARE = "HPCSGD_MPI_CUDA_AWARE"
BOUND = None                # (device index, GPUs visible) once bind_gpu has run


def bind_gpu(node_rank):
    """Select this rank's GPU: its rank on the node (Grid.node_rank) modulo the GPUs it can see
    (a scheduler that gives each task its own GPU through CUDA_VISIBLE_DEVICES leaves one
    visible: index 0). Returns (device index, GPUs visible). Call once, before any device
    allocation. More ranks than GPUs share them (fine for correctness runs)."""
    from numba import cuda
    visible = len(cuda.gpus)
    if not visible:
        raise RuntimeError("train.device=cuda: no CUDA GPU is visible to this rank")
    index = node_rank % visible
    cuda.select_device(index)
    quiet_small_grids()
    global BOUND
    BOUND = (index, visible)
    return index, visible


def quiet_small_grids():
    """numba-cuda warns (NumbaPerformanceWarning "Grid size N will likely result in GPU
    under-utilization") at each launch site of fewer than 128 blocks, into every training log.
    The element-wise launches are sized to fill the GPU where the array allows
    (device.one_thread_each, model.kernels_cuda._elem_launch); what stays small is small
    work -- a bias's one codec column, the column sums of a 40-label layer, a tiny model's
    every kernel -- which no launch shape fills: its cost is the launch itself, counted by
    `bench train --device cuda` (launches under 2 blocks per SM, hpcsgd/census.py). So the
    warning is turned off here, on GPU ranks, for that message only."""
    import warnings

    from numba.core.errors import NumbaPerformanceWarning
    warnings.filterwarnings("ignore", message="Grid size", category=NumbaPerformanceWarning)


def shared_gpus(comm):
    """Which ranks of comm drive the same GPU as another (more local ranks than visible
    GPUs: a workstation, the tests). -> "" when none, else e.g. "ranks 0, 1 share GPU 0 on
    node1". Collective over comm (an allgather of a host name and an index)."""
    from mpi4py import MPI
    index = BOUND[0] if BOUND is not None else 0
    # CUDA_VISIBLE_DEVICES renumbers per process: a scheduler's one GPU per task is index 0 in
    # every task, so the physical GPU is the visible list's entry, where the list is given
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    physical = visible.split(",")[index] if visible else str(index)
    where = comm.allgather((MPI.Get_processor_name(), physical))   # small metadata
    groups = {}
    for rank, key in enumerate(where):
        groups.setdefault(key, []).append(rank)
    shared = [(key, ranks) for key, ranks in groups.items() if len(ranks) > 1]
    return "; ".join(f"ranks {', '.join(map(str, ranks))} share GPU {gpu} on {host}"
                     for (host, gpu), ranks in shared)


def _loaded_libmpi():
    """The MPI library mpi4py loaded into this process, opened again by ctypes (the same
    handle; /proc/self/maps names its file), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f
                            if "/libmpi" in line and ".so" in line and "abi" not in line})
    except OSError:
        paths = []
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def mpi_cuda_aware(setting="auto", env=""):
    """(True/False, how it was decided) for this process's MPI library: the config key's
    setting, else the value of the environment variable ENV_CUDA_AWARE (`env`, which the
    caller reads: make_exchange passes os.environ's), else the library. MPI must be
    initialised (the query functions need it)."""
    if setting in ("true", "false"):
        return setting == "true", f"exchange.mpi_cuda_aware={setting}"
    if env in ("0", "1"):
        return env == "1", f"{ENV_CUDA_AWARE}={env}"
    if env:
        raise ValueError(f"{ENV_CUDA_AWARE}={env!r}: expected 0 or 1")
    lib = _loaded_libmpi()
    if lib is None:
        return False, "libmpi not found in this process: staging through host memory"
    if hasattr(lib, "MPIX_GPU_query_support"):          # MPICH >= 4 (also exports the next)
        query = lib.MPIX_GPU_query_support
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        flag = ctypes.c_int(0)
        ok = query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0 and flag.value == 1
        return ok, f"MPIX_GPU_query_support(CUDA) = {flag.value}"
    if hasattr(lib, "MPIX_Query_cuda_support"):         # Open MPI, MVAPICH2
        value = lib.MPIX_Query_cuda_support()
        return value == 1, f"MPIX_Query_cuda_support() = {value}"
    return False, "the MPI library has no CUDA query: staging through host memory"


class Staging:
    """How device buffers go through MPI. Host arrays, or device arrays with a CUDA-aware MPI:
    MPI gets the array itself. Device arrays otherwise: a pinned host mirror of the same
    layout, copied before a send (to_mpi) and after a receive (from_mpi); ranges [lo, hi)
    copy only what MPI reads or wrote. Pinned memory makes those copies DMA at the bus's
    rate. One Staging serves every array of its shape (one exchange in flight)."""

    def __init__(self, shape, dtype, device, cuda_aware):
        self.device = device
        self.staged = device == "cuda" and not cuda_aware
        self.host = None
        if self.staged:
            from numba import cuda
            self.host = cuda.pinned_array(shape, dtype)

    def mpi(self, array):
        """The buffer MPI reads and writes for `array`."""
        return self.host if self.staged else array

    def to_mpi(self, array, lo=0, hi=None):
        """The device's writes to array[lo:hi] are complete and visible to MPI (a device sync
        point); returns mpi(array)."""
        synchronize(self.device)
        if self.staged:
            array[lo:hi].copy_to_host(self.host[lo:hi])
        return self.mpi(array)

    def from_mpi(self, array, lo=0, hi=None):
        """MPI's writes to [lo, hi) reach the device array (staged: a host -> device copy)."""
        if self.staged:
            array[lo:hi].copy_to_device(self.host[lo:hi])

    def describe(self, why):
        if self.device == "cpu":
            return "MPI on host buffers"
        return (f"MPI through pinned host buffers ({why})" if self.staged
                else f"CUDA-aware MPI on device buffers ({why})")


def nccl_available():
    """(True, version) when CuPy's NCCL binding loads, else (False, why)."""
    try:
        from cupy.cuda import nccl
        return True, f"NCCL {nccl.get_version()}"
    except Exception as err:   # ImportError, or a CUDA/NCCL library that fails to load
        return False, f"{type(err).__name__}: {err}"


class Nccl:
    """An NCCL communicator over the ranks of comm (the unique id from rank 0 by an MPI
    broadcast), summing device buffers on its own non-blocking stream, so that a double-
    buffered exchange really runs while the default stream computes the next half."""
    DTYPES = {np.dtype(np.float32): "NCCL_FLOAT32", np.dtype(np.float16): "NCCL_FLOAT16"}

    def __init__(self, comm):
        cupy = cupy_module()
        from cupy.cuda import nccl
        self._nccl, self._cupy = nccl, cupy
        uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)     # lowercase: a small tuple, once
        self.comm = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self._ready = cupy.cuda.Event(disable_timing=True)
        self._done = cupy.cuda.Event(disable_timing=True)

    def start_sum(self, array):
        """Begin an in-place sum of a device array over the ranks: the NCCL stream waits for
        the default stream's work so far (the gradient), then runs the allreduce."""
        cp = self._cupy
        self._ready.record(cp.cuda.Stream.null)
        self.stream.wait_event(self._ready)
        ptr = array.__cuda_array_interface__["data"][0]
        self.comm.allReduce(ptr, ptr, array.size, getattr(self._nccl, self.DTYPES[array.dtype]),
                            self._nccl.NCCL_SUM, self.stream.ptr)
        self._done.record(self.stream)

    def wait_sum(self):
        """Complete it: the host waits for the NCCL stream (a sync point; the sum is then
        readable by work on any stream)."""
        self._done.synchronize()
