"""(Bi)LSTM acoustic models: LSTM layers (uni- or bidirectional, gates i f g o, forget-gate
bias +1, no peepholes), optional Dense bottleneck layers, and the softmax output; the
builder `lstm()` beside `model.dnn.dnn()`.

Sequences are time-major: a minibatch of B chunks of T frames is a (T*B, n) matrix whose row
t*B + b is step t of chunk b (hpcsgd.data.sequences), so the Dense and softmax layers run on
it unchanged and one time step is a contiguous row block. Frames labelled -1 (context,
padding) add nothing to the loss. Chunks are independent (no state is carried from one chunk
to the next): the left/right context frames warm the state up, as Kaldi's chunked BLSTMs do.

One LSTM layer, per direction d (forward in time, and for a BLSTM also backward):
    a = x @ Wx                 all steps and both directions: ONE GEMM (T*B, n_in) x (n_in, 8H)
    for each step t:           r = h_{t-1} @ U_d  (B, H) x (H, 4H), gates, c_t, h_t: one
                               launch for both directions, the product inside it on CPU
                               ranks (model.ops.lstm_forward_step); or, on CPU ranks where
                               a direction has a thread, each direction's whole loop in one
                               task of one launch (ops.lstm_sequences: the same bits)
Backward, per direction, steps in reverse: dr = dgates_{t+1} @ U_d^T and the step, one
launch (ops.lstm_backward_step); then
gU_d = h_prev^T @ dgates (ONE GEMM over all steps), gb = column sums, gWx = x^T @ dgates and
dx = dgates @ Wx^T (one GEMM each, both directions at once).

Parameters of layer l: W{l} (n_in, dirs*4H) = [Wx_forward | Wx_backward], U{l}f and U{l}b
(H, 4H), b{l} (1, dirs*4H). A codec column of W{l} is the fan-out of one input unit to every
gate of both directions, and of U{l}d the fan-out of one cell's previous output to the 4H
gates (contiguous rows, the same convention as the DNN: hpcsgd.model.flat), so the codecs,
stripes, optimizer and checkpoints need nothing new.
"""
import numpy as np

from hpcsgd.device import matmul, zero
from hpcsgd.model.flat import ParamSpec
from hpcsgd.model.kernels_lstm import GATES, SMALL_ROWS, ref_forward_step
from hpcsgd.model.kernels_quant import ref_fake_quant
from hpcsgd.model.layers import Dense, SoftmaxOutput, glorot_uniform
from hpcsgd.model.network import Network
from hpcsgd.model.ops import lstm_backward_step, lstm_forward_step

FORGET_BIAS = 1.0   # Gers et al.; Jozefowicz et al. 2015: an open forget gate at the start


