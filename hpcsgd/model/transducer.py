"""RNN-Transducer acoustic models (Graves 2012): the CTC models' encoder (model/encoder.py), a
prediction network over the previous tokens and a joint network, trained with the RNN-T loss
-- the model of IBM's INT4 paper (Saon et al.) and of today's streaming recognizers.

    net = rnnt(40, ["stack 3", "blstm 256", "blstm 256"], num_tokens=40,
               predictor=["lstm 256"], embed=64, joint=256, joint_mode="add")
    loss, tokens = net.forward_backward(params, grads, x, targets, n)

The whole transducer after the encoder is one output layer (Transducer), so the step, the
exchange, the optimizer and the checkpoints see one Network with one flat parameter buffer,
as for every model family:

    enc  = x @ We + be                 the encoder's joint projection (the layer's forward;
                                       T*nb rows, time-major: what model.forward returns)
    pred = LSTM(E[y_{u-1}]) @ Wp + bp  the prediction network over [blank, y_1 .. y_U]
                                       (blank as the start symbol, u = 0 .. U)
    h    = tanh(enc_t + pred_u)        every lattice node (t, u) of every utterance, packed
           tanh(enc_t * pred_u)        (joint_mode "mul": IBM's multiplicative joint)
    z    = h @ Wo + bo                 logits over the tokens and the blank (id 0)

and the fused RNN-T loss (model/kernels_rnnt.py) turns z into dLoss/dz in place. The lattice
of utterance b is T'_b x (U_b + 1) rows, packed with no padding; the joint runs over groups of
utterances whose h and z fit `joint_budget` bytes (an utterance larger than it runs alone), so
the B*T*U*V logits are never all in memory at once. Backward runs group by group: z -> gWo,
gbo, dh -> (model/kernels_joint.py) denc, dpred summed over the lattice; then the prediction
network's backward once, and the encoder projection's as any layer's (Network's loop).

The prediction network's sequences are its own time-major batch, sorted by length
(model.lengths.Lengths needs that): `order` lists the utterances longest target first,
pos[b] is utterance b's place in it.

Buffers: the lattice and prediction sizes are not a function of the batch's rows (they grow
with the targets), so this layer keeps its own scratch arrays, grown on demand (a handful of
times in a run) -- the one layer that holds arrays.

Utterances no transducer can score (no output frame, or no target: kernels_rnnt's rule) give
loss 0 and gradient 0 and are counted (skipped), as CTC's infeasible ones.

Mixed precision and bf16 (CPU ranks: the emulation of model/network.py) round where a GPU
would store in 16 bits: every GEMM's and kernel's output here (enc, pred, h, the logits, the
loss's scaled gradient, dh, denc, dpred) and, through model.ops.HalfOps, the prediction
network's LSTM kernels; the loss runs in float32 on the 16-bit logits, as CTC's.

The element-wise work and the loss go through `ops` like every layer's (model/ops.py:
add_row, embed, embed_backward, zero_padding, joint_forward, joint_backward, add_into,
rnnt_loss): CpuOps runs kernels_joint's and kernels_rnnt's kernels, CudaOps their CUDA twins,
GemmOnly nothing (bench train's roofline).

GPU ranks (device "cuda"): every buffer on the device; a batch's index arrays copied once per
(sub-)batch, the losses read back once per sub-batch. Under mixed or bf16 the values above
are stored in 16 bits (`storage`: h and the logits too -- the joint's memory halved), while
denc and dpred are float32 sums rounded once into 16-bit storage at the end. Searches of a
GPU model run on the host (on_host), through the layer's own start, step and joint_logits.
"""
import numpy as np

from hpcsgd.device import assign, matmul, zero, zeros
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model import kernels_joint as KJ
from hpcsgd.model import kernels_rnnt as KR
from hpcsgd.model.encoder import encoder_layers, parse_spec
from hpcsgd.model.flat import ParamSpec
from hpcsgd.model.layers import glorot_uniform
from hpcsgd.model.lengths import Lengths
from hpcsgd.model.lstm import LSTM, on_grid
from hpcsgd.model.network import Network
from hpcsgd.model.quantize import symmetric_grid

JOINT_MODES = tuple(KJ.MODES)
DEFAULT_JOINT_BUDGET = 256 << 20   # bytes of h and z per joint group (rnnt.joint_memory_mb)


