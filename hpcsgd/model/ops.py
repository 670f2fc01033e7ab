"""The element-wise work of the layers, one object per device with the same five methods, so
a layer's forward and backward are written once: the GEMMs (hpcsgd.device.matmul) and calls
to these.

    CpuOps    the Numba CPU kernels of hpcsgd.model.kernels, with their preallocated scratch
    CudaOps   the CUDA kernels of hpcsgd.model.kernels_cuda and its siblings (GPU ranks)
    GemmOnly  nothing at all: the step's GEMMs alone, the roofline `bench train` divides by
    HalfOps   mixed precision (float16) or bf16 around either of the first two: every value a
              GEMM or kernel stores as a 16-bit float is rounded to it in its float32 buffer
              (hpcsgd/half.py: round_to(kind)); a 16-bit array (GPU ranks' float16
              or bfloat16 storage) is left alone, its stores have rounded

Shapes: z, h, d (N, M) with N <= max_batch rows and M <= max_width columns; b, gb (1, M);
y (N,) integer labels. `kind` is kernels.SIGMOID or kernels.RELU.
"""
import numpy as np

from hpcsgd import half
from hpcsgd.device import matmul, zeros
from hpcsgd.lazy_cuda import cuda as cuda_module
from hpcsgd.model import kernels as K
from hpcsgd.model import kernels_lstm as KL
from hpcsgd.model import kernels_norm as KN
from hpcsgd.model import kernels_norm_cuda as KNC
from hpcsgd.model import kernels_parallel as KP
from hpcsgd.model import kernels_quant as KQ
from hpcsgd.model import kernels_seq as KS
from hpcsgd.model.kernels_lstm import GATES
from hpcsgd.model import kernels_conformer as KF
from hpcsgd.model import kernels_ctc as KCTC
from hpcsgd.model import kernels_dropout as KD
from hpcsgd.model import kernels_ctc_cuda as KCC   # compiled on first launch, by GPU models only
from hpcsgd.model import kernels_joint as KJ
from hpcsgd.model import kernels_joint_cuda as KJC
from hpcsgd.model import kernels_rnnt as KR
from hpcsgd.model import kernels_rnnt_cuda as KRC
from hpcsgd.model import kernels_conformer_cuda as KFC
from hpcsgd.model import kernels_cuda as KC


