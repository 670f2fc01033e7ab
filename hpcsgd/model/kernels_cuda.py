"""CUDA counterparts of hpcsgd.model.kernels: the DNN's element-wise kernels for GPU ranks.

Shape key: N = frames in the minibatch (rows), M = units of the layer (columns), T = ROW_THREADS.
Wrappers take Numba device arrays (or any __cuda_array_interface__ array, e.g. CuPy) and launch
on the default stream without synchronizing; only softmax_xent_backward, which returns host
numbers, waits.

How they differ from the CPU kernels: exp is CUDA's expf (math.exp on float32), not the Cephes
polynomial `fexp`, and sums are accumulated in float64 and rounded once to the array's dtype
(the CPU adds float32 chunk partials), so GPU and CPU results agree to float tolerance, not bit
for bit. On the GPU itself every result is bit-reproducible for a given launch configuration:
no atomics, and every reduction adds in a fixed order that does not depend on timing, so the
GPU ranks of a data-parallel job stay bit-identical.

- Element-wise kernels: a 2-D grid of 32 x 8 blocks, grid-stride in both dimensions; a warp
  covers 32 consecutive columns of one row (coalesced).
- Column sums (bias gradients): one block per COL_TILE = 32 columns; lane l of SUM_LANES adds
  rows l, l + SUM_LANES, ... of its column in float64, then lane 0 adds the lanes in order.
- Row reductions (softmax): one block of T threads per row (row_threads: 32..ROW_THREADS by
  the row's width); thread t covers columns t, t + T, ...; thread 0 combines the T partials
  in thread order and shares the result.

16-bit storage (GPU ranks with train.precision=mixed: float16 arrays; bf16: uint16 arrays
holding bfloat16 bits; docs/precision.md): the DNN's, the softmax's and the LSTM's kernels
take float16, bfloat16 or float32 arrays (one compiled signature each) and compute in float32
either way: every load is widened with F (hpcsgd/half.py: widen -- bfloat16 bits shifted into
a float32, a float16 converted, nothing for a float32 array), every constant is float32, and
every store of a computed value goes through S (half.py: stored -- bfloat16 bits by the
project's rounding rule for a uint16 array; the value itself otherwise, so a float16 store
rounds once to nearest even), both chosen at compile time by the array's type.
Where mixed precision's CPU emulation (model/ops.py: HalfOps) sums values
before their float16 rounding -- a hidden layer's bias gradient (the column sums of dz) and
the output layer's (of the loss gradient) -- the 16-bit path computes the values in the
column sums' layout and sums them before the store (act_backward, softmax_xent_backward with
16-bit arrays), instead of a second pass that could only read the rounded values.
"""
import math

import numpy as np

from hpcsgd import census
from hpcsgd.device import as_device, fill, mul_rn, on_stream  # noqa: F401  (fill: re-exported)
from hpcsgd.half import stored as S
from hpcsgd.half import widen as F
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model.kernels import IDENTITY, SIGMOID
from hpcsgd.model.kernels_dropout import keep_cuda

ELEM_BLOCK = (32, 8)     # element-wise: 32 columns x 8 rows per block
COL_TILE, SUM_LANES = 32, 16   # column sums: columns per block x row lanes (512 threads)
ROW_THREADS = 128        # softmax: threads per row (block) at most; thread 0 combines them
# F (a load widened to float32) and S (a float32 as its array stores it): hpcsgd/half.py
ONE, ZERO = np.float32(1), np.float32(0)
SIXTEEN_BIT = (np.dtype(np.float16), np.dtype(np.uint16))   # float16, bfloat16 bits


def sixteen_bit(a):
    """Is a a 16-bit storage array (float16, or uint16 holding bfloat16 bits)?"""
    return a.dtype in SIXTEEN_BIT


def row_threads(m):
    """Threads per row of m columns: a warp at least, ROW_THREADS at most, else the next
    power of two (40 labels need 64 threads, not 128 mostly idle ones)."""
    t = 32
    while t < min(m, ROW_THREADS):
        t *= 2
    return t

