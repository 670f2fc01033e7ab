"""What a GPU rank asks of its host, counted: kernel launches (and how many of them leave an
H100 unfilled), host synchronisations, device allocations, host<->device copies and bytes.

A GPU step is fast when the host only queues work: every copy to the host waits for the
device (a synchronisation), every `cuda.to_device` allocates (cudaMalloc synchronises too) and
copies, every launch costs the host microseconds. These are the figures a CPU can count and a
GPU confirms (issue 44): `bench train --device cuda` prints them per step, and the tests hold
the step to them in Numba's simulator, whose device arrays and launches go through the same
entry points as a GPU's.

    census.install()        # once: wraps Numba's entry points (real GPU or simulator)
    before = census.snapshot()
    ... steps ...
    per_step = census.since(before, steps)

Counted at the outermost call only (the simulator's to_device calls copy_to_device inside).
cuBLAS GEMMs through CuPy are counted by hpcsgd.device.matmul (note_launch); NCCL's calls and
CuPy's own element-wise kernels (the NCCL allreduce's casts) are not counted.
"""
import contextlib
import threading

# An H100 has 132 SMs; a launch of fewer than 2 blocks per SM leaves it partly idle (numba-cuda
# warns below 128 blocks: NumbaPerformanceWarning "Grid size N will likely result in GPU
# under-utilization")
FILL_BLOCKS = 2 * 132
FIELDS = ("launches", "small_launches", "syncs", "allocations", "h2d_copies", "h2d_bytes",
          "d2h_copies", "d2h_bytes")

COUNTS = dict.fromkeys(FIELDS, 0)
SMALL = {}        # kernel name -> launches of fewer than FILL_BLOCKS blocks
CAPTURING = False  # a CUDA Graph capture is on (hpcsgd/graphs.py): no copy, allocation, sync
_depth = threading.local()
_installed = False
_quiet = [0]


def snapshot():
    return dict(COUNTS)


def since(before, steps=1):
    """Counts since `before` (a snapshot), per step."""
    return {k: (COUNTS[k] - before[k]) / steps for k in FIELDS}


@contextlib.contextmanager
def quiet():
    """Nothing counted inside (a simulated graph's replay: the graph launch is counted)."""
    _quiet[0] += 1
    try:
        yield
    finally:
        _quiet[0] -= 1


def _capturing(what):
    if CAPTURING:
        raise RuntimeError(f"{what} inside a CUDA Graph capture: it would run once, at the "
                           f"capture, not at each launch (hpcsgd/graphs.py)")


def note_launch(name, blocks):
    if _quiet[0]:
        return
    COUNTS["launches"] += 1
    if blocks < FILL_BLOCKS:
        COUNTS["small_launches"] += 1
        SMALL[name] = SMALL.get(name, 0) + 1


def _outer(fn, count):
    """fn wrapped: count(*args) first, when no counted call is already running here."""
    def wrapped(*args, **kwargs):
        if getattr(_depth, "n", 0) == 0:
            count(*args, **kwargs)
        _depth.n = getattr(_depth, "n", 0) + 1
        try:
            return fn(*args, **kwargs)
        finally:
            _depth.n -= 1
    wrapped.__wrapped__ = fn
    return wrapped


def _nbytes(a):
    return int(getattr(a, "nbytes", 0) or getattr(a, "size", 0) * getattr(a.dtype, "itemsize", 0))


def _to_host(self, ary=None, stream=0):
    _capturing("a copy to the host")
    if _quiet[0]:
        return
    COUNTS["syncs"] += 1          # Numba's copy to the host waits for the device
    COUNTS["d2h_copies"] += 1
    COUNTS["d2h_bytes"] += _nbytes(self)


def _to_device(self, ary, stream=0):
    if hasattr(ary, "copy_to_host") or hasattr(ary, "__cuda_array_interface__"):
        # device to device: queued, no host; but on the legacy stream, which a capture on
        # another stream cannot contain
        _capturing("a device-to-device copy (Numba queues it on the legacy stream)")
        return
    _capturing("a copy to the device")
    if _quiet[0]:
        return
    COUNTS["h2d_copies"] += 1
    COUNTS["h2d_bytes"] += _nbytes(ary)


def _new_device(obj, *args, **kwargs):
    _capturing("an allocation and copy to the device (cuda.to_device)")
    if _quiet[0]:
        return
    COUNTS["allocations"] += 1
    if "to" not in kwargs or kwargs["to"] is None:
        COUNTS["h2d_copies"] += 1
        COUNTS["h2d_bytes"] += _nbytes(obj) if hasattr(obj, "dtype") else 0


def _allocation(*args, **kwargs):
    _capturing("a device allocation")
    if not _quiet[0]:
        COUNTS["allocations"] += 1


def _sync(*args, **kwargs):
    _capturing("a device synchronisation")
    if not _quiet[0]:
        COUNTS["syncs"] += 1


def install():
    """Wrap Numba's launch, copy, allocation and synchronisation entry points (idempotent)."""
    global _installed
    if _installed:
        return
    from hpcsgd.lazy_cuda import load
    real = load()
    if real.config.ENABLE_CUDASIM:
        from numba.cuda.simulator import kernel as sim
        from numba.cuda.simulator.cudadrv import devicearray as arrays
        array_class = arrays.FakeCUDAArray
        launch = sim.FakeCUDAKernel.__call__

        def simulated_launch(self, *args):
            if not self._device and not sim._kernel_context:
                g = self.grid_dim
                note_launch(self.fn.__name__, g[0] * g[1] * g[2])
            return launch(self, *args)
        sim.FakeCUDAKernel.__call__ = simulated_launch
    else:
        from numba.cuda import dispatcher
        from numba.cuda.cudadrv import devicearray as arrays
        array_class = arrays.DeviceNDArrayBase
        configured = dispatcher._LaunchConfiguration.__call__

        def launch(self, *args):
            g = self.griddim
            note_launch(self.dispatcher.py_func.__name__, g[0] * g[1] * g[2])
            return configured(self, *args)
        dispatcher._LaunchConfiguration.__call__ = launch
    array_class.copy_to_host = _outer(array_class.copy_to_host, _to_host)
    array_class.copy_to_device = _outer(array_class.copy_to_device, _to_device)
    real.to_device = _outer(real.to_device, _new_device)
    for name in ("device_array", "device_array_like"):
        setattr(real, name, _outer(getattr(real, name), _allocation))
    real.synchronize = _outer(real.synchronize, _sync)
    _installed = True
