"""Kernels of the sequence layers over time-major batches (hpcsgd.model.lengths): the 1-D
convolution's unfolding of frames into GEMM rows and its adjoint, and the mask that zeroes
the padding of sequences shorter than the batch. Numba CPU kernels and the NumPy references
they are tested against; the CUDA twins are in hpcsgd.model.kernels_cuda.

Shape key: nb = sequences, T = input steps, T' = output steps, C = input channels (the
layer's n_in), k = kernel taps, s = stride, d = dilation, p = left padding. Row t*nb + b is
step t of sequence b.

    unfold  cols[t'*nb + b, j*C:(j+1)*C] = x[(t'*s - p + j*d)*nb + b]   (0 outside 0..T-1)
            -> the convolution is one GEMM, cols (T'*nb, k*C) @ W (k*C, F)
    fold    dx[t*nb + b] = sum over (t', j) with t'*s - p + j*d = t of dcols[t'*nb + b, j*C:..]
            (the adjoint of unfold: the input gradient from the GEMM's dcols = dz @ W^T)
    mask    x[t*nb + batch_sizes[t] : (t+1)*nb] = 0 for every t (the padded rows)

A centred convolution has p = (k - 1) * d // 2 and T' = ceil(T / s); frame stacking is the
unfold with k = s, d = 1, p = 0. fold is parallel over its OUTPUT rows, each adding its taps
in order j = 0..k-1: no two threads write one row, and the bits do not depend on the number
of threads.
"""
import numpy as np
from numba import njit, prange


@njit(parallel=True, cache=True)
def unfold(x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left):
    """cols[:steps_out*nb, :kernel*C] <- the taps of every output row (module docstring)."""
    c = x.shape[1]
    for r in prange(steps_out * nb):
        t, b = r // nb, r % nb
        for j in range(kernel):
            src = t * stride - left + j * dilation
            out = cols[r, j * c:(j + 1) * c]
            if 0 <= src < steps_in:
                row = x[src * nb + b]
                for i in range(c):
                    out[i] = row[i]
            else:
                for i in range(c):
                    out[i] = 0


@njit(parallel=True, cache=True)
def fold(dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left):
    """dx[:steps_in*nb] <- the sum of every tap that read each input row (unfold's
    adjoint), taps added in order j = 0..kernel-1."""
    c = dx.shape[1]
    for r in prange(steps_in * nb):
        t, b = r // nb, r % nb
        out = dx[r]
        for i in range(c):
            out[i] = 0
        for j in range(kernel):
            at = t + left - j * dilation          # = t' * stride when tap j of t' reads t
            if at < 0 or at % stride:
                continue
            tp = at // stride
            if tp >= steps_out:
                continue
            src = dcols[tp * nb + b, j * c:(j + 1) * c]
            for i in range(c):
                out[i] += src[i]


@njit(parallel=True, cache=True)
def mask_rows(x, batch_sizes, nb):
    """Zero the padded rows of a time-major batch: rows t*nb + batch_sizes[t] .. (t+1)*nb."""
    m = x.shape[1]
    for t in prange(len(batch_sizes)):
        for r in range(t * nb + batch_sizes[t], (t + 1) * nb):
            for i in range(m):
                x[r, i] = 0


# ---------------------------------------------------------------------------------------------
# NumPy references


def ref_unfold(x, nb, steps_in, steps_out, kernel, stride, dilation, left):
    """(T'*nb, k*C) float64: unfold's definition, one tap at a time."""
    x = np.asarray(x, np.float64)[:steps_in * nb].reshape(steps_in, nb, -1)
    c = x.shape[2]
    cols = np.zeros((steps_out, nb, kernel * c))
    for t in range(steps_out):
        for j in range(kernel):
            src = t * stride - left + j * dilation
            if 0 <= src < steps_in:
                cols[t, :, j * c:(j + 1) * c] = x[src]
    return cols.reshape(steps_out * nb, kernel * c)


def ref_fold(dcols, nb, steps_in, steps_out, kernel, stride, dilation, left):
    """(T*nb, C) float64: the transpose of ref_unfold applied to dcols."""
    dcols = np.asarray(dcols, np.float64)[:steps_out * nb].reshape(steps_out, nb, -1)
    c = dcols.shape[2] // kernel
    dx = np.zeros((steps_in, nb, c))
    for t in range(steps_out):
        for j in range(kernel):
            src = t * stride - left + j * dilation
            if 0 <= src < steps_in:
                dx[src] += dcols[t, :, j * c:(j + 1) * c]
    return dx.reshape(steps_in * nb, c)


def ref_mask(x, lengths, nb):
    """x with the rows of steps t >= lengths[b] of each sequence b zeroed (a copy)."""
    out = np.array(x, copy=True)
    steps = len(out) // nb
    for b, length in enumerate(lengths):
        out[np.arange(length, steps) * nb + b] = 0
    return out
