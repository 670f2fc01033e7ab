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

`blstm H cC rR lL`: L BLSTM layers inside each window (Kaldi's chunked BLSTM stacks, the
windows cut once): the first reads the gathered window, each next one the one below's outputs
over the whole window, lookahead steps included, and the last one's chunk rows are kept. A
streaming graph runs the L layers over each window as it arrives, so the latency is the one
layer's (the chunk and R), where L chunked layers of their own would each wait for the next
chunk's window below. The first layer's parameters are named as the single layer's
(enc.k.w ...), the i-th above it enc.k.i.w ... (i = 1 .. L-1); no dropout between them
(model.dropout applies to the layer's output).
"""
import numpy as np

from hpcsgd.model.lstm import LSTM


class ChunkedBLSTM(LSTM):
    """`layers` BLSTMs of `cells` cells per direction over chunks of `chunk` steps, each read
    with the `right` steps after it."""

    def __init__(self, name, n_in, cells, chunk, right=0, layers=1):
        super().__init__(name, n_in, cells, bidirectional=True)
        if chunk < 1 or not 0 <= right <= chunk or layers < 1:
            raise ValueError(f"a chunked BLSTM needs chunk >= 1, 0 <= lookahead <= chunk and "
                             f">= 1 layer: chunk {chunk}, lookahead {right}, {layers} layers")
        self.chunk, self.right = int(chunk), int(right)
        # the layers above the first inside each window: plain BLSTMs on the window batch
        self.above = [LSTM(f"{name}.{i}", self.n_out, cells) for i in range(1, int(layers))]
        self.gemm_macs += sum(a.gemm_macs for a in self.above)

    def stack(self):
        """The window's BLSTMs, bottom first, each with the workspace key prefix of its
        arrays: the first is this layer itself."""
        return [(self, "")] + [(a, f"{i}.") for i, a in enumerate(self.above, 1)]

    def specs(self):
        return super().specs() + [s for a in self.above for s in a.specs()]

    def init(self, views, rng):
        super().init(views, rng)
        for a in self.above:
            a.init(views, rng)

    def window_rows(self, rows):
        """The most time-major rows the windows of a batch of `rows` rows take: at most
        nb * ceil(T/C) windows of at most min(C + R, T) steps, so rows when T <= C and
        under 2 (C + R) / C times rows past that."""
        return -(-2 * (self.chunk + self.right) * int(rows) // self.chunk)

    def workspace(self, max_rows):
        rows = self.window_rows(max_rows)
        out = {**super().workspace(rows), "win_x": (rows, self.n_in),
               "win_y": (rows, self.n_out), "win_dy": (rows, self.n_out),
               "win_dx": (rows, self.n_in)}
        for i, a in enumerate(self.above, 1):   # its gates and cells, the outputs below it
            out.update({f"{i}.{k}": v for k, v in a.workspace(rows).items()})
            out[f"win_h{i}"] = (rows, self.n_out)    # layer i's input: layer i-1's output
            out[f"win_dh{i}"] = (rows, self.n_out)   # and its gradient
        return out

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

    def _passes(self, ws, rows):
        """Per BLSTM of the window, bottom first: (layer, its input, its output, its output's
        gradient, its input's gradient, its workspaces), the window rows of each."""
        top = len(self.above)
        out = []
        for i, (layer, prefix) in enumerate(self.stack()):
            own = ws if not prefix else {k[len(prefix):]: v for k, v in ws.items()
                                         if k.startswith(prefix)}
            x = ws["win_x"] if i == 0 else ws[f"win_h{i}"]
            y = ws["win_y"] if i == top else ws[f"win_h{i + 1}"]
            dy = ws["win_dy"] if i == top else ws[f"win_dh{i + 1}"]
            dx = ws["win_dx"] if i == 0 else ws[f"win_dh{i}"]
            out.append((layer, x[:rows], y[:rows], dy[:rows], dx[:rows], own))
        return out

    def forward(self, p, x, y, ops, progress=None, ws=None, lengths=None):
        wl, win_row, in_row, kept = self.windows(lengths)
        passes = self._passes(ws, wl.rows)
        passes[0][1][win_row] = x[in_row]   # the padding rows: the BLSTM masks its gates there
        for layer, xw, yw, _, _, own in passes:
            LSTM.forward(layer, p, xw, yw, ops, progress, own, wl)
        y[in_row[kept]] = passes[-1][2][win_row[kept]]

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None, lengths=None):
        wl, win_row, in_row, kept = self.windows(lengths)
        passes = self._passes(ws, wl.rows)
        dyw = passes[-1][3]
        dyw[...] = 0                   # the lookahead rows: another chunk's outputs
        dyw[win_row[kept]] = dy[in_row[kept]]
        for i in range(len(passes) - 1, -1, -1):
            layer, xw, yw, dyw, dxw, own = passes[i]
            LSTM.backward(layer, p, g, xw, yw, dyw, dxw if i or dx is not None else None, ops,
                          progress, own, wl)
        if dx is not None:
            dxw = passes[0][4]
            dx[in_row[kept]] = dxw[win_row[kept]]      # each step is one chunk's once
            ahead = ~kept                              # and at most one window's lookahead
            total = dx[in_row[ahead]] + dxw[win_row[ahead]]
            if hasattr(ops, "store"):   # mixed precision, bf16: the sum stored as 16-bit
                ops.store(total)
            dx[in_row[ahead]] = total
