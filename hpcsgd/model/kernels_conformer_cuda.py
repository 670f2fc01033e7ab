"""CUDA twins of hpcsgd.model.kernels_conformer: the Conformer's element-wise kernels, its
depthwise convolution, the attention's head-major copies with the rotary embedding and its
masked softmax, and the subsampling front end's unfold2d / fold2d, for GPU ranks. Wrappers
take Numba device arrays (or any __cuda_array_interface__ array) with the CPU kernels'
arguments (the depthwise backward without its CPU partials; `lengths` and the rotary tables
device arrays), and launch on the compute stream without synchronizing.

Layouts (kernels_cuda's conventions):

- element-wise kernels (residual add, bias, swish, GLU, the depthwise convolution and its
  input gradient, to_heads / from_heads, unfold2d / fold2d): a 2-D grid-stride launch
  (kernels_cuda._elem_launch), one thread per output value, which reads what it needs and
  writes only its own value(s); a GLU thread owns column j and its gate column M + j (so
  z may be dz).
- the depthwise taps' and bias's gradients: a (column tile, tap) block per tile of channels
  and tap (the bias is tap K), its SUM_LANES lanes over the rows (kernels_cuda's column-sum
  layout), float64 partials added by lane 0 in lane order: a fixed order, no atomics.
- the masked softmax and its backward: one block per (utterance, head, query step) row,
  row_threads(T) threads over its keys, the float64 sum added by thread 0 in thread order
  (kernels_cuda._row_sum).

Arithmetic: float32 on the values (16-bit storage -- float16, or uint16 bfloat16 bits --
widened by F on every load and rounded once by S at every store, hpcsgd/half.py), as the CPU
kernels compute on float32 arrays and mixed precision's emulation (model/ops.py: HalfOps)
rounds each stored value once. Every product that an add or subtract follows is
device.mul_rn (no FMA contraction), so the kernels without exp or a float64 sum (the residual
add, bias, depthwise forward and input gradient, to_heads / from_heads, unfold2d / fold2d)
give the CPU kernels' bits; swish, GLU and the softmax use CUDA's expf (math.exp on float32)
where the CPU has its Cephes polynomial (kernels.fexp), and the float64 sums (the softmax's,
the depthwise parameter gradients) add in another order before their one rounding: within a
few float32 roundings of the CPU (tests/test_conformer_cuda.py derives the bounds). The
rotary tables are float32 whatever the storage (CudaOps.rope), the CPU emulation's.
"""
import math

import numpy as np

from hpcsgd.device import as_device, fill, mul_rn, on_stream
from hpcsgd.half import stored as S
from hpcsgd.half import widen as F
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model.kernels_cuda import (COL_TILE, ROW_THREADS, SUM_LANES, _elem_launch,
                                       _row_sum, column_sums_launch, row_threads)

ONE, ZERO = np.float32(1), np.float32(0)


# ---------------------------------------------------------------------------------------------
# element-wise: residual add, bias, swish, GLU


@cuda.jit
def _add_scaled_kernel(x, o, s, out):
    n, m = x.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            out[i, j] = S(out, F(x[i, j]) + mul_rn(s, F(o[i, j])))


@cuda.jit
def _add_bias_kernel(z, b):
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            z[i, j] = S(z, F(z[i, j]) + F(b[0, j]))


@cuda.jit(device=True)
def _sigmoid(v):
    return ONE / (ONE + math.exp(-v))


@cuda.jit
def _swish_kernel(z, y):
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            v = F(z[i, j])
            y[i, j] = S(y, v * _sigmoid(v))


@cuda.jit
def _bias_swish_kernel(z, b, y):
    """z += b (stored), y = swish of the float32 sum (HalfOps: rounded after, both)."""
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            v = F(z[i, j]) + F(b[0, j])
            z[i, j] = S(z, v)
            y[i, j] = S(y, v * _sigmoid(v))


@cuda.jit
def _swish_backward_kernel(z, dy, dz):
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            v = F(z[i, j])
            s = _sigmoid(v)
            # the CPU's dy * (s + v s (1 - s)): (v s)(1 - s) rounded before the add
            dz[i, j] = S(dz, F(dy[i, j]) * (s + mul_rn(v * s, ONE - s)))