class CpuOps:
    def __init__(self, max_batch, max_width, dtype):
        self.partial = np.empty((K.NCHUNK, max_width), dtype)
        self.lanes = np.empty((max(max_batch, K.NCHUNK), K.LANES), dtype)
        self.ce_part = np.empty(K.NCHUNK, np.float64)
        self.correct_part = np.empty(K.NCHUNK, np.int64)
        self.quant_part = np.empty((max_batch, 3), np.float64)   # grown for a taller weight
        self.quant_bits = np.empty(max_batch, np.uint64)
        self.norm_part = np.empty((2, K.NCHUNK, max_width), np.float64)
        self.norm_seq = np.empty((0, 6, max_width), np.float64)   # grown to a batch's sequences
        self.depthwise_part = np.empty((K.NCHUNK, 0, 0), np.float64)   # grown to the taps
        self.rope_tables = {}   # (dk, dtype) -> (cos, sin), grown to the longest batch

    def bias_act(self, z, b, kind):
        """z <- f(z + b), in place."""
        K.FORWARD[kind](z, b)

    def act_backward(self, h, d, dz, gb, kind):
        """dz <- d * f'(.) from the output h (dz may be h); gb <- column sums of dz."""
        K.BACKWARD[kind](h, d, dz, gb, self.partial)

    def softmax_xent(self, z, b, y, gb, scale=1.0):
        """z (logits without bias) <- d CE / d(z + b); gb <- its column sums; both times
        `scale` (the loss scale: a power of two, exact). Returns (CE summed over the rows,
        unscaled; rows whose argmax is the label)."""
        K.softmax_xent_backward(z, b, y, gb, self.partial, self.lanes, self.ce_part,
                                self.correct_part)
        half.scale(z, scale)
        half.scale(gb, scale)
        return float(self.ce_part.sum()), int(self.correct_part.sum())

    def log_softmax(self, z, b):
        """z (logits without bias) <- log-posteriors, in place."""
        K.log_softmax_forward(z, b, self.lanes)

    def exp(self, z):
        K.exp_inplace(z)

    def scale(self, x, s):
        """x *= s in float32, in place (the loss scale on the loss gradient)."""
        half.scale(x, s)

    def lstm_step(self, a, r, b, c_prev, c, h, ga, gh, hc):
        """One LSTM time step of one direction (hc cells; its gate columns from ga, cell
        columns from gh): a preactivations without r and b in, gates out; c, h out
        (model.kernels_lstm.lstm_forward_step)."""
        KL.lstm_forward_step(a, r, b, c_prev, c, h, ga, gh, hc)

    def lstm_step_backward(self, a, c_prev, c, dh, dr, dc, ga, gh, hc):
        """One LSTM time step backwards: a gates in, their preactivations' gradient out;
        dc in and out (model.kernels_lstm.lstm_backward_step)."""
        KL.lstm_backward_step(a, c_prev, c, dh, dr, dc, ga, gh, hc)

    def lstm_step2(self, fwd, bwd, b, hc):
        """A BLSTM's two directions' steps in one launch: fwd and bwd are each direction's
        (a, r, c_prev, c, h) as lstm_step takes them (model.kernels_lstm.lstm_forward_step2)."""
        KL.lstm_forward_step2(*fwd, *bwd, b, hc)

    def lstm_step_backward2(self, fwd, bwd, hc):
        """Both directions backwards in one launch: each (a, c_prev, c, dh, dr, dc)."""
        KL.lstm_backward_step2(*fwd, *bwd, hc)

    def lstm_recurrent_step(self, steps, b, hc, xs):
        """Each direction's time step with its recurrent product in one launch, the threads
        sharing the products too (lstm_forward_step)."""
        cpu_recurrent_forward(steps, b, hc, xs, True)

    def lstm_recurrent_step_backward(self, steps, hc, xs):
        cpu_recurrent_backward(steps, hc, xs, True)

    def lstm_sequences(self, dirs, gates, cells, h, y, uts, rs, b, zeros, bs, nb, hc, xs,
                       progress=None, every=0):
        """An LSTM layer's forward time loops, a direction's in one task, where they fit
        (kernels_lstm.whole_sequences), in parts of `every` steps with progress() after each;
        False where they do not fit: lstm.py then steps."""
        return sequences_forward(dirs, gates, cells, h, y, uts, rs, b, zeros, bs, nb, hc, xs,
                                 progress, every, True)

    def lstm_sequences_backward(self, dirs, gates, cells, dy, us, drs, dcs, zeros, bs, nb, hc,
                                xs, progress=None, every=0):
        return sequences_backward(dirs, gates, cells, dy, us, drs, dcs, zeros, bs, nb, hc, xs,
                                  progress, every, True)

    def column_sums(self, d, gb):
        """gb (1, M) <- column sums of d (N, M), the same bits for any number of threads."""
        KL.column_sums(d, gb, self.partial)

    def step_product(self, a, w, out, trans_b=False, wt=None):
        """out = a @ w (a @ w^T with trans_b) for one time step's rows, the LSTM's recurrent
        products: up to kernels_lstm.SMALL_ROWS rows by small_matmul_nt (a @ w on wt = w^T,
        the transposed copy transposed_copy made), else BLAS."""
        step_product(a, w, out, trans_b, wt)

    def transposed_copy(self, w, wt):
        """wt <- w^T, returned: what step_product's small rows read for a @ w (made once
        per forward pass, not per step)."""
        np.copyto(wt, w.T)
        return wt

    # the sequence layers (model/conv.py, model/lstm.py, model/ctc.py; model/lengths.py)
    def unfold(self, x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left):
        """cols <- x's taps per output row: a time convolution as one GEMM
        (model.kernels_seq.unfold)."""
        KS.unfold(x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left)

    def fold(self, dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left):
        """dx <- unfold's adjoint of dcols (model.kernels_seq.fold)."""
        KS.fold(dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left)

    def mask_rows(self, x, lengths):
        """Zero the padding rows of a time-major batch of the given Lengths."""
        KS.mask_rows(x, lengths.batch_sizes, lengths.nb)

    def dropout(self, x, out, keys, nb, salt, p):
        """out <- x * (layer salt's mask of these utterance keys) / (1 - p); out may be x
        (model.kernels_dropout)."""
        KD.drop(x, out, keys, nb, salt, KD.threshold_of(p), KD.scale_of(p))

    def layer_norm(self, z, gamma, beta, y, kind):
        """y <- f(gamma * (z - mean) / std + beta), each row over its channels
        (model.kernels_norm)."""
        KN.layer_norm_forward(z, gamma, beta, y, kind)

    def layer_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind):
        """dz (may be y) <- dLoss/dz from the forward's z and y and dy; ggamma, gbeta <- the
        column sums of dh * xh and dh (model.kernels_norm)."""
        KN.layer_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, self.norm_part, kind)

    def instance_norm(self, z, gamma, beta, y, kind, lengths):
        """y <- f(gamma * (z - mean) / std + beta), each channel of each sequence of the
        Lengths over its steps; the padding rows 0 (model.kernels_norm)."""
        KN.instance_norm_forward(z, gamma, beta, y, kind, lengths.nb, lengths.lengths,
                                 self._norm_seq(lengths.nb))

    def instance_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind, lengths):
        KN.instance_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, kind, lengths.nb,
                                  lengths.lengths, self._norm_seq(lengths.nb))

    def _norm_seq(self, nb):
        if len(self.norm_seq) < nb:
            self.norm_seq = np.empty((nb, 6, self.norm_seq.shape[2]), np.float64)
        return self.norm_seq

    # the Conformer's layers (model/conformer.py, model/kernels_conformer.py)
    def add_scaled(self, x, o, s, out):
        """out <- x + s * o (a residual add; out may be x)."""
        KF.add_scaled(x, o, x.dtype.type(s), out)

    def add_bias(self, z, b):
        KF.add_bias(z, b)

    def bias_swish(self, z, b, y):
        """z <- z + b (kept), y <- swish(z)."""
        KF.bias_swish(z, b, y)

    def swish(self, z, y):
        KF.swish_forward(z, y)

    def swish_backward(self, z, dy, dz):
        """dz <- dy * swish'(z) (dz may be dy)."""
        KF.swish_backward(z, dy, dz)

    def bias_glu(self, z, b, y):
        """z (R, 2M) <- z + b (kept), y (R, M) <- GLU(z)."""
        KF.bias_glu(z, b, y)

    def glu_backward(self, z, dy, dz):
        KF.glu_backward(z, dy, dz)

    def depthwise(self, x, w, b, y, lengths, left):
        """y <- the depthwise time convolution of x over each sequence's own steps."""
        KF.depthwise_forward(x, w, b, y, lengths.nb, lengths.lengths, left)

    def depthwise_backward(self, x, dy, w, dx, gw, gb, lengths, left):
        kernel, m = w.shape
        if self.depthwise_part.shape[1] < kernel + 1 or self.depthwise_part.shape[2] < m:
            self.depthwise_part = np.empty((K.NCHUNK, kernel + 1, m), np.float64)
        KF.depthwise_backward(x, dy, w, dx, gw, gb, lengths.nb, lengths.lengths, left,
                              self.depthwise_part)

    def rope(self, steps, dk, dtype):
        """The rotary embedding's (cos, sin) tables for at least `steps` steps (grown)."""
        have = self.rope_tables.get((dk, np.dtype(dtype)))
        if have is None or len(have[0]) < steps:
            have = KF.rope_tables(max(steps, 2 * len(have[0]) if have else 256), dk, dtype)
            self.rope_tables[(dk, np.dtype(dtype))] = have
        return have

    def to_heads(self, src, col, out, lengths, rotate, scale):
        """out (nb, H, T, dk) <- src's columns col.. per utterance and head (rotary when
        rotate), times scale; 0 past each utterance's end."""
        cos, sin = self.rope(out.shape[2], out.shape[3], out.dtype)
        KF.to_heads(src, col, out, lengths.nb, out.shape[1], lengths.lengths, cos, sin,
                    rotate, out.dtype.type(scale))

    def from_heads(self, blocks, dst, col, lengths, rotate, scale):
        """dst's columns col.. <- blocks laid back time-major (the rotation undone when
        rotate), times scale; the padding rows 0."""
        cos, sin = self.rope(blocks.shape[2], blocks.shape[3], blocks.dtype)
        KF.from_heads(blocks, dst, col, lengths.nb, lengths.lengths, cos, sin, rotate,
                      blocks.dtype.type(scale))

    def masked_softmax(self, s, p, lengths):
        KF.masked_softmax(s, p, lengths.lengths)

    def masked_softmax_backward(self, p, dp, ds, lengths):
        KF.masked_softmax_backward(p, dp, ds, lengths.lengths)

    def unfold2d(self, x, cols, nb, steps_in, steps_out, f_in, f_out, channels):
        KF.unfold2d(x, cols, nb, steps_in, steps_out, f_in, f_out, channels)

    def fold2d(self, dcols, dx, nb, steps_in, steps_out, f_in, f_out, channels):
        KF.fold2d(dcols, dx, nb, steps_in, steps_out, f_in, f_out, channels)

    def ctc_loss(self, z, b, targets, lengths, gb, scale=1.0):
        """The CTC loss of z (logits without bias, time-major, `lengths` the utterances'
        output steps) against targets (frames, ids, offsets): z <- scale * dLoss/d(z + b)
        (zero on the padding and for an utterance no alignment fits), gb <- its column sums
        (model.kernels_ctc). Returns (loss summed over the utterances, unscaled; tokens;
        utterances skipped: no alignment)."""
        frames = lengths.lengths
        ws = KCTC.workspace_offsets(frames, targets.offsets)
        alpha, beta, loss, feasible = self._ctc_scratch(int(ws[-1]), lengths.nb)
        KCTC.ctc_loss_grad(z, b, lengths.nb, frames, targets.ids, targets.offsets, scale, ws,
                           alpha, beta, loss, feasible)
        KL.column_sums(z, gb, self.partial)
        nb = lengths.nb
        return float(loss[:nb].sum()), len(targets.ids), nb - int(feasible[:nb].sum())

    def _ctc_scratch(self, size, nb):
        """The CTC recursions' log-space workspaces (alpha, beta: float32, size each) and the
        per-utterance loss and feasibility: grown when a batch needs more (a handful of
        times in a run; the kernel itself allocates nothing)."""
        have = getattr(self, "ctc_scratch", None)
        if have is None or len(have[0]) < size or len(have[2]) < nb:
            grow = max(size, 2 * len(have[0]) if have else 0)
            rows = max(nb, 2 * len(have[2]) if have else 16)
            self.ctc_scratch = (np.empty(grow, np.float32), np.empty(grow, np.float32),
                                np.empty(rows, np.float64), np.empty(rows, np.uint8))
        return self.ctc_scratch

    # the RNN-T's prediction network, joint and loss (model/transducer.py: the layer stores
    # its own 16-bit values, so HalfOps rounds nothing around these). shape: (nb, pos, frames,
    # u1s, row offsets, b0, b1, mode) of a group of utterances (model/kernels_joint.py)
    def add_row(self, x, b):
        """x (rows, m) += b (1, m)."""
        KJ.add_bias(x, b)

    def add_into(self, x, y):
        """x += y (same shape)."""
        KJ.add_into(x, y)

    def embed(self, table, tok, out):
        """out's rows <- table's rows tok (a zero row where tok is -1)."""
        KJ.embed(table, tok, out)

    def embed_backward(self, dy, tok, g):
        """g <- dy's rows summed into the rows tok of the table's gradient."""
        KJ.embed_backward(dy, tok, g)

    def zero_padding(self, x, tok):
        """x's rows where tok is -1 (the padding) <- 0."""
        KJ.zero_padding(x, tok)

    def joint_forward(self, enc, pred, shape, h, longest):
        """h <- tanh(enc_t (+|*) pred_u) of every lattice node of the group; longest: the most
        nodes of one utterance (what a GPU launch is sized by)."""
        KJ.joint_forward(enc, pred, *shape, h)

    def joint_backward(self, dh, h, enc, pred, shape, denc, dpred, most):
        """denc, dpred += dLoss/denc, dLoss/dpred of the group from dh (overwritten); most:
        (nodes, the most frames, the most targets + 1 of one utterance: GPU launch sizes)."""
        KJ.joint_backward(dh, h, enc, pred, *shape, denc, dpred)

    def rnnt_loss(self, z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, loss, ok,
                  fastemit_lambda):
        """The fused RNN-T loss (model.kernels_rnnt): z <- scale * dLoss/dz in place. Returns
        (the group's loss summed, unscaled; its utterances with an alignment)."""
        KR.rnnt_loss_grad(z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, loss,
                          ok, fastemit_lambda)
        return float(np.sum(loss)), int(np.sum(ok))

    def fake_quant(self, x, out, grid):
        """out <- x on the grid (model.quantize.Grid; out may be x); a grid of vectors
        (qat.weight_scale=channel) has a step per column."""
        if np.ndim(grid.step):
            KQ.fake_quant_channels(x, out, grid.step, grid.inv, grid.klo, grid.khi)
        else:
            KQ.fake_quant(x, out, grid.step, grid.inv, grid.klo, grid.khi)

    def column_abs_stats(self, x):
        """(max |x|, E[x^2], E|x|) per column of a 2-D x, float64 arrays."""
        out = np.empty((x.shape[1], 3))
        KQ.column_abs_stats(x, out)
        return out[:, 0], out[:, 1] / max(len(x), 1), out[:, 2] / max(len(x), 1)

    def fake_quant_backward(self, x, d, lo, hi):
        """d <- d straight through where lo <= x <= hi, 0 elsewhere, in place. Returns (sum
        of d where x < lo, where x > hi): the clip values' gradients."""
        part, _ = self._quant_scratch(len(x))
        KQ.fake_quant_backward(x, d, lo, hi, part)
        return float(part[:len(x), 0].sum()), float(part[:len(x), 1].sum())

    def abs_stats(self, x):
        """(max |x|, E[x^2], E|x|) of a 2-D x."""
        part, bits = self._quant_scratch(len(x))
        KQ.abs_stats(x, part, bits)
        return KQ.reduce_stats(part, x.shape)

    # the split softmax of a model-parallel group (hpcsgd/model/parallel.py)
    def split_xent_stats(self, z, b, y, lo, stats):
        KP.split_xent_stats(z, b, y, lo, stats, self.lanes)

    def split_xent_finish(self, z, y, lo, me, every, gb):
        """Returns (CE summed over the rows, rows whose whole argmax is the label)."""
        KP.split_xent_finish(z, y, lo, me, every, gb, self.partial, self.ce_part,
                             self.correct_part)
        return float(self.ce_part.sum()), int(self.correct_part.sum())

    def split_lse_stats(self, z, b, stats):
        KP.split_lse_stats(z, b, stats)

    def split_lse_finish(self, z, every):
        KP.split_lse_finish(z, every)

    def _quant_scratch(self, rows):
        """The row partials of the fake-quantization reductions (a weight matrix may have
        more rows than max_batch: grown once)."""
        if len(self.quant_part) < rows:
            self.quant_part = np.empty((rows, 3), np.float64)
            self.quant_bits = np.empty(rows, np.uint64)
        return self.quant_part, self.quant_bits


