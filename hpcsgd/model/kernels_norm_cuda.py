"""CUDA counterparts of hpcsgd.model.kernels_norm: layer normalization with its activation, for
GPU ranks. Wrappers take Numba device arrays (or any __cuda_array_interface__ array) and
launch on the compute stream without synchronizing.

- The row statistics (_stats): one block per row, row_threads(M) threads (kernels_cuda); each
  thread adds its columns t, t + T, ... in float64, thread 0 adds the threads' partials in
  order (kernels_cuda._row_sum), once for the mean and once for the squared deviations.
- forward: that block then writes its row of y.
- backward: the statistics kernel leaves every row's (mean, 1/std) in a float32 scratch; a
  column pass (kernels_cuda's column-sum layout) sums dh and dh * xh into dbeta and dgamma;
  then a row pass (one block per row) sums the row's g and g * xh and writes dz, which may be
  y: that pass reads y only in the columns each thread writes, and the column pass has ended.

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
from hpcsgd.model.kernels import SIGMOID
from hpcsgd.model.kernels_cuda import (COL_TILE, ROW_THREADS, SUM_LANES, _act_grad, _row_sum,
                                       _sum_lanes, column_sums_launch, row_threads)
from hpcsgd.model.kernels_norm import EPS

ONE = np.float32(1)


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
        else:
            y[i, j] = S(y, max(h, np.float32(0)))


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