def predictor_layers(num_tokens, embed, specs):
    """The prediction network's LSTM layers over an embedding of `embed` values: forward
    ("lstm H") layers only -- it runs over the tokens emitted so far, so it must be causal."""
    layers, n_in = [], int(embed)
    for k, text in enumerate(specs):
        spec = parse_spec(text)
        if spec["kind"] != "lstm":
            raise ValueError(f"prediction network layer {text!r}: 'lstm H' layers only (it "
                             f"reads the tokens emitted so far: causal, no convolution, no "
                             f"backward direction)")
        layers.append(LSTM(f"pred.lstm.{k}", n_in, spec["units"], bidirectional=False))
        n_in = layers[-1].n_out
    return layers, n_in


class Transducer:
    """The output layer of an RNN-T model: the encoder's joint projection (its forward), the
    prediction network and the joint (its loss). Parameters joint.enc.w/b (the encoder's
    projection), pred.embed (the token embedding, row 0 the blank as the start symbol), the
    predictor's LSTM layers pred.lstm.l.w/u/b, joint.pred.w/b (its projection), joint.out.w/b
    (the joint's output layer)."""
    tokens = True   # its loss reads a batch's token targets at the output's Lengths
    # quantization-aware training (model/quantize.py; the INT4 paper's RNN-T recipe): the
    # joint stays float -- its input (the encoder's output), the encoder and predictor
    # projections and the output layer -- while the prediction network is quantized: its
    # embedding and LSTM weights, its LSTMs' hidden state, and (input_bits, set by the
    # quantizer) the input of each LSTM layer above the first on the fixed grid of [-1, 1]
    # (the first one's input is a row of the quantized embedding: on the weights' grid)
    quantized_input = False
    input_bits = None

    def __init__(self, n_in, num_tokens, predictor, embed, joint, joint_mode="add"):
        if joint_mode not in KJ.MODES:
            raise ValueError(f"joint mode {joint_mode!r}: expected one of {JOINT_MODES}")
        self.W, self.b = "joint.enc.w", "joint.enc.b"
        self.E = "pred.embed"
        self.Wp, self.bp = "joint.pred.w", "joint.pred.b"
        self.Wo, self.bo = "joint.out.w", "joint.out.b"
        self.n_in, self.n_out = int(n_in), int(joint)   # the forward's output: enc
        self.num_tokens, self.embed, self.joint = int(num_tokens), int(embed), int(joint)
        self.mode_name, self.mode = joint_mode, KJ.MODES[joint_mode]
        self.pred, self.pred_width = predictor_layers(num_tokens, embed, predictor)
        self.sublayers = self.pred
        self.float_weights = (self.W, self.Wp, self.Wo)
        self.gemm_macs = self.n_in * self.joint   # per encoder frame; the joint is per node
        # the widest row its kernels sum columns of (ops.column_sums' scratch): the joint, the
        # logits, the predictor's gate columns
        self.width = max([self.joint, self.num_tokens] + [l.width for l in self.pred])
        self.skipped = 0
        self.fastemit_lambda = 0.0
        self.joint_budget = DEFAULT_JOINT_BUDGET
        self._buf = {}
        self.dtype = np.dtype(np.float32)   # its scratch arrays' (the builder sets the model's)
        self.device = "cpu"                 # where they live (the builder sets the model's)
        # the dtype of the values a GPU would store in 16 bits (GPU ranks under mixed or
        # bf16: float16, or uint16 holding bfloat16 bits; else the model's dtype): the
        # prediction network's, the joint's h, the gradients flowing back through them
        self.storage = self.dtype
        self.high_water = 0   # the largest joint group's bytes of h and z (logged)

    def specs(self):
        v, j = self.num_tokens, self.joint
        return ([ParamSpec(self.W, (self.n_in, j), "weight", "codec", "rows"),
                 ParamSpec(self.b, (1, j), "bias", "codec", "rows"),
                 ParamSpec(self.E, (v, self.embed), "weight", "codec", "rows")]
                + [s for layer in self.pred for s in layer.specs()]
                + [ParamSpec(self.Wp, (self.pred_width, j), "weight", "codec", "rows"),
                   ParamSpec(self.bp, (1, j), "bias", "codec", "rows"),
                   ParamSpec(self.Wo, (j, v), "weight", "codec", "rows"),
                   ParamSpec(self.bo, (1, v), "bias", "codec", "rows")])

    def init(self, views, rng):
        """Glorot for the projections, N(0, 1) for the embedding (each token a unit-scale
        vector, as nn.Embedding), the LSTMs' own; biases 0. Drawn in spec order."""
        glorot_uniform(views[self.W], rng)
        views[self.b][...] = 0
        views[self.E][...] = rng.standard_normal(views[self.E].shape).astype(views[self.E].dtype)
        for layer in self.pred:
            layer.init(views, rng)
        for w, b in ((self.Wp, self.bp), (self.Wo, self.bo)):
            glorot_uniform(views[w], rng)
            views[b][...] = 0

    # ---- the encoder side: the layer's forward and backward ----------------------------------

    def forward(self, p, x, z, ops, progress=None):
        matmul(x, p[self.W], z)
        if progress is not None:
            progress()
        ops.add_row(z, p[self.b])
        _store(ops, z)

    def posteriors(self, p, z, ops, log=True):
        """Nothing: an RNN-T's model.forward gives the encoder's joint projection (enc);
        decoding runs the prediction network and the joint over it (decode/rnnt.py)."""

    def backward(self, p, g, x, z, dy, dx, ops, progress=None):
        matmul(x, z, g[self.W], trans_a=True)   # z holds dLoss/denc (the loss wrote it)
        if progress is not None:
            progress()
        if dx is not None:
            matmul(z, p[self.W], dx, trans_b=True)
            if progress is not None:
                progress()

    # ---- scratch and the device ------------------------------------------------------------

    def _get(self, name, rows, cols, dtype=None):
        """A (rows, cols) view of the scratch array `name` (the model's dtype unless told),
        grown (doubled) when too small; on the model's device."""
        dtype = np.dtype(dtype or self.dtype)
        have = self._buf.get(name)
        if have is None or have.shape[0] < rows or have.shape[1] != cols \
                or have.dtype != dtype:
            grow = max(rows, 2 * have.shape[0] if have is not None else 0, 1)
            have = self._buf[name] = (np.empty((grow, cols), dtype) if self.device == "cpu"
                                      else cuda.device_array((grow, cols), dtype))
        return have[:rows]

    def _ints(self, name, values):
        """A batch's index array as the kernels take it: the host array itself, or (a GPU
        rank) its copy in a device buffer grown on demand (a small host-to-device copy)."""
        values = np.ascontiguousarray(values)
        if self.device == "cpu":
            return values
        return self._to_device(name, values)

    def _to_device(self, name, values):
        buf = self._get(name, max(len(values), 1), 1, values.dtype)[:len(values), 0]
        if len(values):
            buf.copy_to_device(values)
        return buf

    def _pred_ws(self, rows):
        """The predictor LSTMs' workspaces for a pass of `rows` rows (grown on demand)."""
        have = self._buf.get("pred_ws")
        if have is None or have[0] < rows:
            grow = max(rows, 2 * have[0] if have is not None else 0)
            self._buf["pred_ws"] = (grow, [
                {k: zeros(s, self.storage, self.device)
                 for k, s in layer.workspace(grow).items()}
                for layer in self.pred])
        return self._buf["pred_ws"][1]

    # ---- the prediction network -----------------------------------------------------------

    def predictor_batch(self, ids, offsets):
        """The predictor's batch of nb target sequences: (order, pos, Lengths of U_b + 1 in
        that order, tok: the input token of each time-major row, -1 on the padding)."""
        nb = len(offsets) - 1
        u1 = np.diff(offsets) + 1
        order = np.argsort(-u1, kind="stable")
        pos = np.empty(nb, np.int64)
        pos[order] = np.arange(nb)
        lengths = Lengths(u1[order])
        tok = np.full(lengths.rows, -1, np.int64)
        for k, b in enumerate(order):   # per utterance: its inputs [blank, y_1 .. y_U]
            rows = np.arange(u1[b]) * nb + k
            tok[rows[0]] = 0
            tok[rows[1:]] = ids[offsets[b]:offsets[b + 1]]
        return order, pos, lengths, tok

    def predict(self, p, tok, lengths, ops):
        """pred (rows, joint) of the predictor over the input tokens `tok` (time-major; -1:
        padding, a zero input and output row). Keeps each layer's output for backward."""
        rows = len(tok)
        tok_at = self._ints("tok", tok)
        x = self._get("pred_in", rows, self.embed, self.storage)
        ops.embed(p[self.E], tok_at, x)
        ws = self._pred_ws(rows)
        for k, layer in enumerate(self.pred):
            x = self._quantized_input(k, x, ops)
            y = self._get(f"pred_h{k}", rows, layer.n_out, self.storage)
            layer.forward(p, x, y, ops, None, ws=ws[k], lengths=lengths)
            x = y
        pred = self._get("pred", rows, self.joint, self.storage)
        matmul(x, p[self.Wp], pred)
        ops.add_row(pred, p[self.bp])
        ops.zero_padding(pred, tok_at)
        _store(ops, pred)
        return pred

    def _predict_backward(self, p, g, tok, lengths, dpred, ops):
        """From dpred = dLoss/dpred (zero on the padding): the predictor's gradients."""
        rows = len(tok)
        top = self._get(f"pred_h{len(self.pred) - 1}", rows, self.pred_width, self.storage) \
            if self.pred else self._get("pred_in", rows, self.embed, self.storage)
        matmul(top, dpred, g[self.Wp], trans_a=True)
        ops.column_sums(dpred, g[self.bp])
        dy = self._get("pred_dh", rows, self.pred_width, self.storage)
        matmul(dpred, p[self.Wp], dy, trans_b=True)
        _store(ops, dy)
        ws = self._pred_ws(rows)
        for k in range(len(self.pred) - 1, -1, -1):
            layer = self.pred[k]
            x = self._get(f"pred_q{k}" if self.input_bits else f"pred_h{k - 1}", rows,
                          layer.n_in, self.storage) if k \
                else self._get("pred_in", rows, self.embed, self.storage)
            y = self._get(f"pred_h{k}", rows, layer.n_out, self.storage)
            dx = self._get(f"pred_dx{k}", rows, layer.n_in, self.storage)
            layer.backward(p, g, x, y, dy, dx, ops, None, ws=ws[k], lengths=lengths)
            dy = dx
        # the embedding's rows, scattered back (tok's copy on the device: predict's)
        ops.embed_backward(dy, self._buf["tok"][:rows, 0] if self.device == "cuda" else tok,
                           g[self.E])

    def _quantized_input(self, k, x, ops):
        """Predictor layer k's input as its GEMM reads it: above the first layer, under QAT,
        the LSTM output below on the fixed grid of [-1, 1] (kept for backward; |h| < 1: the
        straight-through gradient is the identity)."""
        if not k or not self.input_bits:
            return x
        out = self._get(f"pred_q{k}", len(x), x.shape[1], self.storage)
        ops.fake_quant(x, out, symmetric_grid(1.0, self.input_bits, x.dtype))
        return out

    # ---- search: the prediction network one token at a time, the joint of rows -------------

    def start(self, p, n):
        """The prediction network after the start symbol (the blank) for n hypotheses ->
        (pred (n, joint) float64, its state: per LSTM layer (h, c) (n, cells))."""
        state = [(np.zeros((n, lstm.cells)), np.zeros((n, lstm.cells))) for lstm in self.pred]
        return self.step(p, np.zeros(n, np.int64), state)

    def step(self, p, tokens, state):
        """The prediction network advanced by one token per row: tokens (n,) int; state as
        start's. -> (pred (n, joint) float64, the new state). p: the weights the passes run on
        (Network.pass_weights); under quantization-aware training each LSTM layer's input above
        the first goes through the fixed grid training used (input_bits), its hidden state
        through its own (LSTM.step). Float64 on the host: the searches' arithmetic (the
        reference the kernels of predict are tested against), one row per hypothesis."""
        x = np.asarray(p[self.E], np.float64)[tokens]
        new = []
        for k, (lstm, (h, c)) in enumerate(zip(self.pred, state)):
            if k and self.input_bits:
                x = on_grid(x, symmetric_grid(1.0, self.input_bits))
            h, c = lstm.step(p, x, h, c)
            new.append((h, c))
            x = h
        return x @ p[self.Wp] + p[self.bp], new

    def joint_logits(self, p, enc, pred):
        """The joint's logits (n, V) of rows of enc and pred (n, joint) each: the same
        combination (joint_mode), tanh and output layer as the loss's lattice nodes."""
        h = np.tanh(enc + pred if self.mode == KJ.ADD else enc * pred)
        return h @ p[self.Wo] + p[self.bo]

    # ---- the joint and the loss -----------------------------------------------------------

    def groups(self, frames, u1):
        """Consecutive utterances [b0, b1) whose lattices' h and z fit the joint budget (an
        utterance larger than it alone)."""
        per_node = self.storage.itemsize * (self.joint + self.num_tokens)   # h and z
        nodes = frames * u1
        out, b0, used = [], 0, 0
        for b, n in enumerate(nodes):
            if b > b0 and (used + n) * per_node > self.joint_budget:
                out.append((b0, b))
                b0, used = b, 0
            used += n
        if len(nodes):
            out.append((b0, len(nodes)))
        return out

    def loss(self, p, g, z, targets, ops, scale=1.0, lengths=None):
        """The RNN-T loss of enc = z against targets at the encoder's output lengths: z
        becomes scale * dLoss/denc (zero on the padding), every other parameter of this layer
        gets its gradient in g. Returns (loss summed over the utterances in nats, unscaled;
        tokens in the targets)."""
        nb, frames = lengths.nb, lengths.lengths
        ids, offsets = targets.ids, targets.offsets
        u1 = np.diff(offsets) + 1
        order, pos, plen, tok = self.predictor_batch(ids, offsets)
        pred = self.predict(p, tok, plen, ops)
        denc = self._get("denc", len(z), self.joint)
        dpred = self._get("dpred", len(tok), self.joint)
        for a in (denc, dpred, g[self.Wo], g[self.bo]):
            zero(a)
        gWo, gbo = g[self.Wo], g[self.bo]
        gWo_part = self._get("gWo_part", self.joint, self.num_tokens)
        gbo_part = self._get("gbo_part", 1, self.num_tokens)
        # the index arrays the kernels read, on the device of a GPU rank (one copy per batch)
        frames_at, pos_at, u1_at = (self._ints(n, v.astype(np.int64)) for n, v in
                                    (("frames", frames), ("pos", pos), ("u1", u1)))
        ids_at = self._ints("ids", ids.astype(np.int32))
        offsets_at = self._ints("offsets", offsets.astype(np.int64))
        total, feasible = 0.0, 0
        groups = self.groups(frames, u1)
        half = self.storage != self.dtype   # GPU ranks' 16-bit storage
        for b0, b1 in groups:
            rows = KR.lattice_offsets(frames[b0:b1], u1[b0:b1] - 1)
            offs = np.zeros(nb + 1, np.int64)
            offs[b0:b1 + 1] = rows   # the group's rows from 0 (kernels_joint's b0 base)
            n = int(rows[-1])
            # h and the logits at the storage's width (16 bits under mixed or bf16 on GPU
            # ranks: the loss reads them widened, writes their gradient rounded)
            self.high_water = max(self.high_water,
                                  n * self.storage.itemsize * (self.joint + self.num_tokens))
            h = self._get("h", n, self.joint, self.storage)
            logits = self._get("logits", n, self.num_tokens, self.storage)
            offs_at = self._ints("offs", offs)
            shape = (nb, pos_at, frames_at, u1_at, offs_at, b0, b1, self.mode)
            ops.joint_forward(z, pred, shape, h, int(np.max(np.diff(rows))))
            _store(ops, h)
            matmul(h, p[self.Wo], logits)
            ops.add_row(logits, p[self.bo])
            _store(ops, logits)   # 16-bit logits in, the loss in float32
            alpha = self._get("alpha", n, 1, np.float32)[:, 0]   # the kernel's workspaces
            beta = self._get("beta", n, 1, np.float32)[:, 0]
            loss = self._get("loss", b1 - b0, 1, np.float64)[:, 0]
            ok = self._get("ok", b1 - b0, 1, np.uint8)[:, 0]
            # a GPU rank reads the losses back: a sync point, as CTC's loss read
            group_loss, group_ok = ops.rnnt_loss(
                logits, frames_at[b0:b1], ids_at, offsets_at[b0:b1 + 1],
                self._ints("rows", rows), scale, alpha, beta, loss, ok, self.fastemit_lambda)
            total += group_loss
            feasible += group_ok
            _store(ops, logits)   # the scaled gradient, rounded once
            # one group (the usual case): the output layer's gradients written in place
            one = len(groups) == 1
            matmul(h, logits, gWo if one else gWo_part, trans_a=True)
            ops.column_sums(logits, gbo if one else gbo_part)
            if not one:
                ops.add_into(gWo, gWo_part)
                ops.add_into(gbo, gbo_part)
            dh = self._get("dh", n, self.joint, self.storage)
            matmul(logits, p[self.Wo], dh, trans_b=True)
            _store(ops, dh)
            ops.joint_backward(dh, h, z, pred, shape, denc, dpred,
                               (n, int(frames[b0:b1].max()), int(u1[b0:b1].max())))
        _store(ops, dpred)
        if half:   # the float32 sums rounded once into the 16-bit arrays the GEMMs read
            dpred16 = self._get("dpred16", len(tok), self.joint, self.storage)
            ops.round(dpred, dpred16)
            ops.round(denc, z)
            dpred = dpred16
        else:
            assign(z, denc)
        self._predict_backward(p, g, tok, plen, dpred, ops)
        _store(ops, z)
        ops.column_sums(z, g[self.b])
        self.skipped += nb - feasible
        return total, len(ids)