class CudaOps:
    """The same on a GPU rank: per-row CE and hits come back through small device buffers."""

    def __init__(self, max_batch, max_width, dtype):
        # each row's CE and hit (0 or 1) side by side: the step's loss read is one copy
        self.loss_rows = zeros((max_batch, 2), np.float64, "cuda")
        self.ce_rows, self.correct_rows = self.loss_rows[:, 0], self.loss_rows[:, 1]
        self.row_stats = zeros((max_batch, 2), np.float32, "cuda")   # float16 logits' rows
        self.norm_seq = None   # instance norm's scratch, made at its first use
        self.quant_part = None
        self.rope_tables = {}   # dk -> the rotary (cos, sin) on the device, grown (rope)
        # a CUDA Graph's capture (hpcsgd/graphs.py): softmax_xent leaves the loss in the row
        # buffers and returns (None, None); read_loss(n) after the graph's launch reads it
        self.defer_loss = False

    def read_loss(self, n):
        """(CE summed over rows 0..n-1, hits): one copy to the host (it waits for the pass)."""
        rows = self.loss_rows[:n].copy_to_host()
        return float(np.sum(rows[:, 0])), int(np.sum(rows[:, 1]))

    def bias_act(self, z, b, kind):
        KC.bias_act_forward(z, b, kind)

    def act_backward(self, h, d, dz, gb, kind):
        KC.act_backward(h, d, dz, gb, kind)

    def softmax_xent(self, z, b, y, gb, scale=1.0):
        """16-bit z: the kernels scale it before its store (one rounding, after scaling)."""
        if KC.sixteen_bit(z):   # each row's (max, 1 / sum), then a column pass
            KC.softmax_xent_backward(z, b, y, gb, self.ce_rows, self.correct_rows,
                                     self.row_stats, scale, read=False)
        else:
            KC.softmax_xent_backward(z, b, y, gb, self.ce_rows, self.correct_rows, read=False)
            half.scale(z, scale)
        half.scale(gb, scale)
        return (None, None) if self.defer_loss else self.read_loss(z.shape[0])

    def log_softmax(self, z, b):
        KC.log_softmax_forward(z, b)

    def exp(self, z):
        KC.exp_inplace(z)

    def scale(self, x, s):
        half.scale(x, s)

    def lstm_step(self, a, r, b, c_prev, c, h, ga, gh, hc):
        g = GATES * hc
        KC.lstm_forward_step(a[:, ga:ga + g], r[:, :g], b[:, ga:ga + g],
                             c_prev[:, gh:gh + hc], c[:, gh:gh + hc], h[:, gh:gh + hc])

    def lstm_step_backward(self, a, c_prev, c, dh, dr, dc, ga, gh, hc):
        g = GATES * hc
        KC.lstm_backward_step(a[:, ga:ga + g], c_prev[:, gh:gh + hc], c[:, gh:gh + hc],
                              dh[:, gh:gh + hc], dr[:, :hc], dc[:, :hc])

    def lstm_step2(self, fwd, bwd, b, hc):
        """Two launches: a GPU has no thread pool to wake."""
        a, r, c_prev, c, h = fwd
        self.lstm_step(a, r, b, c_prev, c, h, 0, 0, hc)
        a, r, c_prev, c, h = bwd
        self.lstm_step(a, r, b, c_prev, c, h, GATES * hc, hc, hc)

    def lstm_step_backward2(self, fwd, bwd, hc):
        self.lstm_step_backward(*fwd, 0, 0, hc)
        self.lstm_step_backward(*bwd, GATES * hc, hc, hc)

    def column_sums(self, d, gb):
        KC.column_sums(d, gb)

    def step_product(self, a, w, out, trans_b=False, wt=None):
        """cuBLAS for every size (a transposed w is the GEMM's argument: no copy)."""
        matmul(a, w, out, trans_b=trans_b)

    def transposed_copy(self, w, wt):
        return None   # cuBLAS transposes in the product

    def unfold(self, x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left):
        KC.unfold(x, cols, nb, steps_in, steps_out, kernel, stride, dilation, left)

    def fold(self, dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left):
        KC.fold(dcols, dx, nb, steps_in, steps_out, kernel, stride, dilation, left)

    def mask_rows(self, x, lengths):
        """The batch sizes go to the device once per Lengths (a pass's layers share it: one
        small allocation and copy per pass and geometry)."""
        if lengths.device_batch_sizes is None:
            lengths.device_batch_sizes = cuda_module.to_device(lengths.batch_sizes)
        KC.mask_rows(x, lengths.device_batch_sizes, lengths.nb)

    def dropout(self, x, out, keys, nb, salt, p):
        """keys: a device array (the network copies a pass's keys once)."""
        KC.drop(x, out, keys, nb, salt, KD.threshold_of(p), KD.scale_of(p))

    def layer_norm(self, z, gamma, beta, y, kind):
        KNC.layer_norm_forward(z, gamma, beta, y, kind)

    def layer_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind):
        """Every row's statistics go to row_stats (free here: the softmax's 16-bit path uses
        it only inside the loss, on the same stream)."""
        KNC.layer_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, self.row_stats, kind)

    def instance_norm(self, z, gamma, beta, y, kind, lengths):
        KNC.instance_norm_forward(z, gamma, beta, y, kind, lengths.nb, self._lengths(lengths),
                                  self._norm_seq(lengths.nb, z.shape[1]))

    def instance_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind, lengths):
        KNC.instance_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, kind, lengths.nb,
                                   self._lengths(lengths),
                                   self._norm_seq(lengths.nb, z.shape[1]))

    def _lengths(self, lengths):
        """The sequence lengths on the device, copied once per Lengths (as mask_rows)."""
        if lengths.device_lengths is None:
            lengths.device_lengths = cuda_module.to_device(lengths.lengths)
        return lengths.device_lengths

    def _norm_seq(self, nb, m):
        """float64 (>= nb, 6, >= m) device scratch of instance norm's per-sequence sums."""
        if self.norm_seq is None or self.norm_seq.shape[0] < nb or self.norm_seq.shape[2] < m:
            self.norm_seq = zeros((max(nb, 1), 6, m), np.float64, "cuda")
        return self.norm_seq

    # the Conformer's layers (model/conformer.py; model/kernels_conformer_cuda.py): CpuOps'
    # signatures, a sequence's lengths on the device as instance norm's (_lengths)
    def add_scaled(self, x, o, s, out):
        """out <- x + s * o (a residual add; out may be x)."""
        KFC.add_scaled(x, o, s, out)

    def add_bias(self, z, b):
        KFC.add_bias(z, b)

    def bias_swish(self, z, b, y):
        """z <- z + b (kept), y <- swish(z)."""
        KFC.bias_swish(z, b, y)

    def swish(self, z, y):
        KFC.swish_forward(z, y)

    def swish_backward(self, z, dy, dz):
        """dz <- dy * swish'(z) (dz may be dy)."""
        KFC.swish_backward(z, dy, dz)

    def bias_glu(self, z, b, y):
        """z (R, 2M) <- z + b (kept), y (R, M) <- GLU(z)."""
        KFC.bias_glu(z, b, y)

    def glu_backward(self, z, dy, dz):
        KFC.glu_backward(z, dy, dz)

    def depthwise(self, x, w, b, y, lengths, left):
        """y <- the depthwise time convolution of x over each sequence's own steps."""
        KFC.depthwise_forward(x, w, b, y, lengths.nb, self._lengths(lengths), left)

    def depthwise_backward(self, x, dy, w, dx, gw, gb, lengths, left):
        """No scratch: the taps' sums are a block per column tile and tap."""
        KFC.depthwise_backward(x, dy, w, dx, gw, gb, lengths.nb, self._lengths(lengths), left)

    def rope(self, steps, dk):
        """The rotary embedding's (cos, sin) float32 device tables for at least `steps` steps,
        grown as CpuOps.rope (doubled, 256 at least: a handful of copies a run). float32
        whatever the storage: the kernels compute in float32, as HalfOps' emulation does."""
        have = self.rope_tables.get(dk)
        if have is None or len(have[0]) < steps:
            grow = max(steps, 2 * len(have[0]) if have else 256)
            have = tuple(cuda_module.to_device(t)
                         for t in KF.rope_tables(grow, dk, np.float32))
            self.rope_tables[dk] = have
        return have

    def to_heads(self, src, col, out, lengths, rotate, scale):
        """out (nb, H, T, dk) <- src's columns col.. per utterance and head (rotary when
        rotate), times scale; 0 past each utterance's end."""
        cos, sin = self.rope(out.shape[2], out.shape[3])
        KFC.to_heads(src, col, out, lengths.nb, out.shape[1], self._lengths(lengths), cos, sin,
                     rotate, scale)

    def from_heads(self, blocks, dst, col, lengths, rotate, scale):
        """dst's columns col.. <- blocks laid back time-major (the rotation undone when
        rotate), times scale; the padding rows 0."""
        cos, sin = self.rope(blocks.shape[2], blocks.shape[3])
        KFC.from_heads(blocks, dst, col, lengths.nb, self._lengths(lengths), cos, sin, rotate,
                       scale)

    def masked_softmax(self, s, p, lengths):
        KFC.masked_softmax(s, p, self._lengths(lengths))

    def masked_softmax_backward(self, p, dp, ds, lengths):
        KFC.masked_softmax_backward(p, dp, ds, self._lengths(lengths))

    def unfold2d(self, x, cols, nb, steps_in, steps_out, f_in, f_out, channels):
        KFC.unfold2d(x, cols, nb, steps_in, steps_out, f_in, f_out, channels)

    def fold2d(self, dcols, dx, nb, steps_in, steps_out, f_in, f_out, channels):
        KFC.fold2d(dcols, dx, nb, steps_in, steps_out, f_in, f_out, channels)

    def ctc_loss(self, z, b, targets, lengths, gb, scale=1.0):
        """One block per utterance (model.kernels_ctc_cuda). The targets and the workspace
        offsets go to the device (small copies); the losses and feasibility come back in
        one copy (a sync point, as the softmax's loss read). A 16-bit z gets the scaled
        gradient rounded once; gb sums the stored values."""
        frames, nb = lengths.lengths, lengths.nb
        ws = KCTC.workspace_offsets(frames, targets.offsets)
        ids, ints, alpha, beta, loss, feasible = self._ctc_scratch(int(ws[-1]), nb,
                                                                   len(targets.ids))
        # frames, target offsets and workspace offsets in one int64 copy, the ids in another
        ints[:3 * nb + 2].copy_to_device(np.concatenate([frames, targets.offsets, ws]))
        if len(targets.ids):
            ids[:len(targets.ids)].copy_to_device(np.ascontiguousarray(targets.ids, np.int32))
        KCC.ctc_loss_grad(z, b, nb, ints[:nb], ids, ints[nb:2 * nb + 1], scale,
                          ints[2 * nb + 1:3 * nb + 2], alpha, beta, loss[:nb], feasible[:nb])
        KC.column_sums(z, gb)
        # device -> host: the first copy waits for the kernel (a sync point, as the softmax's)
        total = float(loss[:nb].copy_to_host().sum())
        return total, len(targets.ids), nb - int(feasible[:nb].copy_to_host().sum())

    def _ctc_scratch(self, size, nb, tokens):
        """Device buffers of the CTC loss, grown when a batch needs more (a handful of times
        a run): token ids, the int64 offsets, alpha, beta, each utterance's loss and
        feasibility."""
        have = getattr(self, "ctc_scratch", None)
        need = (max(tokens, 1), 3 * nb + 2, max(size, 1), max(size, 1), nb, nb)
        if have is None or any(len(a) < k for a, k in zip(have, need)):
            sizes = [max(k, 2 * len(a)) if have else max(k, 64)
                     for k, a in zip(need, have or need)]
            self.ctc_scratch = tuple(zeros(k, t, "cuda") for k, t in zip(
                sizes, (np.int32, np.int64, np.float32, np.float32, np.float64, np.uint8)))
        return self.ctc_scratch

    # the RNN-T's (CpuOps's notes): model.kernels_joint_cuda, model.kernels_rnnt_cuda
    def add_row(self, x, b):
        KJC.add_bias(x, b)

    def add_into(self, x, y):
        KJC.add_into(x, y)

    def embed(self, table, tok, out):
        KJC.embed(table, tok, out)

    def embed_backward(self, dy, tok, g):
        KJC.embed_backward(dy, tok, g)

    def zero_padding(self, x, tok):
        KJC.zero_padding(x, tok)

    def joint_forward(self, enc, pred, shape, h, longest):
        KJC.joint_forward(enc, pred, *shape, h, longest)

    def joint_backward(self, dh, h, enc, pred, shape, denc, dpred, most):
        n, longest_t, longest_u = most
        KJC.joint_backward(dh, h, n, enc, pred, *shape, denc, dpred, longest_t, longest_u)

    def rnnt_loss(self, z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, loss, ok,
                  fastemit_lambda):
        """Each row's log-sum-exp kept apart (z may be 16-bit); the losses and feasibility
        read back (device -> host copies: a sync point, as CTC's loss read)."""
        KRC.rnnt_loss_grad(z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, loss,
                           ok, fastemit_lambda, lse=self._rnnt_lse(len(z)))
        return float(np.sum(loss.copy_to_host())), int(np.sum(ok.copy_to_host()))

    def _rnnt_lse(self, rows):
        """The loss's per-row log-sum-exp workspace (float32), grown to the largest group."""
        have = getattr(self, "rnnt_lse", None)
        if have is None or len(have) < rows:
            self.rnnt_lse = zeros(max(rows, 2 * len(have) if have is not None else 1),
                                  np.float32, "cuda")
        return self.rnnt_lse[:rows]

    def fake_quant(self, x, out, grid):
        if np.ndim(grid.step):   # per column: the vectors go to the device (a small copy)
            KC.fake_quant_channels(x, out, grid.step, grid.inv, grid.klo, grid.khi)
        else:
            KC.fake_quant(x, out, grid.step, grid.inv, grid.klo, grid.khi)

    def column_abs_stats(self, x):
        out = KC.column_abs_stats(x, self._column_part(x.shape[1]))
        return out[:, 0], out[:, 1] / max(len(x), 1), out[:, 2] / max(len(x), 1)

    def _column_part(self, columns):
        if getattr(self, "column_part", None) is None or len(self.column_part) < columns:
            self.column_part = zeros((columns, 3), np.float64, "cuda")
        return self.column_part

    def fake_quant_backward(self, x, d, lo, hi):
        return KC.fake_quant_backward(x, d, lo, hi, self._quant_part(len(x)))

    def abs_stats(self, x):
        return KC.abs_stats(x, self._quant_part(len(x)))

    def _quant_part(self, rows):
        """float64 (rows, 3) device scratch of the fake-quantization reductions (grown to the
        largest matrix: a weight's input units may exceed max_batch)."""
        if self.quant_part is None or len(self.quant_part) < rows:
            self.quant_part = zeros((rows, 3), np.float64, "cuda")
        return self.quant_part


