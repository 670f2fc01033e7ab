"""numba.cuda, imported when a GPU path first needs it.

Importing numba.cuda takes about 0.4 s, a third of a small CPU run's start, in every rank and
every CLI command, and CPU ranks never launch a CUDA kernel. So the kernel modules write

    from hpcsgd.lazy_cuda import cuda

and decorate as usual (`@cuda.jit`, `cuda.jit(device=True)(f)`): until numba.cuda is loaded the
decorators only record the function. The first use of any recorded kernel or of any other
`cuda.X` loads it (`load()`), makes every recorded function's real dispatcher, and rebinds, in
every loaded module, the `cuda` name to numba.cuda and each recorded function to its
dispatcher: Numba, compiling a kernel, must find real objects among its globals (a kernel
calls device functions and `cuda.grid` through them). After that the decorators are numba's.

Under Numba's CUDA simulator (NUMBA_ENABLE_CUDASIM=1: the tests, `bench cuda`'s recording),
load() also makes the simulator faster and fixes a race in it (below).
"""
import os
import sys
import threading

_made = []      # every _Deferred made before load(), in order
_real = None    # numba.cuda once loaded


class _Deferred:
    """A function given to cuda.jit before numba.cuda was loaded; stands in for its dispatcher
    (launch `k[grid, block](...)`, attributes) until load() rebinds the names that hold it."""

    def __init__(self, make):
        self._make_with, self._dispatcher = make, None
        _made.append(self)

    def _make(self, real):
        if self._dispatcher is None:
            self._dispatcher = self._make_with(real)
        return self._dispatcher

    def __getitem__(self, config):
        load()
        return self._dispatcher[config]

    def __call__(self, *args, **kwargs):
        load()
        return self._dispatcher(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        load()
        return getattr(self._dispatcher, name)


class _Cuda:
    """Stands in for the numba.cuda module until load()."""

    def jit(self, *args, **kwargs):
        if _real is not None:
            return _real.jit(*args, **kwargs)
        if len(args) == 1 and not kwargs and callable(args[0]):   # @cuda.jit
            fn = args[0]
            return _Deferred(lambda real: real.jit(fn))
        # @cuda.jit(device=True), @cuda.jit(signature, ...): a decorator
        return lambda fn: _Deferred(lambda real: real.jit(*args, **kwargs)(fn))

    def __getattr__(self, name):
        return getattr(load(), name)


cuda = _Cuda()


def device_function(make):
    """A device function whose body depends on the target: make(numba.cuda) returns its
    dispatcher, made when numba.cuda is loaded (now, if it is) and rebound as the kernels are."""
    return make(_real) if _real is not None else _Deferred(make)


def load():
    """numba.cuda, loaded now if it was not, with every deferred kernel made and rebound."""
    global _real
    if _real is None:
        import numba.cuda as real
        _real = real
        if real.config.ENABLE_CUDASIM:
            _hand_over_the_gil_sooner()
            _run_on_one_core()
            _lock_shared_allocation()
        for d in _made:
            d._make(real)
        for module in list(sys.modules.values()):   # the modules that hold deferred names
            names = getattr(module, "__dict__", None)
            if not isinstance(names, dict):
                continue
            for key, value in list(names.items()):
                if type(value) is _Cuda:   # (not `is cuda`: this module's own name is rebound too)
                    names[key] = real
                elif type(value) is _Deferred:
                    names[key] = value._dispatcher
    return _real


# Numba's CUDA simulator runs every CUDA thread of a block as a Python thread, and its block
# manager busy-polls them (is_alive, syncthreads) while holding the GIL. At CPython's default
# 5 ms switch interval each thread waits that long for its turn; 0.2 ms hands it over sooner
# (tests/test_quantize_cuda.py 16.4 -> 6.4 s, test_codecs_cuda.py 24.7 -> 13.3 s, Zen 4). The
# simulator only: a GPU run keeps the default.
SIMULATOR_SWITCH_INTERVAL_S = 2e-4
_shared_lock = threading.Lock()
# A rank's index among the ranks of its node, as the launchers set it (MPICH's Hydra, Open
# MPI, Slurm): simulated ranks of one job then take different cores.
LOCAL_RANK_VARS = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def _hand_over_the_gil_sooner():
    sys.setswitchinterval(min(sys.getswitchinterval(), SIMULATOR_SWITCH_INTERVAL_S))


def _run_on_one_core():
    """Each simulated launch runs on one core of this process's mask (the local rank's, else
    by process id): the launching thread is pinned for the launch, so every thread it starts
    (one per simulated CUDA thread) is too, and its mask is restored afterwards, so the CPU
    work between launches (BLAS, Numba's pool, the references) keeps every core. Spread over
    cores, a block's threads hand the GIL to one another across cores, and when another
    process takes a core (the other test worker, another rank) the thread holding the GIL is
    descheduled while every other waits. Measured on 2 cores (Zen 3) beside two busy
    processes: `bench cuda`'s recording 54-56 -> 12 s, tests/test_model_cuda.py's simulator
    run 128-131 -> 32-42 s; idle, the latter 24 -> 34-38 s
    (experiments/benchmarks_history.md)."""
    from numba.cuda.simulator.kernel import FakeCUDAKernel
    try:
        mask = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not Linux: leave the scheduler alone
        return
    if len(mask) < 2:
        return
    slot = next((int(os.environ[k]) for k in LOCAL_RANK_VARS if os.environ.get(k, "").isdigit()),
                os.getpid())
    core = {mask[slot % len(mask)]}
    original = FakeCUDAKernel.__call__

    def launch(self, *args):
        if self._device:   # a device function called from a kernel: already on the core
            return original(self, *args)
        before = os.sched_getaffinity(0)   # this thread's
        os.sched_setaffinity(0, core)
        try:
            return original(self, *args)
        finally:
            os.sched_setaffinity(0, before)
    FakeCUDAKernel.__call__ = launch


def _lock_shared_allocation():
    """The simulator's `cuda.shared.array` gives every thread of a block the array made for
    its source line, made by the first thread that asks: a get, then a set, without a lock
    (numba-cuda 0.30.4, simulator/kernelapi.py). Two threads that switch in between get two
    arrays, and a block's reduction then loses the other threads' partials. With the GIL
    handed over every 0.2 ms that happened: one clean-clone suite failed a GPU ranks'
    bit-for-bit test, and rerunning each launch of `bench cuda`'s recording gave other bits
    for two kernels in each of two runs (column sums, softmax, 1-bit encode, fake-quant
    backward: kernels with shared memory), for none in five runs with the lock. The key is
    the original's (file, line), from the caller's frame instead of a formatted stack."""
    import numpy as np
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support
    original = FakeCUDAShared.array

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:   # dynamic shared memory, or unsupported
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)
        with _shared_lock:
            made = self._allocations.get(caller)
            if made is None:
                made = self._allocations[caller] = np.empty(shape, dtype)
        return made
    FakeCUDAShared.array = array
