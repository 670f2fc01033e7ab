"""Parameter specs and the flat buffers derived from them: parameters, gradients, optimizer
state and residuals.

A layer declares each of its parameters as a ParamSpec: a name unique in the model, a 2-D
shape (n_cols, n_rows), a role, how its gradient is exchanged between data-parallel ranks
and how a model-parallel group may split it. Everything else is derived from the list of
specs (the model's layout): one contiguous 1-D buffer per kind of array (FlatParams.flat) with
named 2-D views for the layers, the codec's columns, the exchange's stripes, the optimizer's
state, the checkpoint's arrays.

Codec columns. A weight matrix W has shape (n_in, n_out) and the layers compute y = x @ W + b.
The paper's "column" (one pair of 1-bit reconstruction values) is the fan-out of one input
unit, W[j, :], which is contiguous in this C-ordered layout; a bias is a (1, n_out) matrix,
i.e. one codec column. So a parameter of shape (n_cols, n_rows) has n_cols codec columns of
n_rows values each, and column j of it is flat[offset + j*n_rows : offset + (j+1)*n_rows].

Order. Parameters are packed back to back without padding, grouped by how they are
exchanged -- "codec" first, then "float", then "none" -- in declaration order within a group.
So the exchanged parameters are one prefix flat[:exchanged] (the float allreduce sums exactly
that), and a model whose parameters all go through the codec (the DNN) keeps its declaration
order.
"""
from typing import NamedTuple

import numpy as np

from hpcsgd.device import zeros

ROLES = ("weight", "bias", "clip")
# codec: through the configured gradient codec (1-bit, k-bit, ...) with error feedback;
# float: summed in float32, never quantized (e.g. learned clip values); none: not trained
EXCHANGES = ("codec", "float", "none")
# how an M-way model-parallel group may split the matrix: by codec columns (input units),
# by rows (output units), or not at all (replicated)
SHARDS = ("cols", "rows", "replicated")


class ParamSpec(NamedTuple):
    """One parameter as its layer declares it."""
    name: str
    shape: tuple                 # (n_cols, n_rows)
    role: str = "weight"
    exchange: str = "codec"
    shard: str = "replicated"

    def checked(self):
        if self.role not in ROLES or self.exchange not in EXCHANGES or self.shard not in SHARDS:
            raise ValueError(f"parameter {self.name}: role {self.role!r}, exchange "
                             f"{self.exchange!r}, shard {self.shard!r}: expected one of "
                             f"{ROLES}, {EXCHANGES}, {SHARDS}")
        if len(self.shape) != 2 or min(self.shape) < 0:
            raise ValueError(f"parameter {self.name}: shape {self.shape} is not (n_cols, n_rows)")
        return self._replace(shape=(int(self.shape[0]), int(self.shape[1])))


class Matrix(NamedTuple):
    """One parameter placed in the flat buffer, as the codec and the exchange see it."""
    name: str
    offset: int   # first element in the flat buffer
    n_cols: int   # codec columns = shape[0] (input units; 1 for a bias)
    n_rows: int   # values per codec column = shape[1] (contiguous)
    exchange: str = "codec"
    role: str = "weight"
    shard: str = "replicated"

    @property
    def size(self):
        return self.n_cols * self.n_rows


def as_specs(layout):
    """ParamSpecs from specs or plain (name, shape) pairs (codec-exchanged weights)."""
    return [(s if isinstance(s, ParamSpec) else ParamSpec(s[0], tuple(s[1]))).checked()
            for s in layout]


def matrices(layout):
    """The layout (ParamSpecs, or (name, (n_cols, n_rows)) pairs) -> [Matrix, ...] with
    offsets, grouped by exchange kind (see the module docstring)."""
    specs = as_specs(layout)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"parameter names repeat: {names}")
    out, offset = [], 0
    for kind in EXCHANGES:
        for s in specs:
            if s.exchange == kind:
                out.append(Matrix(s.name, offset, s.shape[0], s.shape[1], s.exchange, s.role,
                                  s.shard))
                offset += s.shape[0] * s.shape[1]
    return out


class FlatParams:
    """One contiguous 1-D buffer (`flat`) and its named 2-D views (`views[name]`).

    Used alike for parameters, gradients and any per-parameter state; `matrices` lists the
    placed parameters; `exchanged` is the length of the prefix whose gradients are exchanged
    (codec + float), `codec_size` that of the codec part. Zero-initialised, in host memory or
    on the rank's GPU (device="cuda": Numba device arrays, whose slices and reshapes are
    views too).
    """

    def __init__(self, layout, dtype=np.float32, device="cpu"):
        self.matrices = matrices(layout)
        self.layout = [(m.name, (m.n_cols, m.n_rows)) for m in self.matrices]
        self.size = sum(m.size for m in self.matrices)
        self.codec_size = sum(m.size for m in self.matrices if m.exchange == "codec")
        self.exchanged = sum(m.size for m in self.matrices if m.exchange != "none")
        self.device = device
        self.flat = zeros(self.size, dtype, device)
        self.views = {m.name: self.flat[m.offset:m.offset + m.size].reshape(m.n_cols, m.n_rows)
                      for m in self.matrices}

    def __getitem__(self, name):
        return self.views[name]