class GemmOnly:
    """Every element-wise kernel skipped: a step of GEMMs alone, into the step's buffers (the
    recurrent products included, as the device's ops compute them)."""

    def step_product(self, a, w, out, trans_b=False, wt=None):
        if isinstance(a, np.ndarray):
            step_product(a, w, out, trans_b, wt)
        else:
            matmul(a, w, out, trans_b=trans_b)

    def transposed_copy(self, w, wt):
        if isinstance(w, np.ndarray):
            np.copyto(wt, w.T)
            return wt
        return None

    def lstm_recurrent_step(self, steps, b, hc, xs):
        if isinstance(b, np.ndarray):   # CPU ranks: the products as the fused step does them
            cpu_recurrent_forward(steps, b, hc, xs, False)
        else:
            product_then_step(self, steps, b, hc)

    def lstm_recurrent_step_backward(self, steps, hc, xs):
        if isinstance(steps[0][3], np.ndarray):
            cpu_recurrent_backward(steps, hc, xs, False)
        else:
            product_then_step_backward(self, steps, hc)

    def lstm_sequences(self, dirs, gates, cells, h, y, uts, rs, b, zeros, bs, nb, hc, xs,
                       progress=None, every=0):
        return isinstance(gates, np.ndarray) and sequences_forward(
            dirs, gates, cells, h, y, uts, rs, b, zeros, bs, nb, hc, xs, progress, every, False)

    def lstm_sequences_backward(self, dirs, gates, cells, dy, us, drs, dcs, zeros, bs, nb, hc,
                                xs, progress=None, every=0):
        return isinstance(gates, np.ndarray) and sequences_backward(
            dirs, gates, cells, dy, us, drs, dcs, zeros, bs, nb, hc, xs, progress, every, False)

    def lstm_step(self, a, r, b, c_prev, c, h, ga, gh, hc):
        pass

    def lstm_step_backward(self, a, c_prev, c, dh, dr, dc, ga, gh, hc):
        pass

    def lstm_step2(self, fwd, bwd, b, hc):
        pass

    def lstm_step_backward2(self, fwd, bwd, hc):
        pass

    def column_sums(self, d, gb):
        pass

    def unfold(self, x, cols, *shape):
        pass

    def fold(self, dcols, dx, *shape):
        pass

    def mask_rows(self, x, lengths):
        pass

    def dropout(self, x, out, keys, nb, salt, p):
        pass

    def layer_norm(self, z, gamma, beta, y, kind):
        pass

    def layer_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind):
        pass

    def instance_norm(self, z, gamma, beta, y, kind, lengths):
        pass

    def instance_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind, lengths):
        pass

    def ctc_loss(self, z, b, targets, lengths, gb, scale=1.0):
        return 0.0, 0, 0

    def add_row(self, x, b):
        pass

    def add_into(self, x, y):
        pass

    def embed(self, table, tok, out):
        pass

    def embed_backward(self, dy, tok, g):
        pass

    def zero_padding(self, x, tok):
        pass

    def joint_forward(self, enc, pred, shape, h, longest):
        pass

    def joint_backward(self, dh, h, enc, pred, shape, denc, dpred, most):
        pass

    def rnnt_loss(self, z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, loss, ok,
                  fastemit_lambda):
        return 0.0, len(ok)   # nothing skipped: every utterance counts as scored

    def round(self, x, out):   # the 16-bit storage's rounding (HalfOps.round)
        pass

    def add_scaled(self, x, o, s, out):
        pass

    def add_bias(self, z, b):
        pass

    def bias_swish(self, z, b, y):
        pass

    def swish(self, z, y):
        pass

    def swish_backward(self, z, dy, dz):
        pass

    def bias_glu(self, z, b, y):
        pass

    def glu_backward(self, z, dy, dz):
        pass

    def depthwise(self, x, w, b, y, lengths, left):
        pass

    def depthwise_backward(self, x, dy, w, dx, gw, gb, lengths, left):
        pass

    def to_heads(self, src, col, out, lengths, rotate, scale):
        pass

    def from_heads(self, blocks, dst, col, lengths, rotate, scale):
        pass

    def masked_softmax(self, s, p, lengths):
        pass

    def masked_softmax_backward(self, p, dp, ds, lengths):
        pass

    def unfold2d(self, x, cols, *shape):
        pass

    def fold2d(self, dcols, dx, *shape):
        pass

    def fake_quant(self, x, out, grid):
        pass

    def fake_quant_backward(self, x, d, lo, hi):
        return 0.0, 0.0

    def abs_stats(self, x):
        return 1.0, 1.0, 1.0

    def column_abs_stats(self, x):
        ones = np.ones(x.shape[1])
        return ones, ones, ones

    def bias_act(self, z, b, kind):
        pass

    def act_backward(self, h, d, dz, gb, kind):
        pass

    def softmax_xent(self, z, b, y, gb, scale=1.0):
        return 0.0, 0

    def split_xent_stats(self, z, b, y, lo, stats):
        pass

    def split_xent_finish(self, z, y, lo, me, every, gb):
        return 0.0, 0

    def split_lse_stats(self, z, b, stats):
        pass

    def split_lse_finish(self, z, every):
        pass

    def log_softmax(self, z, b):
        pass

    def exp(self, z):
        pass

    def scale(self, x, s):
        pass


