"""The normalizations of a convolution's output, each with the activation after it (or none:
kernels.IDENTITY, the Conformer's layer norms before each module and after its depthwise
convolution, hpcsgd.model.conformer): layer
normalization over a row's channels (Ba et al. 2016: `conv ... ln`) and instance normalization
of each channel over a sequence's steps (Ulyanov et al. 2016: `conv ... in`, batch norm's
statistics taken over one utterance instead of the global batch; docs/ctc.md says why hpcsgd
has no batch norm). Numba CPU kernels and the NumPy references they are tested against; the
CUDA twins are in hpcsgd.model.kernels_norm_cuda.

Shape key: N rows (frames), M channels; gamma, beta (1, M); C = kernels.NCHUNK.

    forward   mu_i = mean_j z_ij, r_i = 1 / sqrt(mean_j (z_ij - mu_i)^2 + EPS)
              xh_ij = (z_ij - mu_i) r_i,  y_ij = f(gamma_j xh_ij + beta_j)
    backward  dh = dy f'(y);  g = gamma dh;  dbeta_j = sum_i dh_ij,  dgamma_j = sum_i dh_ij xh_ij
              dz_ij = r_i (g_ij - mean_j g_ij - xh_ij mean_j(g_ij xh_ij))

Instance norm is the same algebra with the roles turned: the statistics of channel c of
sequence b over its L_b valid steps (time-major rows t*nb + b, t < L_b), the means in the
backward over those steps; the padding rows' outputs and input gradients are 0. Its CPU
kernels run a sequence per thread, channels innermost (unit stride), its parameter sums a
float64 partial per sequence added in sequence order.

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

from hpcsgd.model.kernels import IDENTITY, NCHUNK, RELU, SIGMOID

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
        elif kind == IDENTITY:
            for j in range(m):
                y[i, j] = gamma[0, j] * ((z[i, j] - mean) * rstd) + beta[0, j]
        else:
            for j in range(m):
                h = gamma[0, j] * ((z[i, j] - mean) * rstd) + beta[0, j]
                y[i, j] = one / (one + math.exp(-h))


@njit(inline="always")
def _act_grad(yv, dv, kind, zero, one):
    if kind == SIGMOID:
        return dv * (yv * (one - yv))
    if kind == IDENTITY:
        return dv
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
# instance norm: scratch (nb, 6, >= M) float64 per sequence: its channels' mean and 1/std (as
# the dtype rounds them), then the backward's sums of g, g * xh, dh * xh and dh


@njit(inline="always")
def seq_stats(z, b, nb, length, st):
    """st[0], st[1] <- the mean and 1/sqrt(variance + EPS) of each channel of sequence b
    over its `length` steps, float64 sums rounded to z's dtype (0 and 1/sqrt(EPS) if empty)."""
    m = z.shape[1]
    t_ = z.dtype.type
    for c in range(m):
        st[0, c] = 0.0
        st[1, c] = 0.0
    for t in range(length):
        row = z[t * nb + b]
        for c in range(m):
            st[0, c] += row[c]
    n = max(length, 1)
    for c in range(m):
        st[0, c] = st[0, c] / n          # the float64 mean, for the deviations
    for t in range(length):
        row = z[t * nb + b]
        for c in range(m):
            d = row[c] - st[0, c]
            st[1, c] += d * d
    for c in range(m):
        st[1, c] = t_(1.0 / math.sqrt(st[1, c] / n + EPS))
        st[0, c] = t_(st[0, c])


@njit(parallel=True, cache=True)
def instance_norm_forward(z, gamma, beta, y, kind, nb, lengths, scratch):
    """y <- f(gamma * (z - mean) / std + beta), each sequence's channels over its steps;
    the padding rows 0. z, y (steps*nb, M) time-major; lengths (nb,)."""
    m = z.shape[1]
    steps = z.shape[0] // nb if nb else 0
    zero, one = z.dtype.type(0), z.dtype.type(1)
    for b in prange(nb):
        st = scratch[b]
        length = lengths[b]
        seq_stats(z, b, nb, length, st)
        for t in range(steps):
            r = t * nb + b
            if t >= length:
                for c in range(m):
                    y[r, c] = zero
            elif kind == RELU:
                for c in range(m):
                    xh = (z[r, c] - z.dtype.type(st[0, c])) * z.dtype.type(st[1, c])
                    y[r, c] = max(gamma[0, c] * xh + beta[0, c], zero)
            elif kind == IDENTITY:
                for c in range(m):
                    xh = (z[r, c] - z.dtype.type(st[0, c])) * z.dtype.type(st[1, c])
                    y[r, c] = gamma[0, c] * xh + beta[0, c]
            else:
                for c in range(m):
                    xh = (z[r, c] - z.dtype.type(st[0, c])) * z.dtype.type(st[1, c])
                    y[r, c] = one / (one + math.exp(-(gamma[0, c] * xh + beta[0, c])))


