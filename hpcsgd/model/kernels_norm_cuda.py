"""CUDA counterparts of hpcsgd.model.kernels_norm: layer and instance normalization with their
activation (or none: kernels.IDENTITY, the Conformer's norms; its gradient passes dy through
kernels_cuda._act_grad), for GPU ranks. Wrappers take Numba device arrays (or any __cuda_array_interface__ array) and
launch on the compute stream without synchronizing.

- The row statistics (_stats): one block per row, row_threads(M) threads (kernels_cuda); each
  thread adds its columns t, t + T, ... in float64, thread 0 adds the threads' partials in
  order (kernels_cuda._row_sum), once for the mean and once for the squared deviations.
- forward: that block then writes its row of y.
- backward: the statistics kernel leaves every row's (mean, 1/std) in a float32 scratch; a
  column pass (kernels_cuda's column-sum layout) sums dh and dh * xh into dbeta and dgamma;
  then a row pass (one block per row) sums the row's g and g * xh and writes dz, which may be
  y: that pass reads y only in the columns each thread writes, and the column pass has ended.

- instance norm: a (column tile, sequence) block per tile of channels of a sequence, its
  lanes over the sequence's steps (kernels_cuda's column-sum layout restricted to the
  sequence's rows), for the statistics and the backward's four sums (a float64 scratch per
  sequence, nb x 6 x M); the parameter gradients add those sequences' partials in order; the
  forward's output and the input gradient are element-wise kernels over the rows.

The same float32 arithmetic as the CPU kernels, every product that an add follows rounded on
its own (device.mul_rn: no FMA contraction), so CPU and GPU differ only where a float64 sum,
added in another order, rounds to another float32 (and in expf for sigmoid): within the bound
tests/test_norm.py derives, not bit for bit. No atomics: the GPU's own results are
bit-reproducible. 16-bit storage (float16; uint16 bfloat16 bits): loads widened with F, stores
through S, as kernels_cuda says; the statistics stay float32.
"""
import math

import numpy as np

from hpcsgd.device import as_device, fill, mul_rn, on_stream
from hpcsgd.half import stored as S
from hpcsgd.half import widen as F
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model.kernels import IDENTITY, SIGMOID
from hpcsgd.model.kernels_cuda import (COL_TILE, ROW_THREADS, SUM_LANES, _act_grad,
                                       _elem_launch, _row_sum, _sum_lanes, column_sums_launch,
                                       row_threads)
from hpcsgd.model.kernels_norm import EPS

ONE, ZERO = np.float32(1), np.float32(0)


@cuda.jit(device=True)
def _stats(z, i, p1, p2):
    """(mean, 1 / sqrt(variance + EPS)) of row i as float32, to every thread of the block."""
    m = z.shape[1]
    s = 0.0
    for j in range(cuda.threadIdx.x, m, cuda.blockDim.x):
        s += F(z[i, j])
    mean = _row_sum(p1, s) / m
    v = 0.0
    for j in range(cuda.threadIdx.x, m, cuda.blockDim.x):
        d = F(z[i, j]) - mean
        v += d * d
    var = _row_sum(p2, v) / m
    return np.float32(mean), np.float32(1.0 / math.sqrt(var + EPS))


@cuda.jit
def _forward_kernel(z, gamma, beta, y, kind):
    i = cuda.blockIdx.x
    p1 = cuda.shared.array(ROW_THREADS, np.float64)
    p2 = cuda.shared.array(ROW_THREADS, np.float64)
    mean, rstd = _stats(z, i, p1, p2)
    for j in range(cuda.threadIdx.x, z.shape[1], cuda.blockDim.x):
        h = mul_rn(F(gamma[0, j]), mul_rn(F(z[i, j]) - mean, rstd)) + F(beta[0, j])
        if kind == SIGMOID:
            y[i, j] = S(y, ONE / (ONE + math.exp(-h)))
        elif kind == IDENTITY:
            y[i, j] = S(y, h)
        else:
            y[i, j] = S(y, max(h, ZERO))


@cuda.jit
def _stats_kernel(z, stats):
    i = cuda.blockIdx.x
    p1 = cuda.shared.array(ROW_THREADS, np.float64)
    p2 = cuda.shared.array(ROW_THREADS, np.float64)
    mean, rstd = _stats(z, i, p1, p2)
    if cuda.threadIdx.x == 0:
        stats[i, 0] = mean
        stats[i, 1] = rstd


@cuda.jit
def _param_sums_kernel(z, y, dy, stats, ggamma, gbeta, kind):
    n, m = z.shape
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    pg = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    pb = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    ag, ab = 0.0, 0.0
    if col < m:
        for i in range(cuda.threadIdx.y, n, SUM_LANES):
            dh = _act_grad(F(y[i, col]), F(dy[i, col]), kind)
            xh = mul_rn(F(z[i, col]) - stats[i, 0], stats[i, 1])
            ab += dh
            ag += mul_rn(dh, xh)
    _sum_lanes(pg, ag, ggamma, col, m)
    _sum_lanes(pb, ab, gbeta, col, m)