class HalfOps:
    """Mixed precision's (kind "float16") or bf16's (kind "bfloat16") element-wise steps on
    float32 buffers that hold 16-bit float values: a GEMM's output is rounded to the format
    before a kernel reads it (as cuBLAS would store it), and a kernel's output after it wrote
    it, each in place. The kernels themselves compute in float32 (as a GPU's do on 16-bit
    operands). Bias gradients are the kernels' float32 column sums of dz before its rounding
    (half an ulp of the format per element more precise than a sum of the stored dz).

    GPU ranks store in 16-bit arrays instead (model/network.py: storage; bfloat16 as uint16):
    there the GEMM's or kernel's store has rounded, once, to the same value, and `store`
    leaves the array alone; the kernels compute the same float32 values (kernels_cuda.py)."""

    def __init__(self, ops, kind="float16"):
        self.ops, self.kind = ops, kind
        self.round = half.round_to(kind)

    def store(self, x):
        """x as stored in the 16-bit format: a float32 buffer rounded in place; a 16-bit
        array (float16, or uint16 holding bfloat16 bits) already is."""
        if x.dtype == np.float32:
            self.round(x, x)

    def bias_act(self, z, b, kind):
        self.store(z)
        self.ops.bias_act(z, b, kind)
        self.store(z)

    def act_backward(self, h, d, dz, gb, kind):
        self.store(d)               # dx of the layer above: a GEMM's 16-bit output
        self.ops.act_backward(h, d, dz, gb, kind)
        self.store(dz)

    def softmax_xent(self, z, b, y, gb, scale=1.0):
        """dLoss/dz rounded once, after scaling (rounding before would flush what the scale
        is there to keep); the bias gradient: the float32 sums times the scale, rounded."""
        self.store(z)               # the logits: a GEMM's 16-bit output
        out = self.ops.softmax_xent(z, b, y, gb, scale)
        self.store(z)
        self.store(gb)
        return out

    def log_softmax(self, z, b):
        self.ops.log_softmax(z, b)

    def exp(self, z):
        self.ops.exp(z)

    def scale(self, x, s):
        """x *= s, then stored as a 16-bit float."""
        self.ops.scale(x, s)
        self.store(x)

    # The LSTM's step kernels get whole C-contiguous row blocks: a step's gate rows hold both
    # directions' columns, the other direction's maybe at another stage. Every value stored
    # there is either a GEMM's output, which is rounded before any kernel reads it, or a
    # kernel's output, rounded after: rounding a whole block is idempotent on both.
    def lstm_step(self, a, r, b, c_prev, c, h, ga, gh, hc):
        self._before_step(a, r)
        self.ops.lstm_step(a, r, b, c_prev, c, h, ga, gh, hc)
        self._after_step(a, c, h)

    def lstm_step2(self, fwd, bwd, b, hc):
        for a, r, *_ in (fwd, bwd):
            self._before_step(a, r)
        self.ops.lstm_step2(fwd, bwd, b, hc)
        for a, _, _, c, h in (fwd, bwd):
            self._after_step(a, c, h)

    def lstm_step_backward(self, a, c_prev, c, dh, dr, dc, ga, gh, hc):
        self._before_step(dh, dr)            # dx of the layer above, dgates_{t+1} @ U^T
        self.ops.lstm_step_backward(a, c_prev, c, dh, dr, dc, ga, gh, hc)
        self._after_step(a, dc)

    def lstm_step_backward2(self, fwd, bwd, hc):
        for _, _, _, dh, dr, _ in (fwd, bwd):
            self._before_step(dh, dr)
        self.ops.lstm_step_backward2(fwd, bwd, hc)
        for a, _, _, _, _, dc in (fwd, bwd):
            self._after_step(a, dc)

    def column_sums(self, d, gb):
        self.ops.column_sums(d, gb)

    def step_product(self, a, w, out, trans_b=False, wt=None):
        self.ops.step_product(a, w, out, trans_b, wt)   # rounded by the step that reads it

    def transposed_copy(self, w, wt):
        return self.ops.transposed_copy(w, wt)

    def unfold(self, x, cols, *shape):
        self.ops.unfold(x, cols, *shape)   # a copy of values stored already

    def fold(self, dcols, dx, *shape):
        self.store(dcols)                  # dz @ W^T: a GEMM's 16-bit output
        self.ops.fold(dcols, dx, *shape)
        self.store(dx)

    def mask_rows(self, x, lengths):
        self.ops.mask_rows(x, lengths)     # zeros: exact in any format

    def dropout(self, x, out, keys, nb, salt, p):
        self.ops.dropout(x, out, keys, nb, salt, p)
        self.store(out)                    # x / (1 - p): rounded to the format once

    def layer_norm(self, z, gamma, beta, y, kind):
        self.store(z)                      # x @ W: a GEMM's 16-bit output
        self.ops.layer_norm(z, gamma, beta, y, kind)
        self.store(y)

    def layer_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind):
        """As act_backward: dz rounded once; the parameters' gradients float32 sums."""
        self.store(dy)
        self.ops.layer_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, kind)
        self.store(dz)

    def instance_norm(self, z, gamma, beta, y, kind, lengths):
        self.store(z)
        self.ops.instance_norm(z, gamma, beta, y, kind, lengths)
        self.store(y)

    def instance_norm_backward(self, z, y, dy, gamma, dz, ggamma, gbeta, kind, lengths):
        self.store(dy)
        self.ops.instance_norm_backward(z, y, dy, gamma, dz, ggamma, gbeta, kind, lengths)
        self.store(dz)

    def ctc_loss(self, z, b, targets, lengths, gb, scale=1.0):
        """As softmax_xent: the 16-bit logits in, the scaled gradient rounded once after;
        the loss from float32 arithmetic on the 16-bit logits."""
        self.store(z)
        out = self.ops.ctc_loss(z, b, targets, lengths, gb, scale)
        self.store(z)
        self.store(gb)
        return out

    # the RNN-T's kernels: the transducer stores its own values (model/transducer.py: _store),
    # so nothing is rounded around them here
    def add_row(self, x, b):
        self.ops.add_row(x, b)

    def add_into(self, x, y):
        self.ops.add_into(x, y)

    def embed(self, table, tok, out):
        self.ops.embed(table, tok, out)

    def embed_backward(self, dy, tok, g):
        self.ops.embed_backward(dy, tok, g)

    def zero_padding(self, x, tok):
        self.ops.zero_padding(x, tok)

    def joint_forward(self, enc, pred, shape, h, longest):
        self.ops.joint_forward(enc, pred, shape, h, longest)

    def joint_backward(self, dh, h, enc, pred, shape, denc, dpred, most):
        self.ops.joint_backward(dh, h, enc, pred, shape, denc, dpred, most)

    def rnnt_loss(self, *args):
        return self.ops.rnnt_loss(*args)

    # the Conformer's layers: GEMM outputs rounded before a kernel reads them, a kernel's
    # outputs after it wrote them; parameter gradients are float32 sums
    def add_scaled(self, x, o, s, out):
        self.store(o)                      # a GEMM's output, or a stored one
        self.ops.add_scaled(x, o, s, out)
        self.store(out)

    def add_bias(self, z, b):
        self.store(z)
        self.ops.add_bias(z, b)
        self.store(z)

    def bias_swish(self, z, b, y):
        self.store(z)
        self.ops.bias_swish(z, b, y)
        self.store(z)
        self.store(y)

    def swish(self, z, y):
        self.ops.swish(z, y)
        self.store(y)

    def swish_backward(self, z, dy, dz):
        self.store(dy)
        self.ops.swish_backward(z, dy, dz)
        self.store(dz)

    def bias_glu(self, z, b, y):
        self.store(z)
        self.ops.bias_glu(z, b, y)
        self.store(z)
        self.store(y)

    def glu_backward(self, z, dy, dz):
        self.store(dy)
        self.ops.glu_backward(z, dy, dz)
        self.store(dz)

    def depthwise(self, x, w, b, y, lengths, left):
        self.ops.depthwise(x, w, b, y, lengths, left)
        self.store(y)

    def depthwise_backward(self, x, dy, w, dx, gw, gb, lengths, left):
        self.ops.depthwise_backward(x, dy, w, dx, gw, gb, lengths, left)
        self.store(dx)

    def to_heads(self, src, col, out, lengths, rotate, scale):
        self.store(src)
        self.ops.to_heads(src, col, out, lengths, rotate, scale)
        self.store(out)

    def from_heads(self, blocks, dst, col, lengths, rotate, scale):
        self.store(blocks)
        self.ops.from_heads(blocks, dst, col, lengths, rotate, scale)
        self.store(dst)

    def masked_softmax(self, s, p, lengths):
        self.store(s)
        self.ops.masked_softmax(s, p, lengths)
        self.store(p)

    def masked_softmax_backward(self, p, dp, ds, lengths):
        self.store(dp)
        self.ops.masked_softmax_backward(p, dp, ds, lengths)
        self.store(ds)

    def unfold2d(self, x, cols, *shape):
        self.ops.unfold2d(x, cols, *shape)    # a copy of values stored already

    def fold2d(self, dcols, dx, *shape):
        self.store(dcols)
        self.ops.fold2d(dcols, dx, *shape)
        self.store(dx)

    def _before_step(self, *gemm_outputs):
        for x in gemm_outputs:
            self.store(x)

    _after_step = _before_step   # the kernel's outputs: stored in the 16-bit format too


