"""The shape of a time-major batch of whole sequences: how many, how long each, and what a
layer that subsamples in time makes of them.

A batch of nb sequences of up to T steps is a (T*nb, n) matrix whose row t*nb + b is step t
of sequence b (hpcsgd.data.sequences, hpcsgd.data.utterances). The sequences are sorted by
non-increasing length, so at step t the valid rows are the first batch_sizes[t] of the step's
nb (PyTorch's PackedSequence.batch_sizes): an LSTM steps over exactly those rows, and the
padding is one row range per step that a mask zeroes (model.kernels_seq.mask_rows).

    lengths = Lengths([7, 5, 5, 2])      nb 4, steps 7, batch_sizes [4 4 3 3 3 1 1]
    lengths.strided(2)                   [4, 3, 3, 1]: a stride-2 layer's output
    Lengths.full(nb=3, steps=40)         chunks of a frame model: no padding

Chunked frame models (hpcsgd.data.sequences) are full batches; whole utterances (CTC,
RNN-T) are not.
"""
import numpy as np


class Lengths:
    """Per-sequence lengths (non-increasing) of a time-major batch, and its step count."""

    def __init__(self, lengths, steps=None):
        self.lengths = np.asarray(lengths, np.int64).reshape(-1)
        self.nb = len(self.lengths)
        if self.nb and np.any(np.diff(self.lengths) > 0):
            raise ValueError(f"sequence lengths must not increase: {self.lengths[:8]}...")
        if self.nb and self.lengths[-1] < 0:
            raise ValueError("a sequence length is negative")
        longest = int(self.lengths[0]) if self.nb else 0
        self.steps = longest if steps is None else int(steps)
        if self.steps < longest:
            raise ValueError(f"{self.steps} steps cannot hold a sequence of {longest}")
        # valid rows at each step: the sequences longer than t (a prefix, by the order)
        self.batch_sizes = self.nb - np.searchsorted(self.lengths[::-1], np.arange(self.steps),
                                                     side="right")
        self.full = bool(self.nb == 0 or self.lengths[-1] == self.steps)
        self.device_batch_sizes = None   # GPU ranks: batch_sizes copied once (model.ops)
        self.device_lengths = None       # and the lengths (instance norm)
        self._strided = {}

    @classmethod
    def full_batch(cls, nb, steps):
        """nb sequences of exactly `steps` steps (a chunked frame model's batch)."""
        return cls(np.full(int(nb), int(steps), np.int64), steps)

    @property
    def rows(self):
        """Rows of the time-major matrix: steps x sequences, padding included."""
        return self.steps * self.nb

    @property
    def frames(self):
        """Valid rows: the sum of the lengths."""
        return int(self.lengths.sum())

    def strided(self, stride):
        """The lengths after a layer that keeps every stride-th step (a strided convolution
        with centred padding, or frame stacking): ceil(length / stride) each."""
        if stride == 1:
            return self
        # one object per stride, so a GPU rank's device copies of it are made once a pass
        if stride not in self._strided:
            self._strided[stride] = Lengths(-(-self.lengths // stride), -(-self.steps // stride))
        return self._strided[stride]

    def __eq__(self, other):
        return (isinstance(other, Lengths) and self.steps == other.steps
                and np.array_equal(self.lengths, other.lengths))

    def __repr__(self):
        return f"Lengths({self.lengths.tolist()}, steps={self.steps})"


def strided_rows(rows, stride, max_sequences=None):
    """The most rows a batch of at most `rows` time-major rows has after a subsampling by
    `stride`: ceil(T / s) * nb <= (T * nb + (s - 1) * nb) / s, so with at most max_sequences
    sequences (nb) a batch's buffers past a stride need only that (None: rows, the bound
    without it: nb = rows sequences of 1 step)."""
    if not max_sequences or stride == 1:
        return int(rows)
    return min(int(rows), -(-(int(rows) + (stride - 1) * int(max_sequences)) // stride))
