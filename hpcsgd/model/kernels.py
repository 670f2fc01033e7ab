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
IDENTITY = 2   # after a norm only (hpcsgd.model.kernels_norm): no activation
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
    # n as a float64 (exact: |n| <= 127). math.floor returned an int64, the same value, but
    # AVX2 has no packed float -> int64 conversion, so LLVM made that one step scalar and the
    # whole loop slow on Zen 3; r and the polynomial are float64 either way.
    n = np.float64(np.floor(x * _LOG2E + _HALF))
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
# hidden layers: forward (bias + activation, in place) and backward (derivative + bias grad).
# One kernel per activation: a runtime `if kind == ...` around the stores inside a prange body
# made Numba's loop 25x slower (24 ms instead of 0.9 ms for 1024 x 2048).


@njit(parallel=True, cache=True)
def sigmoid_forward(z, b):
    """z (N, M): x @ W in, h = 1 / (1 + exp(-(z + b))) out (in place); b (1, M)."""
    n, m = z.shape
    one = z.dtype.type(1)
    for i in prange(n):
        for j in range(m):
            z[i, j] = one / (one + fexp(-(z[i, j] + b[0, j])))


@njit(parallel=True, cache=True)
def relu_forward(z, b):
    """z (N, M): x @ W in, h = max(z + b, 0) out (in place); b (1, M)."""
    n, m = z.shape
    zero = z.dtype.type(0)
    for i in prange(n):
        for j in range(m):
            z[i, j] = max(z[i, j] + b[0, j], zero)


@njit(parallel=True, cache=True)
def sigmoid_backward(h, d, dz, gb, partial):
    """dz = d * h (1 - h) from the layer's output h, and gb (1, M) = column sums of dz.
    h, d, dz (N, M); dz may alias h (each element is read before it is written);
    partial (C, M) scratch."""
    n, m = d.shape
    one = d.dtype.type(1)
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        p = partial[c]
        p[:] = 0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            for j in range(m):
                hv = h[i, j]
                g = d[i, j] * (hv * (one - hv))
                dz[i, j] = g
                p[j] += g
    for j in prange(m):                  # the C partials, added in a fixed order
        acc = partial[0, j]
        for c in range(1, NCHUNK):
            acc += partial[c, j]
        gb[0, j] = acc


@njit(parallel=True, cache=True)
def relu_backward(h, d, dz, gb, partial):
    """dz = d * [h > 0] from the layer's output h, and gb = column sums of dz (as above)."""
    n, m = d.shape
    zero = d.dtype.type(0)
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        p = partial[c]
        p[:] = 0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            for j in range(m):
                g = d[i, j] if h[i, j] > zero else zero
                dz[i, j] = g
                p[j] += g
    for j in prange(m):
        acc = partial[0, j]
        for c in range(1, NCHUNK):
            acc += partial[c, j]
        gb[0, j] = acc


FORWARD = {SIGMOID: sigmoid_forward, RELU: relu_forward}
BACKWARD = {SIGMOID: sigmoid_backward, RELU: relu_backward}


# ---------------------------------------------------------------------------------------------
# output layer: softmax + cross-entropy + its gradient + argmax. Per row, unit-stride passes
# that vectorize: bias add + max; first argmax (a search up to it); exp; a sum in LANES
# interleaved partial sums (a plain float sum is one long dependency chain without fastmath,
# so it cannot vectorize); normalise + bias-gradient partials.

LANES = 16


@njit(inline="always")
def _bias_max_argmax(z, b, i, m):
    """z[i] += b; returns (max, first argmax) of the row."""
    row = z[i]
    mx = row[0] + b[0, 0]
    for j in range(m):
        v = row[j] + b[0, j]
        row[j] = v
        mx = max(mx, v)
    arg = 0
    while row[arg] != mx and arg < m - 1:   # first index of the max (NaN rows: the last)
        arg += 1
    return mx, arg


@njit(inline="always")
def _exp_sum(row, mx, m, lane):
    """row <- exp(row - mx); returns the sum, added in LANES interleaved partial sums."""
    for j in range(m):
        row[j] = fexp(row[j] - mx)
    m_l = m - m % LANES
    for k in range(LANES):
        lane[k] = 0
    for j0 in range(0, m_l, LANES):
        for k in range(LANES):
            lane[k] += row[j0 + k]
    s = lane[0]
    for k in range(1, LANES):
        s += lane[k]
    for j in range(m_l, m):
        s += row[j]
    return s