def step_product(a, w, out, trans_b=False, wt=None):
    """A CPU time step's product (CpuOps.step_product): out = a @ w = a @ wt^T, or a @ w^T;
    at most kernels_lstm.SMALL_ROWS rows by small_matmul_nt, else BLAS."""
    if len(a) <= KL.SMALL_ROWS:
        KL.small_matmul_nt(a, w if trans_b else wt, out)
    else:
        matmul(a, w, out, trans_b=trans_b)


def lstm_forward_step(ops, steps, b, hc, xs):
    """One time step of an LSTM layer's directions: steps holds per direction (h_prev, u, ut,
    r, a, c_prev, c, h) -- the previous step's outputs (None at the direction's first step,
    where r and c_prev are zeros), U and U^T (CPU), the product's rows r, then lstm_step's
    arguments; xs (dirs, SMALL_ROWS * 4hc) scratch. Ops with a fused step (CpuOps) do the
    products in the step's launch; the others (CudaOps; HalfOps, whose products are rounded
    before the step reads them) the product, then the step."""
    fused = getattr(ops, "lstm_recurrent_step", None)
    if fused is not None:
        fused(steps, b, hc, xs)
    else:
        product_then_step(ops, steps, b, hc)


def product_then_step(ops, steps, b, hc):
    args = []
    for hp, u, ut, r, a, cp, c, h in steps:
        if hp is not None:
            ops.step_product(hp, u, r, wt=ut)
        args.append((a, r, cp, c, h))
    if len(args) == 2:
        ops.lstm_step2(args[0], args[1], b, hc)
    else:
        a, r, cp, c, h = args[0]
        ops.lstm_step(a, r, b, cp, c, h, 0, 0, hc)