@cuda.jit
def _backward_kernel(z, y, dy, gamma, stats, dz, kind):
    i = cuda.blockIdx.x
    m = z.shape[1]
    p1 = cuda.shared.array(ROW_THREADS, np.float64)
    p2 = cuda.shared.array(ROW_THREADS, np.float64)
    mean, rstd = stats[i, 0], stats[i, 1]
    s1, s2 = 0.0, 0.0
    for j in range(cuda.threadIdx.x, m, cuda.blockDim.x):
        g = mul_rn(F(gamma[0, j]), _act_grad(F(y[i, j]), F(dy[i, j]), kind))
        s1 += g
        s2 += mul_rn(g, mul_rn(F(z[i, j]) - mean, rstd))
    m1 = np.float32(_row_sum(p1, s1) / m)
    m2 = np.float32(_row_sum(p2, s2) / m)
    for j in range(cuda.threadIdx.x, m, cuda.blockDim.x):
        xh = mul_rn(F(z[i, j]) - mean, rstd)
        g = mul_rn(F(gamma[0, j]), _act_grad(F(y[i, j]), F(dy[i, j]), kind))
        dz[i, j] = S(dz, mul_rn(rstd, (g - m1) - mul_rn(xh, m2)))


def layer_norm_forward(z, gamma, beta, y, kind):
    """y (N, M) <- f(gamma * (z - mean) / std + beta) row by row (kernels_norm's forward)."""
    z, y = as_device(z), as_device(y)
    n, m = z.shape
    if n and m:
        _forward_kernel[on_stream((n, row_threads(m)))](z, as_device(gamma), as_device(beta),
                                                         y, kind)


def layer_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, stats, kind):
    """dz (may be y) <- dLoss/dz; ggamma, gbeta (1, M) <- their gradients; stats a float32
    (>= N, 2) device scratch (kernels_norm's backward)."""
    z, y, dy, dz = as_device(z), as_device(y), as_device(dy), as_device(dz)
    n, m = z.shape
    if not m:
        return
    if not n:
        fill(as_device(ggamma), 0)
        fill(as_device(gbeta), 0)
        return
    _stats_kernel[on_stream((n, row_threads(m)))](z, stats)
    _param_sums_kernel[on_stream(column_sums_launch(m))](z, y, dy, stats, as_device(ggamma),
                                                         as_device(gbeta), kind)
    _backward_kernel[on_stream((n, row_threads(m)))](z, y, dy, as_device(gamma), stats, dz,
                                                      kind)


# ---------------------------------------------------------------------------------------------
# instance norm


@cuda.jit(device=True)
def _lane_sum(part, acc):
    """The block's lanes' float64 partials of each column, added by lane 0 in lane order,
    returned to lane 0 (the others get their own)."""
    tx, lane = cuda.threadIdx.x, cuda.threadIdx.y
    part[lane, tx] = acc
    cuda.syncthreads()
    if lane == 0:
        for k in range(1, SUM_LANES):
            acc += part[k, tx]
    cuda.syncthreads()   # part may be written again
    return acc


@cuda.jit
def _in_stats_kernel(z, nb, lengths, st):
    """st[b, 0], st[b, 1] <- each channel's mean and 1/std over sequence b's steps."""
    m = z.shape[1]
    b = cuda.blockIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    tx, lane = cuda.threadIdx.x, cuda.threadIdx.y
    part = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    means = cuda.shared.array(COL_TILE, np.float64)
    length = lengths[b]
    n = max(length, 1)
    s = 0.0
    if col < m:
        for t in range(lane, length, SUM_LANES):
            s += F(z[t * nb + b, col])
    s = _lane_sum(part, s)
    if lane == 0:
        means[tx] = s / n
    cuda.syncthreads()
    mean = means[tx]
    v = 0.0
    if col < m:
        for t in range(lane, length, SUM_LANES):
            d = F(z[t * nb + b, col]) - mean
            v += d * d
    v = _lane_sum(part, v)
    if lane == 0 and col < m:
        st[b, 0, col] = np.float32(mean)
        st[b, 1, col] = np.float32(1.0 / math.sqrt(v / n + EPS))


@cuda.jit
def _in_forward_kernel(z, gamma, beta, y, nb, lengths, st, kind):
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        t = i // nb
        b = i - t * nb
        valid = t < lengths[b]
        for j in range(j0, m, sj):
            if not valid:
                y[i, j] = S(y, ZERO)
                continue
            xh = mul_rn(F(z[i, j]) - np.float32(st[b, 0, j]), np.float32(st[b, 1, j]))
            h = mul_rn(F(gamma[0, j]), xh) + F(beta[0, j])
            if kind == SIGMOID:
                y[i, j] = S(y, ONE / (ONE + math.exp(-h)))
            elif kind == IDENTITY:
                y[i, j] = S(y, h)
            else:
                y[i, j] = S(y, max(h, ZERO))