@njit(parallel=True, cache=True)
def softmax_xent_backward(z, b, y, gb, partial, lanes, ce_part, correct_part):
    """z (N, M): h @ W in, d CE / d(z + b) = posterior - onehot(y) out (in place); y (N,) labels.
    gb (1, M) = column sums of that gradient; ce_part (C,) float64 and correct_part (C,) int64
    get each chunk's summed cross-entropy (nats) and number of frames with argmax == y;
    partial (C, M) and lanes (C, LANES) scratch. CE of a frame = logsumexp(z + b) - (z + b)[y],
    exact even where the posterior underflows. Ties in argmax go to the lowest index. A frame
    labelled -1 (a sequence's context or padding) has no loss: gradient 0, not counted."""
    n, m = z.shape
    one = z.dtype.type(1)
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        p = partial[c]
        p[:] = 0
        ce = 0.0
        correct = 0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            label = y[i]
            if label < 0:
                z[i, :] = 0
                continue
            mx, arg = _bias_max_argmax(z, b, i, m)
            zy = z[i, label]                     # (z + b)[y], before the row is overwritten
            s = _exp_sum(z[i], mx, m, lanes[c])
            inv = one / s
            row = z[i]
            for j in range(m):
                g = row[j] * inv
                row[j] = g
                p[j] += g
            row[label] -= one
            p[label] -= one
            ce += math.log(s) + mx - zy
            correct += 1 if arg == label else 0
        ce_part[c] = ce
        correct_part[c] = correct
    for j in prange(m):
        acc = partial[0, j]
        for c in range(1, NCHUNK):
            acc += partial[c, j]
        gb[0, j] = acc


@njit(inline="always")
def log_softmax_row(row, b, m, lane):
    """row <- (row + b) - logsumexp(row + b), in place (lane: LANES scratch). The rows of
    log_softmax_forward, and of the CTC loss (model.kernels_ctc), so both give a logit row the
    same bits."""
    for j in range(m):
        row[j] = row[j] + b[0, j]
    log_softmax_inplace(row, m, lane)


@njit(inline="always")
def log_softmax_inplace(row, m, lane):
    """row <- row - logsumexp(row), in place: max-subtracted, the sum of exps in LANES
    interleaved partial sums (lane: LANES scratch). log_softmax_row's arithmetic after its
    bias, and the RNN-T loss's rows (model.kernels_rnnt: the joint's logits carry theirs)."""
    mx = row[0]
    for j in range(m):
        mx = max(mx, row[j])
    s = row.dtype.type(0)
    for k in range(LANES):
        lane[k] = 0
    m_l = m - m % LANES
    for j0 in range(0, m_l, LANES):
        for k in range(LANES):
            lane[k] += fexp(row[j0 + k] - mx)
    for k in range(LANES):
        s += lane[k]
    for j in range(m_l, m):
        s += fexp(row[j] - mx)
    lse = mx + math.log(s)
    for j in range(m):
        row[j] = row[j] - lse


@njit(parallel=True, cache=True)
def log_softmax_forward(z, b, lanes):
    """z (N, M): h @ W in, log-posteriors z + b - logsumexp(z + b) out (in place);
    lanes (N, LANES) scratch."""
    n, m = z.shape
    for i in prange(n):
        log_softmax_row(z[i], b, m, lanes[i])


@njit(parallel=True, cache=True)
def exp_inplace(z):
    """z <- fexp(z) (log-posteriors -> posteriors)."""
    n, m = z.shape
    for i in prange(n):
        for j in range(m):
            z[i, j] = fexp(z[i, j])


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
    rows = np.flatnonzero(y >= 0)     # -1: no loss
    grad[rows, y[rows]] -= 1.0
    grad[y < 0] = 0.0
    ce = -logpost[rows, y[rows]].sum()
    correct = int((v.argmax(axis=1) == y)[rows].sum())
    return grad, grad.sum(axis=0, keepdims=True), ce, correct, logpost