def lstm_backward_step(ops, steps, hc, xs):
    """One time step backwards: steps holds per direction (g_later, u, dr, a, c_prev, c, dh,
    dc) -- the later step's gate gradients (None at the direction's last step, where dr is
    zeros), U, the product's rows dr, then lstm_step_backward's arguments (as
    lstm_forward_step)."""
    fused = getattr(ops, "lstm_recurrent_step_backward", None)
    if fused is not None:
        fused(steps, hc, xs)
    else:
        product_then_step_backward(ops, steps, hc)


def product_then_step_backward(ops, steps, hc):
    args = []
    for gl, u, dr, a, cp, c, dh, dc in steps:
        if gl is not None:
            ops.step_product(gl, u, dr, trans_b=True)
        args.append((a, cp, c, dh, dr, dc))
    if len(args) == 2:
        ops.lstm_step_backward2(args[0], args[1], hc)
    else:
        ops.lstm_step_backward(*args[0], 0, 0, hc)


def _step_operand(a, w, out, trans_b, d, xs):
    """The fused launch's product operand for direction d: a (m, K) copied to the scratch xs
    as a C-contiguous block; a block of no rows where there is no product (a is None) or
    BLAS makes it here, before the launch (more than SMALL_ROWS rows: out = a @ w, or
    a @ w^T)."""
    if a is None or len(a) > KL.SMALL_ROWS:
        if a is not None:
            matmul(a, w, out, trans_b=trans_b)
        return out[:0]
    m, k = a.shape
    x = xs[d, :m * k].reshape(m, k)
    np.copyto(x, a)
    return x


