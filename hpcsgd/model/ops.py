"""The element-wise work of the layers, one object per device with the same five methods, so
a layer's forward and backward are written once: the GEMMs (hpcsgd.device.matmul) and calls
to these.

    CpuOps    the Numba CPU kernels of hpcsgd.model.kernels, with their preallocated scratch
    CudaOps   the CUDA kernels of hpcsgd.model.kernels_cuda (GPU ranks)
    GemmOnly  nothing at all: the step's GEMMs alone, the roofline `bench train` divides by

Shapes: z, h, d (N, M) with N <= max_batch rows and M <= max_width columns; b, gb (1, M);
y (N,) integer labels. `kind` is kernels.SIGMOID or kernels.RELU.
"""
import numpy as np

from hpcsgd.device import zeros
from hpcsgd.model import kernels as K
from hpcsgd.model import kernels_cuda as KC   # compiled on first launch, by GPU models only


class CpuOps:
    def __init__(self, max_batch, max_width, dtype):
        self.partial = np.empty((K.NCHUNK, max_width), dtype)
        self.lanes = np.empty((max(max_batch, K.NCHUNK), K.LANES), dtype)
        self.ce_part = np.empty(K.NCHUNK, np.float64)
        self.correct_part = np.empty(K.NCHUNK, np.int64)

    def bias_act(self, z, b, kind):
        """z <- f(z + b), in place."""
        K.FORWARD[kind](z, b)

    def act_backward(self, h, d, dz, gb, kind):
        """dz <- d * f'(.) from the output h (dz may be h); gb <- column sums of dz."""
        K.BACKWARD[kind](h, d, dz, gb, self.partial)

    def softmax_xent(self, z, b, y, gb):
        """z (logits without bias) <- d CE / d(z + b); gb <- its column sums. Returns (CE
        summed over the rows, rows whose argmax is the label)."""
        K.softmax_xent_backward(z, b, y, gb, self.partial, self.lanes, self.ce_part,
                                self.correct_part)
        return float(self.ce_part.sum()), int(self.correct_part.sum())

    def log_softmax(self, z, b):
        """z (logits without bias) <- log-posteriors, in place."""
        K.log_softmax_forward(z, b, self.lanes)

    def exp(self, z):
        K.exp_inplace(z)


class CudaOps:
    """The same on a GPU rank: per-row CE and hits come back through small device buffers."""

    def __init__(self, max_batch, max_width, dtype):
        self.ce_rows = zeros(max_batch, np.float64, "cuda")
        self.correct_rows = zeros(max_batch, np.int32, "cuda")

    def bias_act(self, z, b, kind):
        KC.bias_act_forward(z, b, kind)

    def act_backward(self, h, d, dz, gb, kind):
        KC.act_backward(h, d, dz, gb, kind)

    def softmax_xent(self, z, b, y, gb):
        return KC.softmax_xent_backward(z, b, y, gb, self.ce_rows, self.correct_rows)

    def log_softmax(self, z, b):
        KC.log_softmax_forward(z, b)

    def exp(self, z):
        KC.exp_inplace(z)


class GemmOnly:
    """Every element-wise kernel skipped: a step of GEMMs alone, into the step's buffers."""

    def bias_act(self, z, b, kind):
        pass

    def act_backward(self, h, d, dz, gb, kind):
        pass

    def softmax_xent(self, z, b, y, gb):
        return 0.0, 0

    def log_softmax(self, z, b):
        pass

    def exp(self, z):
        pass


def make_ops(device, max_batch, max_width, dtype):
    return (CudaOps if device == "cuda" else CpuOps)(max_batch, max_width, dtype)