@cuda.jit
def _bias_glu_kernel(z, b, y):
    """Thread (i, j < M): z[i, j] and z[i, M + j] += their biases (stored), y[i, j] from
    the float32 sums."""
    n, m = y.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            a = F(z[i, j]) + F(b[0, j])
            g = F(z[i, m + j]) + F(b[0, m + j])
            z[i, j] = S(z, a)
            z[i, m + j] = S(z, g)
            y[i, j] = S(y, a * _sigmoid(g))


@cuda.jit
def _glu_backward_kernel(z, dy, dz):
    """Thread (i, j < M) reads z[i, j], z[i, M + j] before it writes them (dz may be z)."""
    n, m = dy.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        for j in range(j0, m, sj):
            a, g, d = F(z[i, j]), F(z[i, m + j]), F(dy[i, j])
            s = _sigmoid(g)
            dz[i, j] = S(dz, d * s)
            dz[i, m + j] = S(dz, d * a * s * (ONE - s))


# ---------------------------------------------------------------------------------------------
# depthwise convolution over each utterance's own steps


@cuda.jit
def _depthwise_kernel(x, w, b, y, nb, lengths, left):
    """Thread (row, channel): the bias, then the taps in order j = 0..K-1 (the CPU's sum)."""
    kernel, m = w.shape
    rows = (x.shape[0] // nb) * nb
    c0, r0 = cuda.grid(2)
    sc, sr = cuda.gridsize(2)
    for r in range(r0, rows, sr):
        t = r // nb
        u = r - t * nb
        length = lengths[u]
        for c in range(c0, m, sc):
            if t >= length:
                y[r, c] = S(y, ZERO)
                continue
            acc = F(b[0, c])
            for j in range(kernel):
                src = t - left + j
                if src >= 0 and src < length:
                    acc += mul_rn(F(w[j, c]), F(x[src * nb + u, c]))
            y[r, c] = S(y, acc)


@cuda.jit
def _depthwise_dx_kernel(dy, w, dx, nb, lengths, left):
    """Thread (row, channel) of dx: the taps that read it, in order j = 0..K-1."""
    kernel, m = w.shape
    rows = (dy.shape[0] // nb) * nb
    c0, r0 = cuda.grid(2)
    sc, sr = cuda.gridsize(2)
    for r in range(r0, rows, sr):
        t = r // nb
        u = r - t * nb
        length = lengths[u]
        for c in range(c0, m, sc):
            acc = ZERO
            if t < length:
                for j in range(kernel):
                    at = t + left - j        # the output step whose tap j read step t
                    if at >= 0 and at < length:
                        acc += mul_rn(F(w[j, c]), F(dy[at * nb + u, c]))
            dx[r, c] = S(dx, acc)


@cuda.jit
def _depthwise_grad_kernel(x, dy, nb, lengths, left, gw, gb):
    """Block (column tile, tap j): gw[j] (j < K) or gb (j = K) over every valid row; lane l
    adds rows l, l + SUM_LANES, ... in float64, lane 0 the lanes in order."""
    kernel, m = gw.shape
    rows = (x.shape[0] // nb) * nb
    j = cuda.blockIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    tx, lane = cuda.threadIdx.x, cuda.threadIdx.y
    part = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    acc = 0.0
    if col < m:
        for r in range(lane, rows, SUM_LANES):
            t = r // nb
            u = r - t * nb
            length = lengths[u]
            if t >= length:
                continue
            if j == kernel:
                acc += F(dy[r, col])
            else:
                src = t - left + j
                if src >= 0 and src < length:
                    acc += mul_rn(F(dy[r, col]), F(x[src * nb + u, col]))
    part[lane, tx] = acc
    cuda.syncthreads()
    if lane == 0 and col < m:
        for k in range(1, SUM_LANES):
            acc += part[k, tx]
        if j == kernel:
            gb[0, col] = acc
        else:
            gw[j, col] = acc


# ---------------------------------------------------------------------------------------------
# attention: head-major blocks with the rotary embedding, the masked softmax


@cuda.jit
def _to_heads_kernel(src, col, out, nb, lengths, cos, sin, rotate, scale):
    """Thread (row (u, h, t) of out, value i)."""
    heads, steps, dk = out.shape[1], out.shape[2], out.shape[3]
    half = dk // 2
    rows = out.shape[0] * heads * steps
    i0, r0 = cuda.grid(2)
    si, sr = cuda.gridsize(2)
    for r in range(r0, rows, sr):
        t = r % steps
        h = (r // steps) % heads
        u = r // (steps * heads)
        valid = t < lengths[u]
        row = t * nb + u
        base = col + h * dk
        for i in range(i0, dk, si):
            if not valid:
                out[u, h, t, i] = S(out, ZERO)
            elif rotate:
                k = i if i < half else i - half
                a, b = F(src[row, base + k]), F(src[row, base + half + k])
                c, s = cos[t, k], sin[t, k]
                if i < half:
                    v = mul_rn(a, c) - mul_rn(b, s)
                else:
                    v = mul_rn(b, c) + mul_rn(a, s)
                out[u, h, t, i] = S(out, v * scale)
            else:
                out[u, h, t, i] = S(out, F(src[row, base + i]) * scale)


@cuda.jit
def _from_heads_kernel(blocks, dst, col, nb, lengths, cos, sin, rotate, scale):
    """Thread (row of dst, column h * dk + i of its H * dk)."""
    heads, steps, dk = blocks.shape[1], blocks.shape[2], blocks.shape[3]
    half = dk // 2
    q0, r0 = cuda.grid(2)
    sq, sr = cuda.gridsize(2)
    for r in range(r0, steps * nb, sr):
        t = r // nb
        u = r - t * nb
        valid = t < lengths[u]
        for q in range(q0, heads * dk, sq):
            if not valid:
                dst[r, col + q] = S(dst, ZERO)
                continue
            h = q // dk
            i = q - h * dk
            if rotate:
                k = i if i < half else i - half
                a, b = F(blocks[u, h, t, k]), F(blocks[u, h, t, half + k])
                c, s = cos[t, k], sin[t, k]
                if i < half:
                    v = mul_rn(a, c) + mul_rn(b, s)
                else:
                    v = mul_rn(b, c) - mul_rn(a, s)
                dst[r, col + q] = S(dst, v * scale)
            else:
                dst[r, col + q] = S(dst, F(blocks[u, h, t, i]) * scale)


@cuda.jit
def _masked_softmax_kernel(s, p, lengths):
    """Block k = (u * H + h) * T + t: row t of utterance u's head h. Each thread reads and
    writes only its own keys j, j + T', ... (p may be s); the max and the sum go through
    shared memory, combined by thread 0 in thread order."""
    heads, steps = s.shape[1], s.shape[2]
    k = cuda.blockIdx.x
    t = k % steps
    h = (k // steps) % heads
    u = k // (steps * heads)
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    smax = cuda.shared.array(ROW_THREADS, np.float32)
    ssum = cuda.shared.array(ROW_THREADS, np.float64)
    length = lengths[u]
    if t >= length:                      # uniform per block: no barrier is skipped by some
        for j in range(tid, steps, nt):
            p[u, h, t, j] = S(p, ZERO)
        return
    mx = F(s[u, h, t, 0])
    for j in range(tid, length, nt):
        mx = max(mx, F(s[u, h, t, j]))
    smax[tid] = mx
    cuda.syncthreads()
    if tid == 0:
        for q in range(1, nt):
            smax[0] = max(smax[0], smax[q])
    cuda.syncthreads()
    mx = smax[0]
    total = 0.0
    for j in range(tid, length, nt):
        total += math.exp(F(s[u, h, t, j]) - mx)
    inv = np.float32(1.0 / _row_sum(ssum, total))
    for j in range(tid, steps, nt):
        if j < length:   # the exp again: a 16-bit p could not hold it unrounded
            p[u, h, t, j] = S(p, math.exp(F(s[u, h, t, j]) - mx) * inv)
        else:
            p[u, h, t, j] = S(p, ZERO)


@cuda.jit
def _masked_softmax_backward_kernel(p, dp, ds, lengths):
    """As the forward's blocks: ds = p (dp - sum_j p dp) over the row's valid keys (ds may
    be dp)."""
    heads, steps = p.shape[1], p.shape[2]
    k = cuda.blockIdx.x
    t = k % steps
    h = (k // steps) % heads
    u = k // (steps * heads)
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    ssum = cuda.shared.array(ROW_THREADS, np.float64)
    length = lengths[u]
    if t >= length:
        for j in range(tid, steps, nt):
            ds[u, h, t, j] = S(ds, ZERO)
        return
    dot = 0.0
    for j in range(tid, length, nt):
        dot += mul_rn(F(p[u, h, t, j]), F(dp[u, h, t, j]))
    d = np.float32(_row_sum(ssum, dot))
    for j in range(tid, steps, nt):
        if j < length:
            ds[u, h, t, j] = S(ds, F(p[u, h, t, j]) * (F(dp[u, h, t, j]) - d))
        else:
            ds[u, h, t, j] = S(ds, ZERO)


# ---------------------------------------------------------------------------------------------
# the subsampling front end's 3x3 stride-2 convolutions (padding 1 in time and frequency)


@cuda.jit
def _unfold2d_kernel(x, cols, nb, steps_in, steps_out, f_in, f_out, channels):
    """Thread (cols row, column (i * 3 + j) * C + c): a copy (the storage's bits as they
    are) or 0 outside the input."""
    rows, width = steps_out * nb * f_out, 9 * channels
    q0, r0 = cuda.grid(2)
    sq, sr = cuda.gridsize(2)
    for r in range(r0, rows, sr):
        tb = r // f_out
        f = r - tb * f_out
        t = tb // nb
        u = tb - t * nb
        for q in range(q0, width, sq):
            tap = q // channels
            c = q - tap * channels
            i = tap // 3
            ti = 2 * t - 1 + i
            fi = 2 * f - 1 + (tap - 3 * i)
            if ti >= 0 and ti < steps_in and fi >= 0 and fi < f_in:
                cols[r, q] = x[ti * nb + u, fi * channels + c]
            else:
                cols[r, q] = 0


@cuda.jit
def _fold2d_kernel(dcols, dx, nb, steps_in, steps_out, f_in, f_out, channels):
    """Thread (dx row, column f * C + c): the taps that read it, time tap i outer and
    frequency tap j inner (the CPU's order), summed in float32 and stored once."""
    rows, width = steps_in * nb, f_in * channels
    q0, r0 = cuda.grid(2)
    sq, sr = cuda.gridsize(2)
    for r in range(r0, rows, sr):
        t = r // nb
        u = r - t * nb
        for q in range(q0, width, sq):
            f = q // channels
            c = q - f * channels
            acc = ZERO
            for i in range(3):
                at = t + 1 - i               # = 2 t' when tap i of output step t' reads t
                if at < 0 or at % 2 or at // 2 >= steps_out:
                    continue
                for j in range(3):
                    af = f + 1 - j
                    if af < 0 or af % 2 or af // 2 >= f_out:
                        continue
                    acc += F(dcols[((at // 2) * nb + u) * f_out + af // 2,
                                   (i * 3 + j) * channels + c])
            dx[r, q] = S(dx, acc)


# ---------------------------------------------------------------------------------------------
# host-side wrappers (the CPU kernels' arguments; device arrays)


def _launch2(n, m):
    return on_stream(_elem_launch(n, m))


def add_scaled(x, o, s, out):
    """out (R, M) = x + s * o (out may be x)."""
    x, o, out = as_device(x), as_device(o), as_device(out)
    n, m = x.shape
    if n and m:
        _add_scaled_kernel[_launch2(n, m)](x, o, np.float32(s), out)


def add_bias(z, b):
    z = as_device(z)
    n, m = z.shape
    if n and m:
        _add_bias_kernel[_launch2(n, m)](z, as_device(b))


def swish_forward(z, y):
    z, y = as_device(z), as_device(y)
    n, m = z.shape
    if n and m:
        _swish_kernel[_launch2(n, m)](z, y)


def bias_swish(z, b, y):
    z, y = as_device(z), as_device(y)
    n, m = z.shape
    if n and m:
        _bias_swish_kernel[_launch2(n, m)](z, as_device(b), y)


def swish_backward(z, dy, dz):
    z, dy, dz = as_device(z), as_device(dy), as_device(dz)
    n, m = z.shape
    if n and m:
        _swish_backward_kernel[_launch2(n, m)](z, dy, dz)


def bias_glu(z, b, y):
    z, y = as_device(z), as_device(y)
    n, m = y.shape
    if n and m:
        _bias_glu_kernel[_launch2(n, m)](z, as_device(b), y)


def glu_backward(z, dy, dz):
    z, dy, dz = as_device(z), as_device(dy), as_device(dz)
    n, m = dy.shape
    if n and m:
        _glu_backward_kernel[_launch2(n, m)](z, dy, dz)


def depthwise_forward(x, w, b, y, nb, lengths, left):
    """y (T*nb, M) <- the depthwise convolution of x; lengths (nb,) int64 device array."""
    x, y = as_device(x), as_device(y)
    rows, m = (x.shape[0] // nb) * nb if nb else 0, x.shape[1]
    if rows and m:
        _depthwise_kernel[_launch2(rows, m)](x, as_device(w), as_device(b), y, nb,
                                             as_device(lengths), left)


def depthwise_backward(x, dy, w, dx, gw, gb, nb, lengths, left):
    """dx (T*nb, M) <- dLoss/dx (0 on the padding); gw (K, M), gb (1, M) <- the taps' and
    bias's gradients, each a float64 sum in a fixed order rounded once. dx must not be dy."""
    x, dy, dx, gw, gb = (as_device(a) for a in (x, dy, dx, gw, gb))
    kernel, m = gw.shape
    rows = (x.shape[0] // nb) * nb if nb else 0
    if not m:
        return
    if not rows:
        fill(gw, 0)
        fill(gb, 0)
        return
    lengths = as_device(lengths)
    _depthwise_dx_kernel[_launch2(rows, m)](dy, as_device(w), dx, nb, lengths, left)
    blocks, block = column_sums_launch(m)
    _depthwise_grad_kernel[on_stream(((blocks, kernel + 1), block))](x, dy, nb, lengths, left,
                                                                     gw, gb)


def to_heads(src, col, out, nb, heads, lengths, cos, sin, rotate, scale):
    """out (nb, H, T, dk) <- src[:, col:col + H*dk] per utterance and head (rotary when
    rotate), times scale; 0 past each utterance's end. cos, sin (>= T, dk/2) float32."""
    src, out = as_device(src), as_device(out)
    rows, dk = out.shape[0] * heads * out.shape[2], out.shape[3]
    if rows and dk:
        _to_heads_kernel[_launch2(rows, dk)](src, col, out, nb, as_device(lengths),
                                             as_device(cos), as_device(sin), bool(rotate),
                                             np.float32(scale))


def from_heads(blocks, dst, col, nb, lengths, cos, sin, rotate, scale):
    """dst[:, col:col + H*dk] <- blocks laid back time-major (the rotation undone when
    rotate), times scale; the padding rows' columns 0."""
    blocks, dst = as_device(blocks), as_device(dst)
    rows, width = blocks.shape[2] * nb, blocks.shape[1] * blocks.shape[3]
    if rows and width:
        _from_heads_kernel[_launch2(rows, width)](blocks, dst, col, nb, as_device(lengths),
                                                  as_device(cos), as_device(sin),
                                                  bool(rotate), np.float32(scale))


def masked_softmax(s, p, lengths):
    """p (nb, H, T, T) <- the softmax of s over each utterance's valid keys (p may be s)."""
    s, p = as_device(s), as_device(p)
    rows, steps = s.shape[0] * s.shape[1] * s.shape[2], s.shape[3]
    if rows and steps:
        _masked_softmax_kernel[on_stream((rows, row_threads(steps)))](s, p, as_device(lengths))


def masked_softmax_backward(p, dp, ds, lengths):
    """ds <- p * (dp - sum_j p dp) over each row's valid keys, 0 elsewhere (ds may be dp)."""
    p, dp, ds = as_device(p), as_device(dp), as_device(ds)
    rows, steps = p.shape[0] * p.shape[1] * p.shape[2], p.shape[3]
    if rows and steps:
        _masked_softmax_backward_kernel[on_stream((rows, row_threads(steps)))](
            p, dp, ds, as_device(lengths))


def unfold2d(x, cols, nb, steps_in, steps_out, f_in, f_out, channels):
    """cols ((steps_out*nb)*f_out, 9*channels) <- every output position's 3x3 patch of x."""
    x, cols = as_device(x), as_device(cols)
    rows = steps_out * nb * f_out
    if rows and channels:
        _unfold2d_kernel[_launch2(rows, 9 * channels)](x, cols, nb, steps_in, steps_out, f_in,
                                                       f_out, channels)


def fold2d(dcols, dx, nb, steps_in, steps_out, f_in, f_out, channels):
    """dx (steps_in*nb, f_in*channels) <- unfold2d's adjoint of dcols."""
    dcols, dx = as_device(dcols), as_device(dx)
    rows = steps_in * nb
    if rows and f_in * channels:
        _fold2d_kernel[_launch2(rows, f_in * channels)](dcols, dx, nb, steps_in, steps_out,
                                                        f_in, f_out, channels)
