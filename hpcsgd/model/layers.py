"""Layers: each declares its parameters (ParamSpecs) and comes as a forward/backward pair
over preallocated buffers (llm.c's x_forward / x_backward), GEMMs through the device's BLAS
(hpcsgd.device.matmul) and every element-wise step through the device's ops
(hpcsgd.model.ops). A model is a list of layers (hpcsgd.model.network.Network); a new kind of
model is new layers and a builder, not an edit of these.

The layer interface (duck-typed; a layer holds shapes and names, never arrays):
    specs()                        its ParamSpecs (names unique in the model)
    n_in, n_out                    input and output width per frame
    gemm_macs                      multiply-adds per frame of its forward GEMM(s)
    init(views, rng)               fill its parameters (host views), drawing from rng in order
    forward(p, x, y, ops, progress)
                                   y (n, n_out) <- the layer's output for x (n, n_in)
    backward(p, g, x, y, dy, dx, ops, progress)
                                   from the forward's input x and output y, and dy = dLoss/dy
                                   (None for the output layer, whose loss already turned y into
                                   dLoss/dz): writes its parameter gradients into g (overwrite)
                                   and, unless dx is None (the input layer), dx = dLoss/dx.
                                   May overwrite y (the DNN's layers write dz over it).
`p` and `g` are FlatParams-like (views by name); `progress`, if given, is called after every
GEMM (double buffering drives the exchange in flight with MPI_Test there).

Conventions: losses and gradients are SUMMED over the frames of the minibatch, never averaged
(learning rates are per sample, hpcsgd.optim).
"""
import numpy as np

from hpcsgd.device import matmul
from hpcsgd.model import kernels as K
from hpcsgd.model.flat import ParamSpec

ACTIVATIONS = K.ACTIVATIONS   # name -> kernel code


def glorot_uniform(W, rng, gain=1.0):
    """W ~ U(-a, a), a = gain * sqrt(6 / (n_in + n_out)) (Glorot & Bengio 2010), drawn from
    rng as float64 and rounded to W's dtype."""
    n_in, n_out = W.shape
    a = gain * np.sqrt(6.0 / (n_in + n_out))
    W[...] = rng.uniform(-a, a, size=W.shape).astype(W.dtype)


def _linear_backward(W, gW, x, dz, dx, progress):
    """gW = x.T @ dz, then dx = dz @ W.T unless dx is None: the GEMMs of a linear map's
    backward, in the order the DNN has always run them."""
    matmul(x, dz, gW, trans_a=True)
    if progress is not None:
        progress()
    if dx is not None:
        matmul(dz, W, dx, trans_b=True)
        if progress is not None:
            progress()


class Dense:
    """A hidden layer, y = f(x @ W + b), f sigmoid or ReLU; the bias and activation are one
    fused kernel forward, their derivative and the bias gradient one fused kernel backward.
    Parameters {name}.w (n_in, n_out) and {name}.b (1, n_out), name the layer's place (enc.2);
    a codec column of W is the fan-out of one input unit."""

    def __init__(self, name, n_in, n_out, activation="sigmoid"):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
        self.W, self.b = f"{name}.w", f"{name}.b"
        self.n_in, self.n_out = int(n_in), int(n_out)
        self.activation, self.kind = activation, ACTIVATIONS[activation]
        self.gemm_macs = self.n_in * self.n_out
        # the values y can take (quantization-aware training: the next layer's input grid)
        self.output_range = (0.0, 1.0) if self.kind == K.SIGMOID else (0.0, None)

    def specs(self):
        return [ParamSpec(self.W, (self.n_in, self.n_out), "weight", "codec", "rows"),
                ParamSpec(self.b, (1, self.n_out), "bias", "codec", "rows")]

    def init(self, views, rng):
        """Glorot, times 4 for sigmoid (Glorot & Bengio) and sqrt(2) for ReLU (He); b = 0."""
        glorot_uniform(views[self.W], rng, 4.0 if self.kind == K.SIGMOID else np.sqrt(2.0))
        views[self.b][...] = 0

    def forward(self, p, x, y, ops, progress=None):
        matmul(x, p[self.W], y)                                   # 2 n n_in n_out FLOP
        if progress is not None:
            progress()
        ops.bias_act(y, p[self.b], self.kind)

    def backward(self, p, g, x, y, dy, dx, ops, progress=None):
        ops.act_backward(y, dy, y, g[self.b], self.kind)          # dz over h (not needed now)
        _linear_backward(p[self.W], g[self.W], x, y, dx, progress)


class SoftmaxOutput:
    """The output layer: logits z = x @ W + b over the labels (senones), softmax, and the
    cross-entropy against frame labels. forward() computes x @ W only; the bias is added
    inside the fused loss (training) or log-softmax (inference) kernel, one pass over the
    logits instead of two. Plain Glorot init, b = 0. Parameters {name}.w and {name}.b (out.w,
    out.b)."""

    def __init__(self, name, n_in, n_out):
        self.W, self.b = f"{name}.w", f"{name}.b"
        self.n_in, self.n_out = int(n_in), int(n_out)
        self.gemm_macs = self.n_in * self.n_out

    def specs(self):
        return [ParamSpec(self.W, (self.n_in, self.n_out), "weight", "codec", "rows"),
                ParamSpec(self.b, (1, self.n_out), "bias", "codec", "rows")]

    def init(self, views, rng):
        glorot_uniform(views[self.W], rng)
        views[self.b][...] = 0

    def forward(self, p, x, z, ops, progress=None):
        matmul(x, p[self.W], z)
        if progress is not None:
            progress()

    def loss(self, p, g, z, labels, ops, scale=1.0):
        """Softmax cross-entropy of z (+ b) against labels: z becomes dLoss/dz and g's bias
        its column sums, both times the loss scale. Returns (CE summed over the frames in nats,
        unscaled; frames whose argmax is the label)."""
        return ops.softmax_xent(z, p[self.b], labels, g[self.b], scale)

    def posteriors(self, p, z, ops, log=True):
        """z (+ b) -> log-posteriors (or posteriors), in place."""
        ops.log_softmax(z, p[self.b])
        if not log:
            ops.exp(z)

    def backward(self, p, g, x, z, dy, dx, ops, progress=None):
        _linear_backward(p[self.W], g[self.W], x, z, dx, progress)
