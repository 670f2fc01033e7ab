"""Fake quantization (quantization-aware training) as Numba CPU kernels, with the NumPy
references they are tested against; which tensor gets which grid is hpcsgd.model.quantize.

A grid is (step, klo, khi): the values step * k for integers k in [klo, khi], zero exact.
    symmetric, b bits:  k in [-(2^(b-1) - 1), 2^(b-1) - 1], step = alpha / (2^(b-1) - 1)
                        (2^b - 1 levels: +-7 for INT4, +-127 for INT8; weights)
    affine [lo, hi]:    step = (hi - lo) / (2^b - 1), klo = rint(lo / step), khi = klo + 2^b - 1
                        (2^b levels; activations with a one-signed or learned range)

    forward   out = step * clip(rint(x * inv), klo, khi)          inv = 1 / step (float32)
              (per output unit: step[j], inv[j] for column j, fake_quant_channels)
    backward  straight through inside [lo, hi], zero outside (in place); the clip values' gradients
              (PACT): d lo = sum of dy where x < lo, d hi = sum of dy where x > hi

All scalars are float32 for float32 arrays, so the kernel and the reference do the same
float32 operations and agree bit for bit. Reductions give one float64 partial per row (the
rows' loops vectorize, reassociated: the same bits on one machine for any number of threads,
not across vector widths), added in row order by the caller.
"""
import numpy as np
from numba import njit, prange


# the row reductions may be reassociated so that they vectorize (4-5x faster here)
REDUCE = {"reassoc", "nsz", "nnan", "ninf"}


@njit(parallel=True, cache=True)
def fake_quant(x, out, step, inv, klo, khi):
    """out (N, M) <- x quantized on the grid (step, klo, khi); out may be x."""
    n, m = x.shape
    for i in prange(n):
        xi, oi = x[i], out[i]
        for j in range(m):
            oi[j] = min(max(np.rint(xi[j] * inv), klo), khi) * step


@njit(parallel=True, cache=True)
def fake_quant_channels(x, out, step, inv, klo, khi):
    """out (N, M) <- x quantized per output unit: column j on the grid (step[j], klo, khi)
    (qat.weight_scale=channel); out may be x. The same float32 operations as fake_quant."""
    n, m = x.shape
    for i in prange(n):
        xi, oi = x[i], out[i]
        for j in range(m):
            oi[j] = min(max(np.rint(xi[j] * inv[j]), klo), khi) * step[j]


COLUMNS = 64   # columns per task of column_abs_stats: its rows' loop vectorizes over them


@njit(parallel=True, cache=True)
def column_abs_stats(x, out):
    """out (M, 3) float64 <- per column of x (N, M): max |x|, sum x^2, sum |x|, each column's
    rows added in row order (the same bits for any number of threads)."""
    n, m = x.shape
    for t in prange((m + COLUMNS - 1) // COLUMNS):
        lo, hi = t * COLUMNS, min(m, (t + 1) * COLUMNS)
        mx, sq, ab = out[lo:hi, 0], out[lo:hi, 1], out[lo:hi, 2]
        mx[:] = 0.0
        sq[:] = 0.0
        ab[:] = 0.0
        for i in range(n):
            xi = x[i, lo:hi]
            for j in range(hi - lo):
                a = abs(np.float64(xi[j]))
                mx[j] = max(mx[j], a)
                sq[j] += a * a
                ab[j] += a


@njit(parallel=True, cache=True, fastmath=REDUCE)
def fake_quant_backward(x, d, lo, hi, part):
    """d (the gradient of the quantized x) <- the gradient of x, in place: kept where
    lo <= x <= hi, else 0; part (>= N, 2) float64 <- per row the sums of d where x < lo and
    where x > hi (the clip values' gradients: the column sums of part[:N]). In place on
    purpose: with a separate output LLVM must allow for overlap and does not vectorize."""
    n, m = x.shape
    zero = d.dtype.type(0)
    for i in prange(n):   # a row per iteration: the loop below vectorizes only so
        xi, di = x[i], d[i]
        s_lo, s_hi = 0.0, 0.0
        for j in range(m):
            v, g = xi[j], di[j]
            below, above = v < lo, v > hi
            s_lo += np.float64(g) if below else 0.0
            s_hi += np.float64(g) if above else 0.0
            di[j] = zero if (below or above) else g
        part[i, 0] = s_lo
        part[i, 1] = s_hi


@njit(parallel=True, cache=True, fastmath=REDUCE)
def _abs_stats(x, bits, mask, part, part_bits):
    n, m = x.shape
    for i in prange(n):
        xi, bi = x[i], bits[i]
        sq, ab, mx = 0.0, 0.0, bits.dtype.type(0)
        for j in range(m):
            a = np.float64(xi[j])
            sq += a * a
            ab += abs(a)
        for j in range(m):   # |x| as its bits: an integer max, which vectorizes
            mx = max(mx, bi[j] & mask)
        part_bits[i] = mx
        part[i, 1] = sq
        part[i, 2] = ab


def abs_stats(x, part, part_bits):
    """part[:N] (>= N, 3) float64 <- per row: max |x|, sum x^2, sum |x| (the MAX and SAWB
    clip rules' statistics); part_bits (>= N,) uint64 scratch. The max is taken over the bit
    patterns of |x| (the same order as the values, for finite floats)."""
    n = len(x)
    uint = np.uint32 if x.dtype == np.float32 else np.uint64
    mask = uint(np.iinfo(uint).max >> 1)
    _abs_stats(x, x.view(uint), mask, part, part_bits)
    part[:n, 0] = part_bits[:n].astype(uint).view(x.dtype)


def reduce_stats(part, shape):
    """(max |x|, E[x^2], E|x|) of an (N, M) x from abs_stats' rows, added in row order."""
    n, size = shape[0], max(shape[0] * shape[1], 1)
    if n == 0:
        return 0.0, 0.0, 0.0
    return float(part[:n, 0].max()), float(part[:n, 1].sum()) / size, \
        float(part[:n, 2].sum()) / size


# ---------------------------------------------------------------------------------------------
# NumPy references

def ref_fake_quant(x, step, inv, klo, khi):
    return np.minimum(np.maximum(np.rint(x * inv), klo), khi) * step


def ref_fake_quant_backward(x, dy, lo, hi):
    """(dx, d lo, d hi) in float64 sums."""
    below, above = x < lo, x > hi
    dx = np.where(below | above, 0, dy).astype(dy.dtype)
    return dx, float(dy[below].astype(np.float64).sum()), float(dy[above].astype(np.float64).sum())


def ref_column_stats(x):
    """(max |x|, E[x^2], E|x|) per column, float64 arrays."""
    a = np.abs(x.astype(np.float64))
    n = max(len(a), 1)
    return a.max(axis=0, initial=0.0), (a * a).sum(axis=0) / n, a.sum(axis=0) / n


def ref_stats(x):
    a = np.abs(x.astype(np.float64))
    return float(a.max(initial=0.0)), float((a * a).mean()) if a.size else 0.0, \
        float(a.mean()) if a.size else 0.0
