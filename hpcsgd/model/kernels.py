"""Fused element-wise kernels of the DNN (Numba CPU) and the NumPy references they are tested
against.

Shape key: N = frames in the minibatch (rows), M = units of the layer (columns), C = NCHUNK.
Every kernel is dtype-generic (float32 in training, float64 in the gradient checks): Numba
compiles one version per dtype. fastmath stays off, so results do not depend on vectorization;
`fexp` gives a vectorizable float32 exp instead (no SVML here: libm's expf is a scalar call,
7x slower on the 46M model's sigmoid layers).

Column sums (bias gradients) split the rows into NCHUNK fixed chunks, each summed into its own
row of `partial` (C, M), then the C partials are added in order: the result is the same bits
whatever the number of threads, and the loops stay unit-stride (vectorized).
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic, overload

SIGMOID, RELU = 0, 1
ACTIVATIONS = {"sigmoid": SIGMOID, "relu": RELU}
NCHUNK = 16  # row chunks of the column sums; fixed so that the bits do not depend on threads

# ---------------------------------------------------------------------------------------------
# exp: Cephes expf (range reduction by ln 2, degree-6 polynomial, 2^n built in the exponent
# bits); max relative error 6e-8 (1 ulp) on [-87, 88]. Inputs are clamped to [-87, 88], so
# exp(x < -87) = 1.6e-38 instead of smaller, exp(x > 88) = 1.65e38 instead of inf: harmless for
# softmax (arguments <= 0, CE is computed as log-sum-exp) and sigmoid (gives 6e-39, not 0).
# float64 uses math.exp (the gradient checks want the exact function).


@intrinsic
def _int32_bits_as_float32(typingctx, i):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


_f = np.float32
_LOG2E, _C1, _C2 = _f(1.4426950408889634), _f(0.693359375), _f(-2.12194440e-4)
_P0, _P1, _P2 = _f(1.9875691500e-4), _f(1.3981999507e-3), _f(8.3334519073e-3)
_P3, _P4, _P5 = _f(4.1665795894e-2), _f(1.6666665459e-1), _f(5.0000001201e-1)
_HI, _LO, _HALF, _ONE = _f(88.0), _f(-87.0), _f(0.5), _f(1.0)


@njit(inline="always")
def _expf(x):
    x = min(max(x, _LO), _HI)
    n = math.floor(x * _LOG2E + _HALF)
    r = x - n * _C1 - n * _C2
    p = ((((_P0 * r + _P1) * r + _P2) * r + _P3) * r + _P4) * r + _P5
    p = p * r * r + r + _ONE
    return p * _int32_bits_as_float32((np.int32(n) + np.int32(127)) << np.int32(23))


def fexp(x):
    """exp(x): the polynomial above for float32, math.exp otherwise (Numba only)."""
    return math.exp(x)


@overload(fexp, inline="always")
def _fexp_overload(x):
    if x == types.float32:
        return lambda x: _expf(x)
    return lambda x: math.exp(x)


@njit(parallel=True, cache=True)
def exp_kernel(x, out):
    """out = fexp(x), 1-D; exists so that the tests can compare fexp with np.exp."""
    for i in prange(x.size):
        out[i] = fexp(x[i])


# ---------------------------------------------------------------------------------------------
# hidden layers: forward (bias + activation, in place) and backward (derivative + bias grad)


@njit(parallel=True, cache=True)
def bias_act_forward(z, b, kind):
    """z (N, M): x @ W in, h = f(z + b) out (in place); b (1, M); kind SIGMOID or RELU."""
    n, m = z.shape
    one = z.dtype.type(1)
    zero = z.dtype.type(0)
    for i in prange(n):
        if kind == SIGMOID:
            for j in range(m):
                z[i, j] = one / (one + fexp(-(z[i, j] + b[0, j])))
        else:
            for j in range(m):
                v = z[i, j] + b[0, j]
                z[i, j] = v if v > zero else zero


@njit(parallel=True, cache=True)
def act_backward(h, d, dz, gb, partial, kind):
    """dz = d * f'(z), from the layer's output h = f(z) (sigmoid: h(1-h); relu: [h > 0]),
    and gb (1, M) = column sums of dz. h, d, dz (N, M); dz may alias h (each element is read
    before it is written); partial (C, M) scratch."""
    n, m = d.shape
    one = d.dtype.type(1)
    zero = d.dtype.type(0)
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        p = partial[c]
        for j in range(m):
            p[j] = zero
        for i in range(c * rows, min(n, (c + 1) * rows)):
            if kind == SIGMOID:
                for j in range(m):
                    hv = h[i, j]
                    g = d[i, j] * (hv * (one - hv))
                    dz[i, j] = g
                    p[j] += g
            else:
                for j in range(m):
                    g = d[i, j] if h[i, j] > zero else zero
                    dz[i, j] = g
                    p[j] += g
    for j in prange(m):                  # the C partials, added in a fixed order
        acc = partial[0, j]
        for c in range(1, NCHUNK):
            acc += partial[c, j]
        gb[0, j] = acc


# ---------------------------------------------------------------------------------------------
# output layer: softmax + cross-entropy + its gradient + argmax, one pass set per row


@njit(parallel=True, cache=True)
def softmax_xent_backward(z, b, y, gb, partial, ce_part, correct_part):
    """z (N, M): h @ W in, d CE / d(z + b) = posterior - onehot(y) out (in place); y (N,) labels.
    gb (1, M) = column sums of that gradient; ce_part (C,) float64 and correct_part (C,) int64
    get each chunk's summed cross-entropy (nats) and number of frames with argmax == y.
    CE of a frame = logsumexp(z + b) - (z + b)[y]. Ties in argmax go to the lowest index."""
    n, m = z.shape
    zero = z.dtype.type(0)
    one = z.dtype.type(1)
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        p = partial[c]
        for j in range(m):
            p[j] = zero
        ce = 0.0
        correct = 0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            mx, arg = _bias_max_argmax(z, b, i, m)
            label = y[i]
            zy = z[i, label]                     # (z + b)[y], before the row is overwritten
            s = zero
            for j in range(m):
                e = fexp(z[i, j] - mx)
                z[i, j] = e
                s += e
            inv = one / s
            for j in range(m):
                g = z[i, j] * inv
                z[i, j] = g
                p[j] += g
            z[i, label] -= one
            p[label] -= one
            # CE from the max and the sum, not from log(posterior): exact for tiny posteriors
            ce += math.log(s) + mx - zy
            if arg == label:
                correct += 1
        ce_part[c] = ce
        correct_part[c] = correct
    for j in prange(m):                  # the C partials, added in a fixed order
        acc = partial[0, j]
        for c in range(1, NCHUNK):
            acc += partial[c, j]
        gb[0, j] = acc


@njit(inline="always")
def _bias_max_argmax(z, b, i, m):
    """z[i] += b, returns (max, first argmax) of the row."""
    mx = z[i, 0] + b[0, 0]
    arg = 0
    for j in range(m):
        v = z[i, j] + b[0, j]
        z[i, j] = v
        if v > mx:
            mx = v
            arg = j
    return mx, arg


@njit(parallel=True, cache=True)
def log_softmax_forward(z, b, log):
    """z (N, M): h @ W in, log-posteriors (log=True) or posteriors out, in place."""
    n, m = z.shape
    zero = z.dtype.type(0)
    for i in prange(n):
        mx, _ = _bias_max_argmax(z, b, i, m)
        s = zero
        for j in range(m):
            s += fexp(z[i, j] - mx)
        if log:
            lse = mx + math.log(s)
            for j in range(m):
                z[i, j] = z[i, j] - lse
        else:
            inv = z.dtype.type(1) / s
            for j in range(m):
                z[i, j] = fexp(z[i, j] - mx) * inv


# ---------------------------------------------------------------------------------------------
# NumPy references (float64 inside; the tests compare the kernels with them)


def ref_sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def ref_bias_act_forward(z, b, kind):
    v = z.astype(np.float64) + b
    return ref_sigmoid(v) if kind == SIGMOID else np.maximum(v, 0.0)


def ref_act_backward(h, d, kind):
    h64, d64 = h.astype(np.float64), d.astype(np.float64)
    dz = d64 * h64 * (1.0 - h64) if kind == SIGMOID else d64 * (h64 > 0)
    return dz, dz.sum(axis=0, keepdims=True)


def ref_softmax_xent(z, b, y):
    """-> (grad = posterior - onehot, bias grad, CE sum, correct count, log-posteriors)."""
    v = z.astype(np.float64) + b
    mx = v.max(axis=1, keepdims=True)
    logpost = v - mx - np.log(np.exp(v - mx).sum(axis=1, keepdims=True))
    grad = np.exp(logpost)
    rows = np.arange(len(y))
    grad[rows, y] -= 1.0
    ce = -logpost[rows, y].sum()
    correct = int((v.argmax(axis=1) == y).sum())
    return grad, grad.sum(axis=0, keepdims=True), ce, correct, logpost