@njit(parallel=True, cache=True)
def instance_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, kind, nb, lengths, scratch):
    """dz (may be y) <- dLoss/dz, 0 on the padding; ggamma, gbeta (1, M) <- the sums of
    dh * xh and dh over every valid row, a float64 partial per sequence added in order."""
    m = z.shape[1]
    steps = z.shape[0] // nb if nb else 0
    zero, one = z.dtype.type(0), z.dtype.type(1)
    t_ = z.dtype.type
    for b in prange(nb):
        st = scratch[b]
        length = lengths[b]
        seq_stats(z, b, nb, length, st)
        for k in range(2, 6):
            for c in range(m):
                st[k, c] = 0.0
        for t in range(length):
            r = t * nb + b
            for c in range(m):
                dh = _act_grad(y[r, c], dy[r, c], kind, zero, one)
                xh = (z[r, c] - t_(st[0, c])) * t_(st[1, c])
                g = gamma[0, c] * dh
                st[2, c] += g
                st[3, c] += g * xh
                st[4, c] += dh * xh
                st[5, c] += dh
        n = max(length, 1)
        for t in range(steps):
            r = t * nb + b
            if t >= length:
                for c in range(m):
                    dz[r, c] = zero
                continue
            for c in range(m):
                xh = (z[r, c] - t_(st[0, c])) * t_(st[1, c])
                g = gamma[0, c] * _act_grad(y[r, c], dy[r, c], kind, zero, one)
                dz[r, c] = t_(st[1, c]) * (g - t_(st[2, c] / n) - xh * t_(st[3, c] / n))
    for c in prange(m):
        ag, ab = 0.0, 0.0
        for b in range(nb):
            ag += scratch[b, 4, c]
            ab += scratch[b, 5, c]
        ggamma[0, c] = ag
        gbeta[0, c] = ab


# ---------------------------------------------------------------------------------------------
# NumPy references (float64)


def ref_layer_norm(z, gamma, beta, kind):
    """y (N, M) float64: the module docstring's forward."""
    z = np.asarray(z, np.float64)
    xh = (z - z.mean(1, keepdims=True)) / np.sqrt(z.var(1, keepdims=True) + EPS)
    h = np.asarray(gamma, np.float64) * xh + np.asarray(beta, np.float64)
    if kind == IDENTITY:
        return h
    return np.maximum(h, 0) if kind == RELU else 1 / (1 + np.exp(-h))


def _ref_act_grad(y, dy, kind):
    """dLoss/dh float64 from the output y = f(h)."""
    if kind == IDENTITY:
        return dy
    return dy * (y > 0) if kind == RELU else dy * y * (1 - y)


def ref_layer_norm_backward(z, gamma, beta, dy, kind):
    """(dz, dgamma (1, M), dbeta (1, M)) float64: the module docstring's backward."""
    z, dy = np.asarray(z, np.float64), np.asarray(dy, np.float64)
    gamma = np.asarray(gamma, np.float64)
    r = 1 / np.sqrt(z.var(1, keepdims=True) + EPS)
    xh = (z - z.mean(1, keepdims=True)) * r
    y = ref_layer_norm(z, gamma, beta, kind)
    dh = _ref_act_grad(y, dy, kind)
    g = gamma * dh
    dz = r * (g - g.mean(1, keepdims=True) - xh * (g * xh).mean(1, keepdims=True))
    return dz, (dh * xh).sum(0, keepdims=True), dh.sum(0, keepdims=True)


def _by_sequence(a, nb, lengths):
    """[(rows of sequence b's valid steps in the time-major a)] for b in 0..nb-1."""
    return [np.arange(int(n)) * nb + b for b, n in enumerate(lengths)]


def ref_instance_norm(z, gamma, beta, kind, nb, lengths):
    """y float64: each sequence's channels normalized over its valid steps; padding 0."""
    z = np.asarray(z, np.float64)
    y = np.zeros_like(z)
    for rows in _by_sequence(z, nb, lengths):
        if len(rows):
            y[rows] = ref_layer_norm(z[rows].T, gamma.T, beta.T, kind).T
    return y


def ref_instance_norm_backward(z, gamma, beta, dy, kind, nb, lengths, y=None):
    """(dz, dgamma, dbeta) float64; the activation's derivative from y if given (else from
    the float64 forward)."""
    z, dy = np.asarray(z, np.float64), np.asarray(dy, np.float64)
    y = ref_instance_norm(z, gamma, beta, kind, nb, lengths) if y is None \
        else np.asarray(y, np.float64)
    dz = np.zeros_like(z)
    dgamma, dbeta = np.zeros((1, z.shape[1])), np.zeros((1, z.shape[1]))
    for rows in _by_sequence(z, nb, lengths):
        if not len(rows):
            continue
        zs = z[rows]
        r = 1 / np.sqrt(zs.var(0, keepdims=True) + EPS)
        xh = (zs - zs.mean(0, keepdims=True)) * r
        dh = _ref_act_grad(y[rows], dy[rows], kind)
        g = np.asarray(gamma, np.float64) * dh
        dz[rows] = r * (g - g.mean(0, keepdims=True) - xh * (g * xh).mean(0, keepdims=True))
        dgamma += (dh * xh).sum(0, keepdims=True)
        dbeta += dh.sum(0, keepdims=True)
    return dz, dgamma, dbeta