def cpu_recurrent_forward(steps, b, hc, xs, elementwise):
    """lstm_forward_step on CPU ranks: products of at most SMALL_ROWS rows inside the launch
    (kernels_lstm.lstm_recurrent_forward), larger ones by BLAS before it."""
    args = [(_step_operand(hp, u, r, False, d, xs), ut, r, a, cp, c, h)
            for d, (hp, u, ut, r, a, cp, c, h) in enumerate(steps)]
    KL.lstm_recurrent_forward(args, b, hc, elementwise)


def cpu_recurrent_backward(steps, hc, xs, elementwise):
    """lstm_backward_step on CPU ranks (as cpu_recurrent_forward)."""
    args = [(_step_operand(gl, u, dr, True, d, xs), u, dr, a, cp, c, dh, dc)
            for d, (gl, u, dr, a, cp, c, dh, dc) in enumerate(steps)]
    KL.lstm_recurrent_backward(args, hc, elementwise)


def in_parts(run, steps, progress, every):
    """run(s0, s1) over steps 0 .. steps - 1 in parts of `every` steps (all at once without a
    progress to call), progress() after each part: the exchange in flight polled between."""
    part = every if progress is not None and every > 0 else max(steps, 1)
    for s0 in range(0, steps, part):
        run(s0, min(steps, s0 + part))
        if progress is not None:
            progress()


def sequences_forward(dirs, gates, cells, h, y, uts, rs, b, zeros, bs, nb, hc, xs, progress,
                      every, elementwise):
    """CpuOps.lstm_sequences (GemmOnly's: elementwise False)."""
    if not KL.whole_sequences(nb, hc, dirs):
        return False
    in_parts(lambda s0, s1: KL.lstm_sequences_forward(
        dirs, gates, cells, h, y, uts, rs, b, zeros, bs, nb, hc, xs, elementwise, s0, s1),
        len(bs), progress, every)
    return True


def sequences_backward(dirs, gates, cells, dy, us, drs, dcs, zeros, bs, nb, hc, xs, progress,
                       every, elementwise):
    """CpuOps.lstm_sequences_backward (GemmOnly's: elementwise False)."""
    if not KL.whole_sequences(nb, hc, dirs):
        return False
    in_parts(lambda s0, s1: KL.lstm_sequences_backward(
        dirs, gates, cells, dy, us, drs, dcs, zeros, bs, nb, hc, xs, elementwise, s0, s1),
        len(bs), progress, every)
    return True


def make_ops(device, max_batch, max_width, dtype):
    return (CudaOps if device == "cuda" else CpuOps)(max_batch, max_width, dtype)