@cuda.jit
def _in_sums_kernel(z, y, dy, gamma, nb, lengths, st, kind):
    """st[b, 2..5] <- sums over sequence b's steps of g, g * xh, dh * xh and dh."""
    m = z.shape[1]
    b = cuda.blockIdx.y
    col = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    lane = cuda.threadIdx.y
    part = cuda.shared.array((SUM_LANES, COL_TILE), np.float64)
    s1, s2, s3, s4 = 0.0, 0.0, 0.0, 0.0
    if col < m:
        mean, rstd = np.float32(st[b, 0, col]), np.float32(st[b, 1, col])
        for t in range(lane, lengths[b], SUM_LANES):
            i = t * nb + b
            dh = _act_grad(F(y[i, col]), F(dy[i, col]), kind)
            xh = mul_rn(F(z[i, col]) - mean, rstd)
            g = mul_rn(F(gamma[0, col]), dh)
            s1 += g
            s2 += mul_rn(g, xh)
            s3 += mul_rn(dh, xh)
            s4 += dh
    s1 = _lane_sum(part, s1)
    s2 = _lane_sum(part, s2)
    s3 = _lane_sum(part, s3)
    s4 = _lane_sum(part, s4)
    if lane == 0 and col < m:
        st[b, 2, col] = s1
        st[b, 3, col] = s2
        st[b, 4, col] = s3
        st[b, 5, col] = s4


@cuda.jit
def _in_param_sums_kernel(st, nb, ggamma, gbeta):
    col = cuda.grid(1)
    if col < ggamma.shape[1]:
        ag, ab = 0.0, 0.0
        for b in range(nb):
            ag += st[b, 4, col]
            ab += st[b, 5, col]
        ggamma[0, col] = ag
        gbeta[0, col] = ab


@cuda.jit
def _in_backward_kernel(z, y, dy, gamma, nb, lengths, st, dz, kind):
    n, m = z.shape
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, n, si):
        t = i // nb
        b = i - t * nb
        length = lengths[b]
        count = max(length, 1)
        for j in range(j0, m, sj):
            if t >= length:
                dz[i, j] = S(dz, ZERO)
                continue
            rstd = np.float32(st[b, 1, j])
            xh = mul_rn(F(z[i, j]) - np.float32(st[b, 0, j]), rstd)
            g = mul_rn(F(gamma[0, j]), _act_grad(F(y[i, j]), F(dy[i, j]), kind))
            m1 = np.float32(st[b, 2, j] / count)
            m2 = np.float32(st[b, 3, j] / count)
            dz[i, j] = S(dz, mul_rn(rstd, (g - m1) - mul_rn(xh, m2)))


def _per_sequence_launch(m, nb):
    blocks, block = column_sums_launch(m)
    return (blocks, nb), block


def instance_norm_forward(z, gamma, beta, y, kind, nb, lengths, st):
    """y (steps*nb, M) <- each sequence's channels normalized over its steps, the padding 0
    (kernels_norm's instance_norm_forward); lengths (nb,) int64 and st (>= nb, 6, >= M)
    float64 device arrays."""
    z, y = as_device(z), as_device(y)
    n, m = z.shape
    if not (n and m and nb):
        return
    _in_stats_kernel[on_stream(_per_sequence_launch(m, nb))](z, nb, lengths, st)
    _in_forward_kernel[on_stream(_elem_launch(n, m))](z, as_device(gamma), as_device(beta), y,
                                                      nb, lengths, st, kind)


def instance_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, kind, nb, lengths, st):
    """dz (may be y) <- dLoss/dz, 0 on the padding; ggamma, gbeta <- their gradients."""
    z, y, dy, dz = as_device(z), as_device(y), as_device(dy), as_device(dz)
    ggamma, gbeta, gamma = as_device(ggamma), as_device(gbeta), as_device(gamma)
    n, m = z.shape
    if not m:
        return
    if not (n and nb):
        fill(ggamma, 0)
        fill(gbeta, 0)
        return
    launch = on_stream(_per_sequence_launch(m, nb))
    _in_stats_kernel[launch](z, nb, lengths, st)
    _in_sums_kernel[launch](z, y, dy, gamma, nb, lengths, st, kind)
    threads = min(128, m)
    _in_param_sums_kernel[on_stream((-(-m // threads), threads))](st, nb, ggamma, gbeta)
    _in_backward_kernel[on_stream(_elem_launch(n, m))](z, y, dy, gamma, nb, lengths, st, dz,
                                                       kind)
