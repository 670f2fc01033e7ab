"""CUDA Graphs of a GPU rank's forward and backward pass (`train.cuda_graphs: true`).

A small model's step is dozens of tiny kernels and GEMMs, each a host launch of tens of
microseconds through Numba or CuPy: the host, not the GPU, sets the pace. Captured once per
shape as a CUDA Graph and replayed, the whole forward and backward pass is one launch.

    graphs = Graphs(ops)                       # per model (Network.use_cuda_graphs)
    ce, hits = graphs.run(key, compute, n)     # compute(): the pass, launches only

The first call with a key runs compute() eagerly (it compiles every kernel and sets cuBLAS
up: nothing a capture may do), the second captures it on the compute stream
(device.use_compute_stream: a blocking stream, ordered with the legacy stream where the rest
of the step stays) and launches the graph, later ones launch it. A graph bakes in its kernels'
arguments, so the key holds everything they depend on: the rows n, the loss scale, the
sequence length and the buffers (params, grads). The loss read, a copy to the host, cannot be
in a graph: the model's ops leave the per-row CE and hits on the device during the capture
(CudaOps.defer_loss) and they are read after each launch, the step's one wait.

Not captured, and why: the minibatch's copy to the device (before the launch, into the same
buffers), the overflow check of mixed precision (its vote needs the host), the exchange (MPI
calls between its kernels) and the optimizer's update (its scalars -- learning rate, momentum
per step -- change each step). Not capturable at all: quantization-aware training (its range
statistics come back to the host inside the pass) and double buffering with MPI_Test between
GEMMs (a host call in the pass); those run eagerly, as without this key.

In Numba's CUDA simulator, which has no graphs, a capture records the launches (kernels with
their configurations and arguments, GEMMs) without running them and a launch replays them in
order: the same fixed arguments and pointers a CUDA Graph keeps, so the tests check that the
captured pass equals the eager one bit for bit. During a capture, on either, any copy,
allocation or synchronisation is an error naming it (hpcsgd/census.py): it would have been
run once at capture time, not at each launch.
"""
from hpcsgd import census, device

MOST_GRAPHS = 32   # per model: a few minibatch sizes (the last, shorter one; the probe's)


class Graphs:
    def __init__(self, ops):
        census.install()            # the capture guard and the launch counts
        device.use_compute_stream()
        self.ops = ops              # CudaOps: defers its loss read during a capture
        self.graphs, self.eager = {}, set()

    def run(self, key, compute, n):
        """compute() once eagerly per key, then captured, then replayed; -> (CE sum, hits)."""
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.eager:
                self.eager.add(key)
                return compute()
            if len(self.graphs) >= MOST_GRAPHS:
                self.graphs.pop(next(iter(self.graphs)))   # the oldest
            graph = self.graphs[key] = self._capture(compute)
        graph.launch()
        return self.ops.read_loss(n)

    def _capture(self, compute):
        self.ops.defer_loss = True
        begin()
        try:
            compute()
        except BaseException:
            abandon()
            raise
        finally:
            self.ops.defer_loss = False
        return end()


# ---- the capture itself: CuPy's stream capture on a GPU, a recording in the simulator

def begin():
    census.CAPTURING = True
    if device.simulated():
        _patch_simulator()
        device.RECORDER = []
    else:
        device.capture_stream().begin_capture()


def end():
    census.CAPTURING = False
    if device.simulated():
        calls, device.RECORDER = device.RECORDER, None
        return _Recorded(calls)
    return _CudaGraph(device.capture_stream().end_capture())


def abandon():
    """A capture that failed: end it (its graph, if any, is dropped)."""
    census.CAPTURING = False
    if device.simulated():
        device.RECORDER = None
        return
    try:
        device.capture_stream().end_capture()
    except Exception:   # an invalidated capture ends with an error: the one raised is the news
        pass


class _CudaGraph:
    def __init__(self, graph):
        self.graph = graph

    def launch(self):
        census.note_launch("cuda_graph", census.FILL_BLOCKS)
        self.graph.launch(stream=device.capture_stream())


class _Recorded:
    """The simulator's graph: the recorded launches, replayed in order (uncounted: the census
    counts the one graph launch)."""

    def __init__(self, calls):
        self.calls = calls

    def launch(self):
        census.note_launch("cuda_graph", census.FILL_BLOCKS)
        with census.quiet():
            for fn, args in self.calls:
                fn(*args)


_patched = []


def _patch_simulator():
    """Kernel launches from the host record themselves while device.RECORDER is a list."""
    if _patched:
        return
    from numba.cuda.simulator import kernel as sim
    launch = sim.FakeCUDAKernel.__call__

    def recording(self, *args):
        if device.RECORDER is not None and not self._device and not sim._kernel_context:
            grid, block = self.grid_dim, self.block_dim
            device.RECORDER.append((lambda k, a: k[grid, block](*a), (self, args)))
            return None
        return launch(self, *args)
    sim.FakeCUDAKernel.__call__ = recording
    _patched.append(True)