def on_host(model, params):
    """(output layer, weights, ops) that a search or a held-out loss of an RNN-T model runs
    on, on the host: the model's own on CPU ranks; for a GPU model, a twin of its transducer
    with host float32 buffers, its pass weights (fake-quantized under QAT) copied back once
    (a device -> host copy) and host ops."""
    import copy

    from hpcsgd.model.flat import FlatParams
    from hpcsgd.model.ops import make_ops
    layer, weights = model.layers[-1], model.pass_weights(params)
    if model.device == "cpu":
        return layer, weights, model.ops
    twin = copy.copy(layer)
    twin.device, twin.storage, twin._buf = "cpu", twin.dtype, {}
    host = FlatParams(model.specs, model.dtype)
    assign(host.flat, weights.flat)
    return twin, host, make_ops("cpu", model.max_batch, twin.width, model.dtype)


def _store(ops, x):
    """Mixed precision and bf16 (model.ops.HalfOps): x as stored in the 16-bit format (a GEMM's
    or a kernel's output, rounded in place); float32 ops have no store: nothing."""
    store = getattr(ops, "store", None)
    if store is not None:
        store(x)


def rnnt_layers(input_dim, encoder, num_tokens, predictor, embed, joint, joint_mode,
                activation="relu"):
    layers, n_in = encoder_layers(input_dim, encoder, activation)
    return layers + [Transducer(n_in, num_tokens, predictor, embed, joint, joint_mode)]


