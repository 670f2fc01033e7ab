"""Flat buffers with named 2-D views: parameters, gradients and optimizer state.

Everything a codec, the striped exchange, the optimizer or a checkpoint touches is ONE contiguous
1-D array; the layers see named 2-D views into it. A layout is the ordered list of
(name, shape); the same layout gives the same offsets for params, grads, momentum, residuals.

Codec columns. A weight matrix W has shape (n_in, n_out) and the layers compute y = x @ W + b.
The paper's "column" (one pair of 1-bit reconstruction values) is the fan-out of one input
unit, W[j, :], which is contiguous in this C-ordered layout; a bias is a (1, n_out) matrix, i.e.
one codec column. So matrix m has `n_cols = shape[0]` codec columns of `n_rows = shape[1]`
values each, and codec column j of it is flat[offset + j*n_rows : offset + (j+1)*n_rows].
Matrices are packed back to back without padding (offsets are in elements, not bytes).
"""
from typing import NamedTuple

import numpy as np

from hpcsgd.device import zeros


class Matrix(NamedTuple):
    """One named matrix of a layout, as the codec and the exchange see it."""
    name: str
    offset: int   # first element in the flat buffer
    n_cols: int   # codec columns = shape[0] (input units; 1 for a bias)
    n_rows: int   # values per codec column = shape[1] (contiguous)

    @property
    def size(self):
        return self.n_cols * self.n_rows


def matrices(layout):
    """The layout [(name, (n_cols, n_rows)), ...] -> [Matrix, ...] with offsets, in order."""
    out, offset = [], 0
    for name, (n_cols, n_rows) in layout:
        out.append(Matrix(name, offset, int(n_cols), int(n_rows)))
        offset += int(n_cols) * int(n_rows)
    return out


def stripe_ranges(mats, rank, size):
    """Flat [lo, hi) ranges that rank `rank` of `size` owns: a contiguous range of codec columns
    of every matrix (n_cols // size each, the first n_cols % size ranks one more, as CNTK does).
    Ranges of a matrix with fewer columns than ranks are empty on the last ranks."""
    ranges = []
    for m in mats:
        base, extra = divmod(m.n_cols, size)
        first = rank * base + min(rank, extra)
        count = base + (1 if rank < extra else 0)
        lo = m.offset + first * m.n_rows
        ranges.append((lo, lo + count * m.n_rows))
    return ranges


class FlatParams:
    """One contiguous 1-D buffer (`flat`) and its named 2-D views (`views[name]`).

    Used alike for parameters, gradients and any per-parameter state; `matrices` lists
    (name, offset, n_cols, n_rows) for the codec. Zero-initialised, in host memory or on the
    rank's GPU (device="cuda": Numba device arrays, whose slices and reshapes are views too).
    """

    def __init__(self, layout, dtype=np.float32, device="cpu"):
        self.layout = [(name, tuple(int(s) for s in shape)) for name, shape in layout]
        self.matrices = matrices(self.layout)
        self.size = sum(m.size for m in self.matrices)
        self.device = device
        self.flat = zeros(self.size, dtype, device)
        self.views = {m.name: self.flat[m.offset:m.offset + m.size].reshape(m.n_cols, m.n_rows)
                      for m in self.matrices}

    def __getitem__(self, name):
        return self.views[name]
