"""Layer normalization over a row's channels with the activation after it (Ba et al. 2016):
the normalization of a convolution's output in the all-convolutional CTC recipe (Wave2Letter+
uses batch norm there; docs/ctc.md says why hpcsgd normalizes each frame instead). Numba CPU
kernels and the NumPy references they are tested against; the CUDA twins are in
hpcsgd.model.kernels_norm_cuda.

Shape key: N rows (frames), M channels; gamma, beta (1, M); C = kernels.NCHUNK.

    forward   mu_i = mean_j z_ij, r_i = 1 / sqrt(mean_j (z_ij - mu_i)^2 + EPS)
              xh_ij = (z_ij - mu_i) r_i,  y_ij = f(gamma_j xh_ij + beta_j)
    backward  dh = dy f'(y);  g = gamma dh;  dbeta_j = sum_i dh_ij,  dgamma_j = sum_i dh_ij xh_ij
              dz_ij = r_i (g_ij - mean_j g_ij - xh_ij mean_j(g_ij xh_ij))

The row statistics are float64 sums (two passes: the mean, then the squared deviations),
rounded once to the array's dtype; the element-wise steps run in the dtype. The backward
recomputes the statistics from z (the GEMM's output, kept by the layer) with the same code as
the forward, so it sees the same bits, and nothing per row is stored between the passes. The
column sums split the rows into C fixed chunks of float64 partials added in order: the same
bits whatever the number of threads. A constant row (padding: zeros) has variance 0: xh = 0,
y = f(beta), and 1/std = 1/sqrt(EPS) keeps its gradient finite.
"""
import math

import numpy as np
from numba import njit, prange

from hpcsgd.model.kernels import NCHUNK, RELU, SIGMOID

EPS = 1e-5   # PyTorch's nn.LayerNorm default


@njit(inline="always")
def row_stats(z, i):
    """(mean, 1 / sqrt(variance + EPS)) of row i, float64 sums rounded to z's dtype."""
    m = z.shape[1]
    s = 0.0
    for j in range(m):
        s += z[i, j]
    mean = s / m
    v = 0.0
    for j in range(m):
        d = z[i, j] - mean
        v += d * d
    t = z.dtype.type
    return t(mean), t(1.0 / math.sqrt(v / m + EPS))


@njit(parallel=True, cache=True)
def layer_norm_forward(z, gamma, beta, y, kind):
    """y (N, M) <- f(gamma * (z - mu) * r + beta) row by row; y may be z."""
    n, m = z.shape
    zero, one = z.dtype.type(0), z.dtype.type(1)
    for i in prange(n):
        mean, rstd = row_stats(z, i)
        if kind == RELU:
            for j in range(m):
                y[i, j] = max(gamma[0, j] * ((z[i, j] - mean) * rstd) + beta[0, j], zero)
        else:
            for j in range(m):
                h = gamma[0, j] * ((z[i, j] - mean) * rstd) + beta[0, j]
                y[i, j] = one / (one + math.exp(-h))


@njit(inline="always")
def _act_grad(yv, dv, kind, zero, one):
    if kind == SIGMOID:
        return dv * (yv * (one - yv))
    return dv if yv > zero else zero


@njit(parallel=True, cache=True)
def layer_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, partial, kind):
    """dz (N, M) <- dLoss/dz from the forward's input z and output y and dy = dLoss/dy (dz may
    be y: each element is read before it is written); ggamma, gbeta (1, M) <- the column sums
    of dh * xh and dh. partial (2, C, >= M) float64 scratch."""
    n, m = z.shape
    zero, one = z.dtype.type(0), z.dtype.type(1)
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        pg, pb = partial[0, c], partial[1, c]
        pg[:m] = 0
        pb[:m] = 0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            mean, rstd = row_stats(z, i)
            s1, s2 = 0.0, 0.0
            for j in range(m):
                dh = _act_grad(y[i, j], dy[i, j], kind, zero, one)
                xh = (z[i, j] - mean) * rstd
                g = gamma[0, j] * dh
                s1 += g
                s2 += g * xh
                pb[j] += dh
                pg[j] += dh * xh
            t = z.dtype.type
            m1, m2 = t(s1 / m), t(s2 / m)
            for j in range(m):
                xh = (z[i, j] - mean) * rstd
                g = gamma[0, j] * _act_grad(y[i, j], dy[i, j], kind, zero, one)
                dz[i, j] = rstd * (g - m1 - xh * m2)
    for j in prange(m):                  # the C partials, added in a fixed order
        ag, ab = partial[0, 0, j], partial[1, 0, j]
        for c in range(1, NCHUNK):
            ag += partial[0, c, j]
            ab += partial[1, c, j]
        ggamma[0, j] = ag
        gbeta[0, j] = ab


# ---------------------------------------------------------------------------------------------
# NumPy references (float64)


def ref_layer_norm(z, gamma, beta, kind):
    """y (N, M) float64: the module docstring's forward."""
    z = np.asarray(z, np.float64)
    xh = (z - z.mean(1, keepdims=True)) / np.sqrt(z.var(1, keepdims=True) + EPS)
    h = np.asarray(gamma, np.float64) * xh + np.asarray(beta, np.float64)
    return np.maximum(h, 0) if kind == RELU else 1 / (1 + np.exp(-h))


def ref_layer_norm_backward(z, gamma, beta, dy, kind):
    """(dz, dgamma (1, M), dbeta (1, M)) float64: the module docstring's backward."""
    z, dy = np.asarray(z, np.float64), np.asarray(dy, np.float64)
    gamma = np.asarray(gamma, np.float64)
    r = 1 / np.sqrt(z.var(1, keepdims=True) + EPS)
    xh = (z - z.mean(1, keepdims=True)) * r
    y = ref_layer_norm(z, gamma, beta, kind)
    dh = dy * (y > 0) if kind == RELU else dy * y * (1 - y)
    g = gamma * dh
    dz = r * (g - g.mean(1, keepdims=True) - xh * (g * xh).mean(1, keepdims=True))
    return dz, (dh * xh).sum(0, keepdims=True), dh.sum(0, keepdims=True)
