"""A BLSTM layer over chunks (spec `blstm H cC [rR]`): bidirectional context a streaming
encoder can afford. The layer's input is cut into chunks of C steps; each chunk is read with
the R steps after it (its lookahead, R <= C) as one window, both directions of a BLSTM run
over the window from zero states, and the window's first C outputs are the chunk's. No state
passes from one window to the next, so a streaming graph runs it on each chunk and its
lookahead as they arrive (export_onnx_streaming): the context is bounded by the chunk and R,
and the history is the causal layers' below (forward LSTMs carrying their state). It is
Chen and Huo's context-sensitive-chunk BLSTM (2016), with the left context left to the
layers below.

    windows of an utterance of L steps:  [kC, min(kC + C + R, L)),  k = 0 .. ceil(L/C) - 1

The windows of a batch are a batch of sequences of their own (sorted by length, time-major,
model.lengths), gathered from the input rows, run through the BLSTM's own passes (model.lstm:
the same parameters, kernels, QAT hidden grid and mixed-precision rounding as `blstm H`), and
the kept rows scattered back. The backward scatters the output gradient of the kept rows into
the windows (zero on the lookahead rows: they are some other chunk's outputs), runs the
BLSTM's backward, and gathers the input gradient back: every step is the first C rows of one
window and, R <= C, the lookahead of at most one other, so the gather is an assignment and
one sum. Parameters as `blstm H`'s (enc.k.w, enc.k.u_fwd, enc.k.u_bwd, enc.k.b). The windows
are gathered with host indexing: CPU ranks only (families.common refuses it on CUDA ranks).
Cost: a BLSTM over (C + R) / C times the steps.
"""
import numpy as np

from hpcsgd.model.lstm import LSTM


class ChunkedBLSTM(LSTM):
    """A BLSTM of `cells` cells per direction over chunks of `chunk` steps, each read with
    the `right` steps after it."""

    def __init__(self, name, n_in, cells, chunk, right=0):
        super().__init__(name, n_in, cells, bidirectional=True)
        if chunk < 1 or not 0 <= right <= chunk:
            raise ValueError(f"a chunked BLSTM needs chunk >= 1 and 0 <= lookahead <= chunk: "
                             f"chunk {chunk}, lookahead {right}")
        self.chunk, self.right = int(chunk), int(right)

    def window_rows(self, rows):
        """The most time-major rows the windows of a batch of `rows` rows take: at most
        nb * ceil(T/C) windows of at most min(C + R, T) steps, so rows when T <= C and
        under 2 (C + R) / C times rows past that."""
        return -(-2 * (self.chunk + self.right) * int(rows) // self.chunk)

    def workspace(self, max_rows):
        rows = self.window_rows(max_rows)
        return {**super().workspace(rows), "win_x": (rows, self.n_in),
                "win_y": (rows, self.n_out), "win_dy": (rows, self.n_out),
                "win_dx": (rows, self.n_in)}

    def windows(self, lengths):
        """The batch's windows -> (their Lengths, window row and input row of every window
        step, and of the kept ones: which steps are a chunk's, not its lookahead)."""
        from hpcsgd.model.lengths import Lengths
        C, R, nb = self.chunk, self.right, lengths.nb
        counts = -(-lengths.lengths // C)                      # windows per sequence
        seq = np.repeat(np.arange(nb), counts)
        start = (np.arange(len(seq)) - np.repeat(np.cumsum(counts) - counts, counts)) * C
        size = np.minimum(C + R, lengths.lengths[seq] - start)
        order = np.argsort(-size, kind="stable")               # Lengths: non-increasing
        seq, start, size = seq[order], start[order], size[order]
        nw = len(size)
        window = np.repeat(np.arange(nw), size)
        step = np.arange(int(size.sum())) - np.repeat(np.cumsum(size) - size, size)
        win_row = step * nw + window
        in_row = (start[window] + step) * nb + seq[window]
        return Lengths(size), win_row, in_row, step < C

    def forward(self, p, x, y, ops, progress=None, ws=None, lengths=None):
        wl, win_row, in_row, kept = self.windows(lengths)
        xw, yw = ws["win_x"][:wl.rows], ws["win_y"][:wl.rows]
        xw[win_row] = x[in_row]        # the padding rows: the BLSTM masks its gates there
        super().forward(p, xw, yw, ops, progress, ws, wl)
        y[in_row[kept]] = yw[win_row[kept]]

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None, lengths=None):
        wl, win_row, in_row, kept = self.windows(lengths)
        rows = wl.rows
        dyw = ws["win_dy"][:rows]
        dyw[...] = 0                   # the lookahead rows: another chunk's outputs
        dyw[win_row[kept]] = dy[in_row[kept]]
        dxw = ws["win_dx"][:rows] if dx is not None else None
        super().backward(p, g, ws["win_x"][:rows], ws["win_y"][:rows], dyw, dxw, ops,
                         progress, ws, wl)
        if dx is not None:
            dx[in_row[kept]] = dxw[win_row[kept]]      # each step is one chunk's once
            ahead = ~kept                              # and at most one window's lookahead
            total = dx[in_row[ahead]] + dxw[win_row[ahead]]
            if hasattr(ops, "store"):   # mixed precision, bf16: the sum stored as 16-bit
                ops.store(total)
            dx[in_row[ahead]] = total
