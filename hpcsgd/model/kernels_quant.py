"""Fake quantization (quantization-aware training) as Numba CPU kernels, with the NumPy
references they are tested against; which tensor gets which grid is hpcsgd.model.quantize.

A grid is (step, klo, khi): the values step * k for integers k in [klo, khi], zero exact.
    symmetric, b bits:  k in [-(2^(b-1) - 1), 2^(b-1) - 1], step = alpha / (2^(b-1) - 1)
                        (2^b - 1 levels: +-7 for INT4, +-127 for INT8; weights)
    affine [lo, hi]:    step = (hi - lo) / (2^b - 1), klo = rint(lo / step), khi = klo + 2^b - 1
                        (2^b levels; activations with a one-signed or learned range)

    forward   out = step * clip(rint(x * inv), klo, khi)          inv = 1 / step (float32)
    backward  straight through inside [lo, hi], zero outside; the clip values' gradients
              (PACT): d lo = sum of dy where x < lo, d hi = sum of dy where x > hi

All scalars are float32 for float32 arrays, so the kernel and the reference do the same
float32 operations and agree bit for bit. Reductions run in NCHUNK fixed row chunks, summed in
float64 in a fixed order: the same bits for any number of threads.
"""
import numpy as np
from numba import njit, prange

from hpcsgd.model.kernels import NCHUNK


@njit(parallel=True, cache=True)
def fake_quant(x, out, step, inv, klo, khi):
    """out (N, M) <- x quantized on the grid (step, klo, khi); out may be x."""
    n, m = x.shape
    for i in prange(n):
        xi, oi = x[i], out[i]
        for j in range(m):
            oi[j] = min(max(np.rint(xi[j] * inv), klo), khi) * step


@njit(parallel=True, cache=True)
def fake_quant_backward(x, dy, dx, lo, hi, part):
    """dx <- dy where lo <= x <= hi, else 0 (dx may be dy); part (NCHUNK, 2) float64 <- per
    chunk of rows the sums of dy where x < lo and where x > hi (the clip values'
    gradients: part.sum(0))."""
    n, m = x.shape
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        s_lo, s_hi = 0.0, 0.0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            xi, di, oi = x[i], dy[i], dx[i]
            for j in range(m):
                v, d = xi[j], di[j]
                below, above = v < lo, v > hi
                s_lo += d if below else 0.0
                s_hi += d if above else 0.0
                oi[j] = d if not (below or above) else 0.0
        part[c, 0] = s_lo
        part[c, 1] = s_hi


@njit(parallel=True, cache=True)
def abs_stats(x, part):
    """part (NCHUNK, 3) float64 <- per chunk of rows: max |x|, sum x^2, sum |x| (the MAX and
    SAWB clip rules' statistics)."""
    n, m = x.shape
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        mx, sq, ab = 0.0, 0.0, 0.0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            xi = x[i]
            for j in range(m):
                a = abs(np.float64(xi[j]))
                mx = max(mx, a)
                sq += a * a
                ab += a
        part[c, 0] = mx
        part[c, 1] = sq
        part[c, 2] = ab


def reduce_stats(part, size):
    """(max |x|, E[x^2], E|x|) from abs_stats' chunks of `size` values."""
    return float(part[:, 0].max()), float(part[:, 1].sum()) / max(size, 1), \
        float(part[:, 2].sum()) / max(size, 1)


# ---------------------------------------------------------------------------------------------
# NumPy references

def ref_fake_quant(x, step, inv, klo, khi):
    return np.minimum(np.maximum(np.rint(x * inv), klo), khi) * step


def ref_fake_quant_backward(x, dy, lo, hi):
    """(dx, d lo, d hi) in float64 sums."""
    below, above = x < lo, x > hi
    dx = np.where(below | above, 0, dy).astype(dy.dtype)
    return dx, float(dy[below].astype(np.float64).sum()), float(dy[above].astype(np.float64).sum())


def ref_stats(x):
    a = np.abs(x.astype(np.float64))
    return float(a.max(initial=0.0)), float((a * a).mean()) if a.size else 0.0, \
        float(a.mean()) if a.size else 0.0