MAX_GRID = 65535         # grid dims are capped (grid-stride loops cover the rest)

def _elem_launch(n, m):
    """(grid, block) of an element-wise kernel over (n, m): ELEM_BLOCK, narrowed to a smaller
    matrix (no idle threads; the kernels are grid-stride, so any launch gives the same
    result), and fewer rows per block while that leaves fewer than census.FILL_BLOCKS blocks
    (a 256 x 40 output layer: 512 blocks of one row, not 64 of eight)."""
    bx, by = min(ELEM_BLOCK[0], m), min(ELEM_BLOCK[1], n)
    while by > 1 and -(-m // bx) * -(-n // by) < census.FILL_BLOCKS:
        by //= 2
    return (min(-(-m // bx), MAX_GRID), min(-(-n // by), MAX_GRID)), (bx, by)


# ---------------------------------------------------------------------------------------------
# element-wise kernels. `kind` is a runtime argument: the branch is uniform across the grid, so
# it costs nothing on a GPU (unlike the CPU kernels, where it blocks vectorization).


@cuda.jit
def _bias_act_kernel(z, b, kind):
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            v = F(z[i, j]) + F(b[0, j])
            if kind == SIGMOID:
                z[i, j] = S(z, ONE / (ONE + math.exp(-v)))
            else:
                z[i, j] = S(z, max(v, ZERO))


@cuda.jit(device=True)
def _act_grad(hv, dv, kind):
    """dLoss/dz from the layer's output hv and dLoss/dh dv (float32); IDENTITY (a norm
    without activation, kernels_norm_cuda) passes dv through."""
    if kind == SIGMOID:
        return dv * (hv * (ONE - hv))
    if kind == IDENTITY:
        return dv
    return dv if hv > ZERO else ZERO


@cuda.jit
def _act_backward_kernel(h, d, dz, kind):
    n, m = d.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            # h read before dz (which may be h) is written
            dz[i, j] = S(dz, _act_grad(F(h[i, j]), F(d[i, j]), kind))


@cuda.jit
def _exp_kernel(z):
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            z[i, j] = math.exp(F(z[i, j]))


@cuda.jit(device=True)
def _sum_lanes(part, acc, out, col, m):
    """out[0, col] <- the block's column sums: lane 0 adds every lane's float64 partial of
    its column in lane order (the only rounding to out's dtype)."""
    tx, lane = cuda.threadIdx.x, cuda.threadIdx.y
    part[lane, tx] = acc
    cuda.syncthreads()
    if lane == 0 and col < m:
        for k in range(1, SUM_LANES):
            acc += part[k, tx]
        out[0, col] = acc


@cuda.jit
def _column_sums_kernel(a, out):
    n, m = a.shape
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    part = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    acc = 0.0
    if col < m:
        for i in range(cuda.threadIdx.y, n, SUM_LANES):
            acc += F(a[i, col])
    _sum_lanes(part, acc, out, col, m)


@cuda.jit
def _act_backward_sums_kernel(h, d, dz, out, kind):
    """dz = _act_grad (stored in dz's dtype) and out = column sums of the float32 values
    before that store, in the column sums' layout and order (float16 storage)."""
    n, m = d.shape
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    part = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    acc = 0.0
    if col < m:
        for i in range(cuda.threadIdx.y, n, SUM_LANES):
            g = _act_grad(F(h[i, col]), F(d[i, col]), kind)
            dz[i, col] = S(dz, g)
            acc += g
    _sum_lanes(part, acc, out, col, m)


@cuda.jit
def _xent_grad_sums_kernel(z, b, y, stats, out, scale):
    """The loss gradient of the logits from their row statistics (_softmax_xent_kernel with
    fused=True: stats[i] = (row max of z + b, float32(1 / sum of exp))): g = exp(z + b - max)
    * (1 / sum) - onehot, the float32 values the row kernel computes, stored as g * scale in
    z's dtype; out = column sums of g (unscaled, before the store)."""
    n, m = z.shape
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    part = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    acc = 0.0
    if col < m:
        for i in range(cuda.threadIdx.y, n, SUM_LANES):
            label = y[i]
            g = ZERO
            if label >= 0:
                g = mul_rn(math.exp(F(z[i, col]) + F(b[0, col]) - stats[i, 0]), stats[i, 1])
                if col == label:
                    g -= ONE
            z[i, col] = S(z, g * scale)   # a power of two: exact before the store's rounding
            acc += g
    _sum_lanes(part, acc, out, col, m)


# ---------------------------------------------------------------------------------------------
# output layer: one block per row. Each thread touches only its own columns (t, t + T, ...) in
# every pass, so passes need no barrier on z; barriers are only around the shared partials.


@cuda.jit(device=True)
def _row_bias_max(z, b, i, label, smax, sarg, szy):
    """Returns (max as float64, first argmax) of the row z[i] + b to every thread (z is not
    written: a float16 z could not hold z + b; later passes add b again, the same float32
    sums); szy[0] gets (z + b)[i, label] (for the CE)."""
    t = cuda.threadIdx.x
    m = z.shape[1]
    best = -math.inf
    arg = m                              # m = "no column yet" (threads t >= m keep it)
    for j in range(t, m, cuda.blockDim.x):
        v = F(z[i, j]) + F(b[0, j])
        if arg == m or v > best:         # ascending j: the first max of this thread
            best = v
            arg = j
        if j == label:
            szy[0] = v
    smax[t] = best
    sarg[t] = arg
    cuda.syncthreads()
    if t == 0:                           # thread order; ties go to the lowest column
        for k in range(1, cuda.blockDim.x):
            if smax[k] > smax[0] or (smax[k] == smax[0] and sarg[k] < sarg[0]):
                smax[0] = smax[k]
                sarg[0] = sarg[k]
    cuda.syncthreads()
    return smax[0], sarg[0]


@cuda.jit(device=True)
def _row_sum(part, x):
    """Sum of every thread's x (float64), added by thread 0 in thread order, to every thread."""
    t = cuda.threadIdx.x
    part[t] = x
    cuda.syncthreads()
    if t == 0:
        for k in range(1, cuda.blockDim.x):
            part[0] += part[k]
    cuda.syncthreads()
    return part[0]


@cuda.jit(device=True)
def _row_exp_sum(z, b, i, mx, store):
    """This thread's float64 sum of exp(z[i, j] + b[j] - mx) over its columns; z[i, j] <- the
    exp if `store`."""
    s = 0.0
    for j in range(cuda.threadIdx.x, z.shape[1], cuda.blockDim.x):
        e = math.exp(F(z[i, j]) + F(b[0, j]) - mx)       # float32 in, expf
        if store:
            z[i, j] = e
        s += e
    return s


@cuda.jit
def _softmax_xent_kernel(z, b, y, ce_rows, correct_rows, stats, fused):
    """fused (float16 storage): the row's max and float32(1 / sum) go to stats[i] and z is
    left to _xent_grad_sums_kernel; else z <- the loss gradient here."""
    i = cuda.blockIdx.x
    smax = cuda.shared.array(ROW_THREADS, np.float64)   # float64 holds any float32 exactly
    sarg = cuda.shared.array(ROW_THREADS, np.int32)
    ssum = cuda.shared.array(ROW_THREADS, np.float64)
    szy = cuda.shared.array(1, np.float64)
    label = y[i]
    if label < 0:   # outside the loss (a sequence's context or padding); uniform per block
        for j in range(cuda.threadIdx.x, z.shape[1], cuda.blockDim.x):
            z[i, j] = 0
        if cuda.threadIdx.x == 0:
            ce_rows[i] = 0.0
            correct_rows[i] = 0
        return
    mx, arg = _row_bias_max(z, b, i, label, smax, sarg, szy)
    s = _row_sum(ssum, _row_exp_sum(z, b, i, F(mx), not fused))
    inv = F(1.0 / s)
    if fused:
        if cuda.threadIdx.x == 0:
            stats[i, 0] = F(mx)
            stats[i, 1] = inv
    else:
        for j in range(cuda.threadIdx.x, z.shape[1], cuda.blockDim.x):
            g = z[i, j] * inv
            if j == label:
                g -= ONE
            z[i, j] = g
    if cuda.threadIdx.x == 0:
        # log-sum-exp minus the label's logit: exact even where the posterior underflows
        ce_rows[i] = math.log(s) + mx - szy[0]
        correct_rows[i] = 1 if arg == label else 0


@cuda.jit
def _log_softmax_kernel(z, b):
    i = cuda.blockIdx.x
    smax = cuda.shared.array(ROW_THREADS, np.float64)
    sarg = cuda.shared.array(ROW_THREADS, np.int32)
    ssum = cuda.shared.array(ROW_THREADS, np.float64)
    szy = cuda.shared.array(1, np.float64)
    mx, _ = _row_bias_max(z, b, i, -1, smax, sarg, szy)
    s = _row_sum(ssum, _row_exp_sum(z, b, i, F(mx), False))
    lse = F(mx + math.log(s))
    for j in range(cuda.threadIdx.x, z.shape[1], cuda.blockDim.x):
        z[i, j] = (F(z[i, j]) + F(b[0, j])) - lse


# ---------------------------------------------------------------------------------------------
# LSTM time steps (hpcsgd.model.kernels_lstm): one thread per (sequence, cell) of a step, the
# four gates of that cell read and written by it; arrays may be strided views (a row block of
# time-major buffers, one direction's columns).


@cuda.jit
def _lstm_forward_step_kernel(a, r, b, c_prev, c, h):
    nb, hc = c.shape
    j0, n0 = cuda.grid(2)
    sj, sn = cuda.gridsize(2)
    for n in range(n0, nb, sn):
        for j in range(j0, hc, sj):
            i = ONE / (ONE + math.exp(-(F(a[n, j]) + F(r[n, j]) + F(b[0, j]))))
            f = ONE / (ONE + math.exp(-(F(a[n, hc + j]) + F(r[n, hc + j]) + F(b[0, hc + j]))))
            g = math.tanh(F(a[n, 2 * hc + j]) + F(r[n, 2 * hc + j]) + F(b[0, 2 * hc + j]))
            o = ONE / (ONE + math.exp(-(F(a[n, 3 * hc + j]) + F(r[n, 3 * hc + j])
                                        + F(b[0, 3 * hc + j]))))
            cv = f * F(c_prev[n, j]) + i * g
            c[n, j] = S(c, cv)
            h[n, j] = S(h, o * math.tanh(cv))
            a[n, j] = S(a, i)
            a[n, hc + j] = S(a, f)
            a[n, 2 * hc + j] = S(a, g)
            a[n, 3 * hc + j] = S(a, o)


@cuda.jit
def _lstm_backward_step_kernel(a, c_prev, c, dh, dr, dc):
    nb, hc = c.shape
    j0, n0 = cuda.grid(2)
    sj, sn = cuda.gridsize(2)
    for n in range(n0, nb, sn):
        for j in range(j0, hc, sj):
            i, f = F(a[n, j]), F(a[n, hc + j])
            g, o = F(a[n, 2 * hc + j]), F(a[n, 3 * hc + j])
            tc = math.tanh(F(c[n, j]))
            d = F(dh[n, j]) + F(dr[n, j])
            dcv = F(dc[n, j]) + d * o * (ONE - tc * tc)
            a[n, j] = S(a, dcv * g * (i * (ONE - i)))
            a[n, hc + j] = S(a, dcv * F(c_prev[n, j]) * (f * (ONE - f)))
            a[n, 2 * hc + j] = S(a, dcv * i * (ONE - g * g))
            a[n, 3 * hc + j] = S(a, d * tc * (o * (ONE - o)))
            dc[n, j] = S(dc, dcv * f)


# ---------------------------------------------------------------------------------------------
# host-side wrappers (default stream; no sync unless a host value is returned)


# ---------------------------------------------------------------------------------------------
# fake quantization (hpcsgd.model.kernels_quant): the element-wise grid rounding, and row
# reductions (one block per row, thread-order sums in float64) whose per-row results the host
# adds in row order.


@cuda.jit
def _fake_quant_kernel(x, out, step, inv, klo, khi):
    n, m = x.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            # clip before rounding (the same value: klo, khi are integers), so that the
            # round's integer conversion never sees a huge value; round() is half-to-even
            t = min(max(x[i, j] * inv, klo), khi)
            out[i, j] = x.dtype.type(round(t)) * step


@cuda.jit
def _fake_quant_channels_kernel(x, out, step, inv, klo, khi):
    n, m = x.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            t = min(max(x[i, j] * inv[j], klo), khi)
            out[i, j] = x.dtype.type(round(t)) * step[j]


@cuda.jit
def _column_stats_kernel(x, out):
    """A thread per column: its rows in order (consecutive threads read consecutive columns:
    coalesced), the same float64 sums as the CPU kernel."""
    j = cuda.grid(1)
    if j >= x.shape[1]:
        return
    mx, sq, ab = 0.0, 0.0, 0.0
    for i in range(x.shape[0]):
        a = abs(np.float64(x[i, j]))
        mx = max(mx, a)
        sq += a * a
        ab += a
    out[j, 0] = mx
    out[j, 1] = sq
    out[j, 2] = ab


@cuda.jit
def _fake_quant_backward_kernel(x, d, lo, hi, part):
    i = cuda.blockIdx.x
    s_lo_part = cuda.shared.array(ROW_THREADS, np.float64)
    s_hi_part = cuda.shared.array(ROW_THREADS, np.float64)
    s_lo, s_hi = 0.0, 0.0
    zero = d.dtype.type(0)
    for j in range(cuda.threadIdx.x, x.shape[1], cuda.blockDim.x):
        v, g = x[i, j], d[i, j]
        if v < lo:
            s_lo += g
            d[i, j] = zero
        elif v > hi:
            s_hi += g
            d[i, j] = zero
    s_lo = _row_sum(s_lo_part, s_lo)
    s_hi = _row_sum(s_hi_part, s_hi)
    if cuda.threadIdx.x == 0:
        part[i, 0] = s_lo
        part[i, 1] = s_hi


@cuda.jit
def _abs_stats_kernel(x, part):
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    s_mx = cuda.shared.array(ROW_THREADS, np.float64)
    s_sq = cuda.shared.array(ROW_THREADS, np.float64)
    s_ab = cuda.shared.array(ROW_THREADS, np.float64)
    mx, sq, ab = 0.0, 0.0, 0.0
    for j in range(t, x.shape[1], cuda.blockDim.x):
        a = abs(np.float64(x[i, j]))
        mx = max(mx, a)
        sq += a * a
        ab += a
    s_mx[t] = mx
    cuda.syncthreads()
    if t == 0:
        for k in range(1, cuda.blockDim.x):
            s_mx[0] = max(s_mx[0], s_mx[k])
    sq = _row_sum(s_sq, sq)
    ab = _row_sum(s_ab, ab)
    if t == 0:
        part[i, 0] = s_mx[0]
        part[i, 1] = sq
        part[i, 2] = ab


def fake_quant(x, out, step, inv, klo, khi):
    """out (N, M) <- x on the grid step * [klo, khi] (model.kernels_quant.fake_quant); scalars
    of x's dtype. Views of any layout; out may be x."""
    x, out = as_device(x), as_device(out)
    n, m = x.shape
    if n and m:
        _fake_quant_kernel[on_stream(_elem_launch(n, m))](x, out, step, inv, klo, khi)


def fake_quant_channels(x, out, step, inv, klo, khi):
    """out (N, M) <- x, column j on the grid step[j] * [klo, khi] (step, inv device or host
    vectors of x's dtype; model.kernels_quant.fake_quant_channels)."""
    x, out = as_device(x), as_device(out)
    step, inv = (cuda.to_device(np.ascontiguousarray(v)) if isinstance(v, np.ndarray)
                 else as_device(v) for v in (step, inv))
    n, m = x.shape
    if n and m:
        _fake_quant_channels_kernel[on_stream(_elem_launch(n, m))](x, out, step, inv, klo, khi)


def column_abs_stats(x, out):
    """out (M, 3) float64 device scratch <- per column max |x|, sum x^2, sum |x|; returned
    on the host (a sync point)."""
    x, out = as_device(x), as_device(out)
    n, m = x.shape
    if m:
        _column_stats_kernel[on_stream((-(-m // 128), 128))](x, out)
    return out[:m].copy_to_host()


def fake_quant_backward(x, d, lo, hi, part):
    """d <- d where lo <= x <= hi, else 0, in place; returns (sum of d where x < lo, where
    x > hi), added in row order on the host from part (>= N, 2) float64: a sync point."""
    x, d, part = as_device(x), as_device(d), as_device(part)
    n, m = x.shape
    if n == 0 or m == 0:
        return 0.0, 0.0
    _fake_quant_backward_kernel[on_stream((n, row_threads(m)))](x, d, lo, hi, part)
    sums = part[:n].copy_to_host()
    return float(np.sum(sums[:, 0])), float(np.sum(sums[:, 1]))


def abs_stats(x, part):
    """(max |x|, E[x^2], E|x|) of x (N, M), per row on the device, part (>= N, 3) float64
    scratch: a sync point."""
    x, part = as_device(x), as_device(part)
    n, m = x.shape
    if n == 0 or m == 0:
        return 0.0, 0.0, 0.0
    _abs_stats_kernel[on_stream((n, row_threads(m)))](x, part)
    rows = part[:n].copy_to_host()
    return float(rows[:, 0].max()), float(np.sum(rows[:, 1])) / x.size, \
        float(np.sum(rows[:, 2])) / x.size


def lstm_forward_step(a, r, b, c_prev, c, h):
    """One LSTM time step (model.kernels_lstm.lstm_forward_step): a (B, 4H) in, the gate
    activations out; c, h (B, H) out. Views of any layout."""
    a, r, b, c_prev, c, h = (as_device(v) for v in (a, r, b, c_prev, c, h))
    nb, hc = c.shape
    if nb and hc:
        _lstm_forward_step_kernel[on_stream(_elem_launch(nb, hc))](a, r, b, c_prev, c, h)


def lstm_backward_step(a, c_prev, c, dh, dr, dc):
    """One LSTM time step backwards (model.kernels_lstm.lstm_backward_step): a gates in, the
    preactivations' gradient out; dc in and out."""
    a, c_prev, c, dh, dr, dc = (as_device(v) for v in (a, c_prev, c, dh, dr, dc))
    nb, hc = c.shape
    if nb and hc:
        _lstm_backward_step_kernel[on_stream(_elem_launch(nb, hc))](a, c_prev, c, dh, dr, dc)


def bias_act_forward(z, b, kind):
    """z (N, M) in place: z = f(z + b), b (1, M); kind is kernels.SIGMOID or kernels.RELU."""
    z, b = as_device(z), as_device(b)
    n, m = z.shape
    if n and m:
        _bias_act_kernel[on_stream(_elem_launch(n, m))](z, b, kind)


def act_backward(h, d, dz, gb, kind):
    """dz = d * f'(h) from the layer's output h (dz may be h); gb (1, M) = column sums of dz
    (float16 dz: of its float32 values before the store, in one fused kernel)."""
    h, d, dz = as_device(h), as_device(d), as_device(dz)
    n, m = d.shape
    if n and m and sixteen_bit(dz):
        _act_backward_sums_kernel[on_stream(column_sums_launch(m))](h, d, dz, as_device(gb), kind)
        return
    if n and m:
        _act_backward_kernel[on_stream(_elem_launch(n, m))](h, d, dz, kind)
    column_sums(dz, gb)


def column_sums(a, out):
    """out (1, M) = sums of a (N, M) over its rows, in a fixed order (float64, rounded once)."""
    a, out = as_device(a), as_device(out)
    n, m = a.shape
    if n == 0:
        fill(out, 0)
    elif m:
        _column_sums_kernel[on_stream(column_sums_launch(m))](a, out)


def column_sums_launch(m):
    """(blocks, (columns, lanes)) of the column sums over m columns: COL_TILE columns a block,
    narrowed to a narrow matrix (no idle columns of threads) and halved, down to 8 (a warp
    then still reads whole 32-byte sectors), while there are fewer than census.FILL_BLOCKS
    blocks: a 2048-wide hidden layer takes 256 blocks, not 64. Each column's sum is one
    thread's lanes in a fixed order whatever the tile, so the bits do not change."""
    tile = min(COL_TILE, m)
    while tile > 8 and -(-m // tile) < census.FILL_BLOCKS:
        tile //= 2
    return -(-m // tile), (tile, SUM_LANES)


def softmax_xent_backward(z, b, y, gb, ce_rows, correct_rows, stats=None, scale=1.0,
                          read=True):
    """z (N, M) logits without bias in; posterior - onehot(y) of z + b out (in place). y (N,)
    int32 labels; gb (1, M) = column sums of the gradient; ce_rows (>= N) float64 and
    correct_rows (>= N) int32 or float64 scratch (views of one (N, 2) buffer: CudaOps reads
    both in one copy) get each row's CE (nats) and hit (first argmax == y: 1, else 0).
    A float16 z (float16 storage) needs stats, (>= N, 2) float32 scratch, and gets the
    gradient times `scale` (the loss scale, a power of two) rounded once to float16, gb the
    column sums of the float32 gradient before that (unscaled); a float32 z is not scaled.
    Returns (CE summed over the rows: float, hits: int): a device-to-host copy, a sync point;
    read=False leaves them in ce_rows/correct_rows (a CUDA Graph's capture: read_rows after
    its launch) and returns None."""
    z, b, y, gb = as_device(z), as_device(b), as_device(y), as_device(gb)
    ce_rows, correct_rows = as_device(ce_rows), as_device(correct_rows)
    n, m = z.shape
    if n == 0:
        fill(gb, 0)
        return 0.0, 0
    fused = sixteen_bit(z)
    stats = as_device(stats) if fused else _no_stats()   # (unused by the unfused kernel)
    _softmax_xent_kernel[on_stream((n, row_threads(m)))](z, b, y, ce_rows, correct_rows, stats, fused)
    if fused:
        _xent_grad_sums_kernel[on_stream(column_sums_launch(m))](z, b, y, stats, gb, np.float32(scale))
    else:
        column_sums(z, gb)
    return read_rows(ce_rows, correct_rows, n) if read else None


def read_rows(ce_rows, correct_rows, n):
    """(CE summed over rows 0..n-1, hits) from the per-row device buffers: two copies to the
    host, which wait for the kernels that wrote them (a sync point)."""
    ce = ce_rows[:n].copy_to_host()
    hits = correct_rows[:n].copy_to_host()
    return float(np.sum(ce)), int(np.sum(hits))


_NO_STATS = []


def _no_stats():
    """A (1, 2) float32 device array made once: the stats argument of the unfused softmax
    (one signature for both; no allocation per call)."""
    if not _NO_STATS:
        _NO_STATS.append(cuda.to_device(np.zeros((1, 2), np.float32)))
    return _NO_STATS[0]


def log_softmax_forward(z, b):
    """z (N, M) in place: (z + b) - logsumexp(z + b) per row (log-posteriors)."""
    z, b = as_device(z), as_device(b)
    n, m = z.shape
    if n and m:
        _log_softmax_kernel[on_stream((n, row_threads(m)))](z, b)


def exp_inplace(z):
    """z (N, M) <- exp(z) (log-posteriors -> posteriors)."""
    z = as_device(z)
    n, m = z.shape
    if n and m:
        _exp_kernel[on_stream(_elem_launch(n, m))](z)


# ---------------------------------------------------------------------------------------------
# sequence layers (model.kernels_seq: the CPU kernels and their references). A thread per
# (row, channel): a warp reads 32 consecutive channels of one row (coalesced); fold adds its
# taps in order j = 0..k-1 as the CPU does, one thread per output value (no atomics).


@cuda.jit
def _unfold_kernel(x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left):
    c = x.shape[1]
    j0, r0 = cuda.grid(2)
    sj, sr = cuda.gridsize(2)
    for r in range(r0, steps_out * nb, sr):
        t, b = r // nb, r % nb
        for q in range(j0, kernel * c, sj):
            j, i = q // c, q % c
            src = t * stride - left + j * dilation
            if 0 <= src < steps_in:
                cols[r, q] = x[src * nb + b, i]   # a copy: the storage's bits as they are
            else:
                cols[r, q] = 0


@cuda.jit
def _fold_kernel(dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left):
    c = dx.shape[1]
    i0, r0 = cuda.grid(2)
    si, sr = cuda.gridsize(2)
    for r in range(r0, steps_in * nb, sr):
        t, b = r // nb, r % nb
        for i in range(i0, c, si):
            acc = ZERO
            for j in range(kernel):
                at = t + left - j * dilation
                if at >= 0 and at % stride == 0 and at // stride < steps_out:
                    acc += F(dcols[(at // stride) * nb + b, j * c + i])
            dx[r, i] = S(dx, acc)


@cuda.jit
def _mask_rows_kernel(x, batch_sizes, nb):
    m = x.shape[1]
    j0, r0 = cuda.grid(2)
    sj, sr = cuda.gridsize(2)
    for r in range(r0, len(batch_sizes) * nb, sr):
        if r % nb >= batch_sizes[r // nb]:
            for j in range(j0, m, sj):
                x[r, j] = 0


@cuda.jit
def _drop_kernel(x, out, keys, nb, salt, threshold, scale):
    m = x.shape[1]
    j0, r0 = cuda.grid(2)
    sj, sr = cuda.gridsize(2)
    s, th = np.uint64(salt), np.uint64(threshold)
    for r in range(r0, x.shape[0], sr):
        key, t = keys[r % nb], np.uint64(r // nb)
        for j in range(j0, m, sj):
            if keep_cuda(key, s, t, np.uint64(j), th):
                out[r, j] = S(out, mul_rn(F(x[r, j]), scale))
            else:
                out[r, j] = 0


def drop(x, out, keys, nb, salt, threshold, scale):
    """model.kernels_dropout.drop on the device (keys a device uint64 array; x and out of one
    storage dtype, the product in float32 stored once)."""
    x, out = as_device(x), as_device(out)
    rows, m = x.shape
    if rows and m:
        _drop_kernel[on_stream(_elem_launch(rows, m))](x, out, as_device(keys), nb, salt,
                                                        threshold, np.float32(scale))


def unfold(x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left):
    """model.kernels_seq.unfold on the device (x and cols of one storage dtype)."""
    x, cols = as_device(x), as_device(cols)
    rows, width = steps_out * nb, kernel * x.shape[1]
    if rows and width:
        _unfold_kernel[on_stream(_elem_launch(rows, width))](
            x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left)


def fold(dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left):
    """model.kernels_seq.fold on the device: the sum in float32, stored once."""
    dcols, dx = as_device(dcols), as_device(dx)
    rows, c = steps_in * nb, dx.shape[1]
    if rows and c:
        _fold_kernel[on_stream(_elem_launch(rows, c))](
            dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left)


def mask_rows(x, batch_sizes, nb):
    """model.kernels_seq.mask_rows on the device; batch_sizes a device int64 array."""
    x = as_device(x)
    rows, m = len(batch_sizes) * nb, x.shape[1]
    if rows and m:
        _mask_rows_kernel[on_stream(_elem_launch(rows, m))](x, as_device(batch_sizes), nb)