def rnnt(input_dim, encoder, num_tokens, predictor=("lstm 256",), embed=64, joint=256,
         joint_mode="add", activation="relu", max_batch=8192, dtype=np.float32, device="cpu",
         precision="float32", qat=None, max_sequences=None):
    """The RNN-T model input_dim-[encoder]-transducer(predictor, joint)-num_tokens as a
    Network whose passes take whole utterances (their Lengths from the batch's targets)."""
    describe = {"type": "rnnt", "input_dim": int(input_dim),
                "encoder": [" ".join(str(e).split()) for e in encoder],
                "num_tokens": int(num_tokens),
                "predictor": [" ".join(str(e).split()) for e in predictor],
                "embed": int(embed), "joint": int(joint), "joint_mode": joint_mode,
                "activation": activation, **({"qat": dict(qat)} if qat else {})}
    net = Network(rnnt_layers(input_dim, encoder, num_tokens, predictor, embed, joint,
                              joint_mode, activation), max_batch, dtype, device, describe,
                  precision, qat=qat, max_sequences=max_sequences)
    # float64 (the tests' reference trajectories): the loss kernel still computes its
    # recursions in float32 (model/kernels_rnnt.py), the rest of the layer in float64
    out = net.layers[-1]
    out.dtype, out.device, out.storage = np.dtype(dtype), device, np.dtype(net.storage)
    return net