class LSTM:
    """An LSTM layer of `cells` cells per direction (bidirectional: outputs [forward |
    backward], 2 * cells wide)."""
    recurrent = True   # Network passes the batch's Lengths and the layer's workspaces
    sequence = True
    output_range = (-1.0, 1.0)   # h = o tanh(c)
    hidden_grid = None   # quantization-aware training: h_{t-1}'s grid (model.quantize)

    def __init__(self, name, n_in, cells, bidirectional=True):
        self.dirs = 2 if bidirectional else 1
        self.W, self.b = f"{name}.w", f"{name}.b"
        # the recurrent weights: one matrix per direction
        self.U = [f"{name}.u_fwd", f"{name}.u_bwd"] if bidirectional else [f"{name}.u"]
        self.n_in, self.cells = int(n_in), int(cells)
        self.n_out = self.dirs * self.cells
        self.width = self.dirs * GATES * self.cells        # gate columns of both directions
        self.dx_macs = self.n_in * self.width               # the input projection
        self.gemm_macs = self.dx_macs + self.dirs * self.cells * GATES * self.cells

    def specs(self):
        g = GATES * self.cells
        return ([ParamSpec(self.W, (self.n_in, self.width), "weight", "codec", "rows")]
                + [ParamSpec(u, (self.cells, g), "weight", "codec", "rows") for u in self.U]
                + [ParamSpec(self.b, (1, self.width), "bias", "codec", "rows")])

    def workspace(self, max_rows):
        """The arrays one pass needs besides its input and output (Network allocates them):
        gate values (kept for backward), cells, and one step's recurrent products (per
        direction: a BLSTM's two directions step together)."""
        g = GATES * self.cells   # zeros: the first step's r and c_prev (any cell column)
        two = max_rows if self.dirs == 2 else 0
        return {"gates": (max_rows, self.width), "cells": (max_rows, self.n_out),
                "rec": (max_rows, g), "rec2": (two, g),
                "zeros": (max_rows, max(g, self.n_out)),
                "dh_rec": (max_rows, self.cells), "dh_rec2": (two, self.cells),
                "dc": (max_rows, self.cells), "dc2": (two, self.cells),
                "ut": (self.dirs, g, self.cells),   # U^T per direction (CPU steps' products)
                "xs": (self.dirs, SMALL_ROWS * g),  # a step's product operand (CPU: copied)
                "hq": (max_rows if self.hidden_grid is not None else 0, self.n_out)}

    def init(self, views, rng):
        """Glorot uniform per direction's block of W and of U; b = 0 but the forget gate's
        +1. Drawn direction by direction, W before U."""
        g = GATES * self.cells
        for d in range(self.dirs):
            glorot_uniform(views[self.W][:, d * g:(d + 1) * g], rng)
            glorot_uniform(views[self.U[d]], rng)
        b = views[self.b]
        b[...] = 0
        for d in range(self.dirs):
            b[0, d * g + self.cells:d * g + 2 * self.cells] = FORGET_BIAS

    def forward(self, p, x, y, ops, progress=None, ws=None, lengths=None):
        """lengths (model.lengths.Lengths): the batch's sequences; at step t only the first
        batch_sizes[t] rows are stepped, the padding rows of y and the cells stay zero (a
        sequence's backward direction starts from a zero state at its own end)."""
        hc = self.cells
        nb, steps, bs = lengths.nb, lengths.steps, lengths.batch_sizes
        n = nb * steps
        gates, cells, b = ws["gates"][:n], ws["cells"][:n], p[self.b]
        matmul(x, p[self.W], gates)                     # 2 n n_in width FLOP: every step
        if progress is not None:
            progress()
        grid = self.hidden_grid   # quantized h_{t-1} into the recurrent GEMM, kept in hq
        h = y if grid is None else ws["hq"][:n]
        if not lengths.full:   # padding: zero input (the Network masks it), outputs, state
            for a in (gates, y, cells) + ((h,) if grid is not None else ()):
                ops.mask_rows(a, lengths)
        zeros, recs = ws["zeros"], (ws["rec"], ws["rec2"])
        # U^T of each direction, once per pass, for the steps' small products (CPU ranks)
        uts = [ops.transposed_copy(p[self.U[d]], ws["ut"][d]) for d in range(self.dirs)]
        # each direction's whole time loop in one task where the ops can (CPU ranks, few rows
        # a step, a direction per thread: kernels_lstm._forward_sequences); QAT rounds each
        # step's outputs before the next step reads them, so it steps
        whole = getattr(ops, "lstm_sequences", None)
        if grid is None and whole is not None and whole(   # the exchange polled at half, end
                self.dirs, gates, cells, h, y, uts, recs, b, zeros, bs, nb, hc, ws["xs"],
                progress, (steps + 1) // 2):
            return
        # step s: time s forwards and, for a BLSTM, time T-1-s backwards, in one kernel launch
        # with their recurrent products (a launch wakes the threads: one per step)
        prev = [None] * self.dirs   # the previous step's first row, per direction
        for s in range(steps):
            args, rows = [], []
            for d in range(self.dirs):   # direction d: gate columns from 4hc d, cells from hc d
                t = s if d == 0 else steps - 1 - s
                m = int(bs[t])
                now = slice(t * nb, t * nb + m)
                if prev[d] is None:   # the first step: no previous output or cell
                    args.append((None, p[self.U[d]], uts[d], zeros[:m], gates[now], zeros[:m],
                                 cells[now], y[now]))
                else:
                    # the sequences valid now were valid at the previous step forwards; a
                    # backward-direction sequence that starts here reads the zero padding
                    before = slice(prev[d], prev[d] + m)
                    args.append((h[before, d * hc:(d + 1) * hc], p[self.U[d]], uts[d],
                                 recs[d][:m], gates[now], cells[before], cells[now], y[now]))
                prev[d] = t * nb
                rows.append(now)
            lstm_forward_step(ops, args, b, hc, ws["xs"])
            if grid is not None:
                for d in range(self.dirs):
                    cols = slice(d * hc, (d + 1) * hc)
                    ops.fake_quant(y[rows[d], cols], h[rows[d], cols], grid)
            if progress is not None and s in (steps // 2, steps - 1):   # the exchange in flight
                progress()

    def step(self, p, x, h, c):
        """One time step of a forward layer from its state (h, c) (n, cells) for the rows x
        (n, n_in), in float64 on the host: what a search advances one token at a time
        (model/transducer.py: Transducer.step). The arithmetic is kernels_lstm's reference
        step, the one the layer's kernels are tested against; under quantization-aware
        training h_{t-1} goes through the layer's hidden grid as in training. -> (h, c)."""
        h_in = h if self.hidden_grid is None else on_grid(h, self.hidden_grid)
        _, c, h = ref_forward_step(x @ p[self.W], h_in @ p[self.U[0]], p[self.b], c)
        return h, c

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None, lengths=None):
        hc = self.cells
        nb, steps, bs = lengths.nb, lengths.steps, lengths.batch_sizes
        n = nb * steps
        gates, cells = ws["gates"][:n], ws["cells"][:n]
        zeros = ws["zeros"]
        dh_recs, dcs = (ws["dh_rec"], ws["dh_rec2"]), (ws["dc"], ws["dc2"])
        h = y if self.hidden_grid is None else ws["hq"][:n]   # what the recurrent GEMM read
        m_rows = (steps - 1) * nb   # rows of the steps that have a previous one
        for d in range(self.dirs):
            zero(dcs[d][:nb])
        whole = getattr(ops, "lstm_sequences_backward", None)
        if not (whole is not None and whole(   # each direction's loop in one task (as forward)
                self.dirs, gates, cells, dy, [p[u] for u in self.U], dh_recs, dcs, zeros, bs,
                nb, hc, ws["xs"], progress, 8)):   # the layers above's buckets polled every 8
            self._steps_backward(p, gates, cells, dy, zeros, dh_recs, dcs, ops, progress, ws,
                                 lengths)
        for d in range(self.dirs):
            # gU = sum over steps of h_{previous}^T @ dgates: one GEMM over the shifted rows
            cols, gh = slice(d * GATES * hc, (d + 1) * GATES * hc), d * hc
            gU = g[self.U[d]]
            if m_rows == 0:
                zero(gU)
            elif d == 0:
                matmul(h[:m_rows, gh:gh + hc], gates[nb:, cols], gU, trans_a=True)
            else:
                matmul(h[nb:, gh:gh + hc], gates[:m_rows, cols], gU, trans_a=True)
            if progress is not None:
                progress()
        ops.column_sums(gates, g[self.b])
        matmul(x, gates, g[self.W], trans_a=True)
        if progress is not None:
            progress()
        if dx is not None:
            matmul(gates, p[self.W], dx, trans_b=True)
            if progress is not None:
                progress()

    def _steps_backward(self, p, gates, cells, dy, zeros, dh_recs, dcs, ops, progress, ws,
                        lengths):
        """backward's time steps, one launch each (ops.lstm_backward_step)."""
        hc, nb, steps, bs = self.cells, lengths.nb, lengths.steps, lengths.batch_sizes
        # step s: each direction's steps in reverse (time T-1-s for the forward direction,
        # time s for the backward one), both in one kernel launch. Padding rows are not
        # stepped: their gate rows stay zero (the forward zeroed them), so the GEMMs over
        # all rows below get nothing from them, and a sequence's last step reads a zero dr
        # and dc (dc rows past the later step's batch size were never written)
        later = [None] * self.dirs   # the step processed before this one, per direction
        for s in range(steps):
            args = []
            for d in range(self.dirs):
                cols = slice(d * GATES * hc, (d + 1) * GATES * hc)
                t = steps - 1 - s if d == 0 else s
                m = int(bs[t])
                now = slice(t * nb, t * nb + m)
                first = t == 0 if d == 0 else t == steps - 1
                earlier = None if first else (slice((t - 1) * nb, (t - 1) * nb + m) if d == 0
                                              else slice((t + 1) * nb, (t + 1) * nb + m))
                c_prev = zeros[:m] if first else cells[earlier]
                if later[d] is None:   # the direction's last step: nothing flows back into it
                    args.append((None, p[self.U[d]], zeros[:m], gates[now], c_prev, cells[now],
                                 dy[now], dcs[d][:m]))
                else:
                    args.append((gates[later[d]:later[d] + m, cols], p[self.U[d]],
                                 dh_recs[d][:m], gates[now], c_prev, cells[now], dy[now],
                                 dcs[d][:m]))
                later[d] = t * nb
            lstm_backward_step(ops, args, hc, ws["xs"])
            if progress is not None and s % 8 == 7:   # the layers above: their buckets in flight
                progress()


def on_grid(x, grid):
    """x fake-quantized on a grid (kernels_quant's reference arithmetic, in float32 as the
    training kernels compute it), back in float64."""
    return ref_fake_quant(np.asarray(x, np.float32), grid.step, grid.inv, grid.klo,
                          grid.khi).astype(np.float64)


def lstm_layers(input_dim, cells, num_labels, bidirectional=True, bottleneck=(),
                activation="relu"):
    """LSTM layers of cells[l] cells per direction, then Dense bottleneck layers
    (`activation`), then the softmax output."""
    layers, n_in = [], int(input_dim)
    for c in cells:
        layers.append(LSTM(f"enc.{len(layers)}", n_in, c, bidirectional))
        n_in = layers[-1].n_out
    for width in bottleneck:
        layers.append(Dense(f"enc.{len(layers)}", n_in, width, activation))
        n_in = int(width)
    return layers + [SoftmaxOutput("out", n_in, num_labels)]


def lstm(input_dim, cells, num_labels, bidirectional=True, bottleneck=(), activation="relu",
         steps=40, max_batch=2560, dtype=np.float32, device="cpu", precision="float32",
         qat=None):
    """The (B)LSTM input_dim-[LSTM cells]...-[bottleneck]...-num_labels as a Network whose
    passes take sequences of `steps` frames (time-major rows) unless told otherwise."""
    describe = {"type": "lstm", "input_dim": int(input_dim), "cells": [int(c) for c in cells],
                "bidirectional": bool(bidirectional),
                "bottleneck": [int(b) for b in bottleneck], "activation": activation,
                "num_labels": int(num_labels), **({"qat": dict(qat)} if qat else {})}
    return Network(lstm_layers(input_dim, cells, num_labels, bidirectional, bottleneck,
                               activation), max_batch, dtype, device, describe, precision,
                   steps=steps, qat=qat)
