"""The Conformer encoder (Gulati et al., Interspeech 2020) over whole utterances: a Conv2d
subsampling front end and Conformer blocks, each a layer of the Network's chain whose
sub-layers read earlier outputs inside it (residual adds, the macaron pair, a layer norm
before every module). CTC and RNN-T models take them as encoder specs (model/encoder.py):

    "conv2d C D"                 two 3x3 stride-2 convolutions of C channels over (time,
                                 frequency) with ReLU, then a linear map of the flattened
                                 channels x frequencies to D: 4x subsampling (NeMo, ESPnet and
                                 icefall's front end)
    "conformer D hH fF kK [in]"  one block of width D: H heads, feed-forward width F,
                                 depthwise kernel K; `in`: instance norm after the depthwise
                                 convolution instead of the layer norm

A block (shape key: R = T*nb time-major rows, row t*nb + b; D width, F feed-forward width,
H heads of dk = D / H):

    x1 = x  + 1/2 FF(x)        FF(x)   = drop(swish(LN(x) W1 + b1) W2 + b2)
    x2 = x1 + MHSA(x1)         MHSA(x) = drop(Attn(LN(x) Wqkv + bqkv) Wo + bo)
    x3 = x2 + Conv(x2)         Conv(x) = drop(swish(Norm(DW(GLU(LN(x) W1 + b1)))) W2 + b2)
    x4 = x3 + 1/2 FF'(x3)
    y  = LN(x4)

Attention: per utterance and head, softmax(rope(q) rope(k)^T / sqrt(dk)) v over the
utterance's own steps, with the rotary position embedding (docs/conformer.md says why rotary
and not Transformer-XL's relative positions): the products are batched GEMMs over (nb, H)
blocks of the longest utterance's steps, the padding masked by the softmax (every padded
query and key gets probability 0, so an utterance gets what it gets alone). The depthwise
convolution (K taps per channel, centred) reads only its utterance's steps; the norm after it
is a layer norm (per frame: the same at any rank count and batch), or an instance norm over
the utterance's steps (`in`: batch norm's statistics over one utterance). Dropout
(model.dropout) drops each module's output before its residual add, by masks keyed per
utterance (model/kernels_dropout.py; a salt per block and module).

Parameters are named where they live: enc.3.ff1.w1, enc.3.mhsa.wqkv, enc.3.conv.dw, enc.0.conv2.w.
The kernels are model/kernels_conformer.py (with their float64 references), the norms'
model/kernels_norm.py; everything element-wise goes through the device's ops (CpuOps; HalfOps
under mixed precision and bf16 rounds every stored value). GPU ranks: the same code on
CudaOps, whose CUDA twins are model/kernels_conformer_cuda.py and kernels_norm_cuda.py, the
attention's products one cuBLAS strided-batched GEMM each (device.batched_matmul), a
block's grown (nb, H, T, T) buffers on its device (the Network sets the block's `device`,
`dtype` and `storage`).
"""
import numpy as np

from hpcsgd.device import assign, batched_matmul, matmul
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model import kernels as K
from hpcsgd.model.flat import ParamSpec
from hpcsgd.model.layers import glorot_uniform
from hpcsgd.model.lengths import strided_rows

NORMS = ("ln", "in")
# the GEMM inputs quantization-aware training quantizes in a block (its keys' parameters)
GEMM_INPUTS = ("ff1.w1", "ff1.w2", "mhsa.qkv", "mhsa.out", "conv.w1", "conv.dw", "conv.w2",
               "ff2.w1", "ff2.w2")
MODULES = ("ff1", "mhsa", "conv", "ff2")   # in order; each has a dropout salt of its own


def _linear(name, n_in, n_out):
    return [ParamSpec(f"{name}.w", (n_in, n_out), "weight", "codec", "rows"),
            ParamSpec(f"{name}.b", (1, n_out), "bias", "codec", "rows")]


def _norm(name, width):
    """A norm's gain (role bias: quantization-aware training leaves it float) and shift."""
    return [ParamSpec(f"{name}.g", (1, width), "bias", "codec", "rows"),
            ParamSpec(f"{name}.b", (1, width), "bias", "codec", "rows")]


def _progress(progress):
    if progress is not None:
        progress()


def _quantized(layer, key, x, ws, rows, p, ops):
    """A GEMM's input x inside a layer, fake-quantized into its own buffer ws["q.KEY"] under
    quantization-aware training of activations (model/quantize.py: quantize_inner), else x."""
    if layer.quant is None:
        return x
    return layer.quant.quantize_inner(f"{layer.name}.{key}", x, ws[f"q.{key}"][:rows], p, ops)


def _straight_through(layer, key, x, d, p, g, ops):
    """d (the gradient of x's quantized copy) <- x's, straight through (model/quantize.py)."""
    if layer.quant is not None:
        layer.quant.inner_backward(f"{layer.name}.{key}", x, d, p, g, ops)


class Conv2dSubsampling:
    """The front end: x (T*nb, F) -> two 3x3 stride-2 convolutions of C channels with ReLU
    -> (ceil(T/4)*nb, F2*C) -> a linear map to D. Parameters {name}.conv1.w (9, C),
    {name}.conv2.w (9C, C), {name}.out.w (F2*C, D) and their biases. Each convolution is one
    GEMM over unfolded 3x3 patches (kernels_conformer.unfold2d), rows (t, b, f') x 9 Ci."""
    sequence = True
    stride = 4

    def __init__(self, name, n_in, channels, n_out):
        if min(n_in, channels, n_out) < 1:
            raise ValueError(f"conv2d {channels} {n_out} over {n_in} features: sizes must be "
                             f">= 1")
        self.name, self.n_in, self.channels, self.n_out = name, int(n_in), int(channels), \
            int(n_out)
        self.f1 = -(-self.n_in // 2)
        self.f2 = -(-self.f1 // 2)
        c = self.channels
        # per output row (a quarter of the input's): conv1 on 2 rows, conv2, the linear map
        self.gemm_macs = 2 * self.f1 * 9 * c + self.f2 * 9 * c * c + self.f2 * c * self.n_out
        self.dx_macs = 2 * self.f1 * 9 * c   # conv1's share: its dX is the features'
        self.width = max(self.f1 * c, self.n_out)
        self.output_range = (None, None)
        self.quant = None    # model.quantize.Quantizer under QAT of activations (it sets it)
        self.max_sequences = None   # a batch's most sequences (the Network sets it)

    def gemm_inputs(self):
        """The inputs QAT quantizes inside the front end: the second convolution's and the
        linear map's (the first convolution's is the layer's input: the Network's)."""
        return ("conv2", "out")

    def specs(self):
        c = self.channels
        return (_linear(f"{self.name}.conv1", 9, c) + _linear(f"{self.name}.conv2", 9 * c, c)
                + _linear(f"{self.name}.out", self.f2 * c, self.n_out))

    def init(self, views, rng):
        """He-scaled Glorot for the ReLU convolutions, Glorot for the linear map; biases 0."""
        for part, gain in (("conv1", np.sqrt(2.0)), ("conv2", np.sqrt(2.0)), ("out", 1.0)):
            glorot_uniform(views[f"{self.name}.{part}.w"], rng, gain)
            views[f"{self.name}.{part}.b"][...] = 0

    def workspace(self, max_rows):
        """Buffers at the first convolution's rate (r1 rows) and the second's (r2), fewer
        than the input's when the batch's sequences are bounded (max_sequences, set by the
        Network: model.lengths.strided_rows)."""
        c = self.channels
        r1 = strided_rows(max_rows, 2, self.max_sequences)
        r2 = strided_rows(max_rows, 4, self.max_sequences)
        out = {"cols1": (r1 * self.f1, 9), "a1": (r1, self.f1 * c), "d1": (r1, self.f1 * c),
               "cols2": (r2 * self.f2, 9 * c), "a2": (r2, self.f2 * c), "d2": (r2, self.f2 * c)}
        if self.quant is not None:
            out.update({"q.conv2": (r1, self.f1 * c), "q.out": (r2, self.f2 * c)})
        return out

    def out_lengths(self, lengths):
        return lengths.strided(2).strided(2)

    def _shapes(self, lengths):
        mid = lengths.strided(2)
        out = mid.strided(2)
        return mid, out

    def forward(self, p, x, y, ops, progress=None, ws=None, lengths=None):
        n, c = self.name, self.channels
        mid, out = self._shapes(lengths)
        nb = lengths.nb
        r1, r2 = mid.rows, out.rows
        cols1, a1 = ws["cols1"][:r1 * self.f1], ws["a1"][:r1]
        ops.unfold2d(x, cols1, nb, lengths.steps, mid.steps, self.n_in, self.f1, 1)
        matmul(cols1, p[f"{n}.conv1.w"], a1.reshape(r1 * self.f1, c))
        _progress(progress)
        ops.bias_act(a1.reshape(r1 * self.f1, c), p[f"{n}.conv1.b"], K.RELU)
        if not mid.full:   # the second convolution reads zeros past each utterance's end
            ops.mask_rows(a1, mid)
        cols2, a2 = ws["cols2"][:r2 * self.f2], ws["a2"][:r2]
        ops.unfold2d(_quantized(self, "conv2", a1, ws, r1, p, ops), cols2, nb, mid.steps, out.steps,
                     self.f1, self.f2, c)
        matmul(cols2, p[f"{n}.conv2.w"], a2.reshape(r2 * self.f2, c))
        _progress(progress)
        ops.bias_act(a2.reshape(r2 * self.f2, c), p[f"{n}.conv2.b"], K.RELU)
        matmul(_quantized(self, "out", a2, ws, r2, p, ops), p[f"{n}.out.w"], y)
        _progress(progress)
        ops.add_bias(y, p[f"{n}.out.b"])

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None, lengths=None):
        n, c = self.name, self.channels
        mid, out = self._shapes(lengths)
        nb = lengths.nb
        r1, r2 = mid.rows, out.rows
        a1, a2, d2 = ws["a1"][:r1], ws["a2"][:r2], ws["d2"][:r2]
        ops.column_sums(dy, g[f"{n}.out.b"])
        matmul(a2 if self.quant is None else ws["q.out"][:r2], dy, g[f"{n}.out.w"],
               trans_a=True)
        matmul(dy, p[f"{n}.out.w"], d2, trans_b=True)
        _progress(progress)
        _straight_through(self, "out", a2, d2, p, g, ops)
        a2v = a2.reshape(r2 * self.f2, c)
        ops.act_backward(a2v, d2.reshape(r2 * self.f2, c), a2v, g[f"{n}.conv2.b"], K.RELU)
        cols2 = ws["cols2"][:r2 * self.f2]                              # the forward's
        matmul(cols2, a2v, g[f"{n}.conv2.w"], trans_a=True)
        matmul(a2v, p[f"{n}.conv2.w"], cols2, trans_b=True)            # dcols2
        _progress(progress)
        d1 = ws["d1"][:r1]   # a1 keeps ReLU's mask (0 on the padding: no gradient there)
        ops.fold2d(cols2, d1, nb, mid.steps, out.steps, self.f1, self.f2, c)
        _straight_through(self, "conv2", a1, d1, p, g, ops)
        a1v = a1.reshape(r1 * self.f1, c)
        ops.act_backward(a1v, d1.reshape(r1 * self.f1, c), a1v, g[f"{n}.conv1.b"], K.RELU)
        cols1 = ws["cols1"][:r1 * self.f1]                              # the forward's
        matmul(cols1, a1v, g[f"{n}.conv1.w"], trans_a=True)
        _progress(progress)
        if dx is not None:
            matmul(a1v, p[f"{n}.conv1.w"], cols1, trans_b=True)
            ops.fold2d(cols1, dx, nb, lengths.steps, mid.steps, self.n_in, self.f1, 1)
            _progress(progress)


def check_conformer_sizes(width, heads, kernel):
    """ValueError naming what a block of these sizes cannot be."""
    if width % heads:
        raise ValueError(f"conformer {width} h{heads}: {heads} heads do not divide the width "
                         f"{width}")
    if (width // heads) % 2:
        raise ValueError(f"conformer {width} h{heads}: each head's {width // heads} values "
                         f"must be even (the rotary embedding turns pairs of them)")
    if kernel % 2 == 0:
        raise ValueError(f"conformer k{kernel}: the depthwise kernel must be odd (centred)")


class ConformerBlock:
    """One Conformer block of width D (the module docstring): n_in = n_out = D. Its sub-layers'
    buffers are its workspace (every one R rows), the attention's (nb, H, T, T) products grown
    on demand (their size is the batch's nb x T^2, not a function of its rows)."""
    sequence = True
    drops_inside = True   # model.dropout: its modules' outputs, not the block's (Network)
    # quantization-aware training: the block's input is the residual stream, which no GEMM
    # reads as it is (its GEMMs read layer norms' outputs): the Network leaves it float
    quantized_input = False
    # where its grown buffers live: the Network sets its device, dtype and storage (the
    # dtype of a training pass's buffers: 16-bit on GPU ranks under mixed or bf16)
    takes_device = True

    def __init__(self, name, index, width, heads, ff, kernel, norm="ln"):
        if norm not in NORMS:
            raise ValueError(f"conformer norm {norm!r}: expected one of {NORMS}")
        check_conformer_sizes(width, heads, kernel)
        dk = width // heads
        self.name, self.index = name, int(index)
        self.n_in = self.n_out = int(width)
        self.heads, self.dk, self.ff, self.kernel = int(heads), dk, int(ff), int(kernel)
        self.left = (self.kernel - 1) // 2
        self.norm = norm
        d, f = self.n_in, self.ff
        # per row: both feed-forwards, q k v and the output projection, the convolution
        # module's pointwise maps (the attention's products grow with T: not counted)
        self.gemm_macs = 2 * 2 * d * f + 4 * d * d + 3 * d * d
        self.width = max(f, 3 * d)   # the widest row its kernels sum columns of
        self.output_range = (None, None)
        self.dropout = 0.0   # set by the Network (set_dropout)
        self.quant = None    # model.quantize.Quantizer under QAT of activations (it sets it)
        self._att = {}       # the attention's grown buffers: (which, dtype) -> flat array
        self.device = "cpu"                              # set by the Network
        self.dtype = self.storage = np.dtype(np.float32)   # set by the Network

    def _n(self, part):
        return f"{self.name}.{part}"

    def specs(self):
        d, f = self.n_in, self.ff
        out = []
        for ff in ("ff1",):
            out += _norm(self._n(f"{ff}.ln"), d) + _linear(self._n(f"{ff}.w1"), d, f) \
                + _linear(self._n(f"{ff}.w2"), f, d)
        out += _norm(self._n("mhsa.ln"), d) + _linear(self._n("mhsa.qkv"), d, 3 * d) \
            + _linear(self._n("mhsa.out"), d, d)
        out += (_norm(self._n("conv.ln"), d) + _linear(self._n("conv.w1"), d, 2 * d)
                + [ParamSpec(self._n("conv.dw.w"), (self.kernel, d), "weight", "codec", "rows"),
                   ParamSpec(self._n("conv.dw.b"), (1, d), "bias", "codec", "rows")]
                + _norm(self._n("conv.norm"), d) + _linear(self._n("conv.w2"), d, d))
        out += _norm(self._n("ff2.ln"), d) + _linear(self._n("ff2.w1"), d, f) \
            + _linear(self._n("ff2.w2"), f, d)
        out += _norm(self._n("ln"), d)
        return out

    def init(self, views, rng):
        """Glorot for every linear map, U(-1/sqrt(K), 1/sqrt(K)) for the depthwise taps
        (PyTorch's Conv1d default at fan-in K), norms' gains 1, every bias and shift 0."""
        for spec in self.specs():
            v = views[spec.name]
            if spec.name == self._n("conv.dw.w"):
                a = 1.0 / np.sqrt(self.kernel)
                v[...] = rng.uniform(-a, a, size=v.shape).astype(v.dtype)
            elif spec.role == "weight":
                glorot_uniform(v, rng)
            elif spec.name.endswith(".g"):
                v[...] = 1
            else:
                v[...] = 0

    def workspace(self, max_rows):
        d, f = self.n_in, self.ff
        rows = {name: (max_rows, d) for name in (
            "x1", "x2", "x3", "l_ff1", "l_mhsa", "l_conv", "l_ff2", "x4", "att", "u", "c",
            "n", "s", "tmp", "grad")}
        rows.update({"ff1_pre": (max_rows, f), "ff1_act": (max_rows, f),
                     "ff2_pre": (max_rows, f), "ff2_act": (max_rows, f),
                     "qkv": (max_rows, 3 * d), "g": (max_rows, 2 * d),
                     "qh": (max_rows, d), "kh": (max_rows, d), "vh": (max_rows, d),
                     "oh": (max_rows, d)})
        if self.quant is not None:   # the quantized copies of the GEMMs' inputs
            rows.update({f"q.{key}": (max_rows, f if key.endswith("w2") and key[:2] == "ff"
                                      else d) for key in GEMM_INPUTS})
        return rows

    def gemm_inputs(self):
        """The inputs quantization-aware training fake-quantizes inside the block: every
        linear map's and the depthwise convolution's (the attention's products stay float:
        docs/conformer.md)."""
        return GEMM_INPUTS

    # ---- pieces ------------------------------------------------------------------------

    def _heads(self, ws, name, lengths):
        """ws[name] viewed as (nb, H, T, dk) head blocks."""
        nb, steps = lengths.nb, lengths.steps
        return ws[name][:lengths.rows].reshape(nb, self.heads, steps, self.dk)

    def _scores(self, ws, lengths, which, dtype):
        """The (nb, H, T, T) buffer `which` (probabilities, or their gradient) of the pass's
        dtype (the storage in training, the model's in inference: one buffer each), grown
        (doubled) on the layer's device."""
        need = lengths.nb * self.heads * lengths.steps ** 2
        key = (which, np.dtype(dtype))
        have = self._att.get(key)
        if have is None or have.size < need:
            size = max(need, 2 * (have.size if have is not None else 0), 1)
            have = self._att[key] = (np.empty(size, dtype) if self.device == "cpu"
                                     else cuda.device_array(size, dtype))
        return have[:need].reshape(lengths.nb, self.heads, lengths.steps, lengths.steps)

    def _drop(self, ops, x, drop, module):
        """model.dropout on a module's output (training passes), in place."""
        if drop is not None and self.dropout:
            keys, nb = drop
            ops.dropout(x, x, keys, nb, 1000 * (self.index + 1) + MODULES.index(module),
                        self.dropout)

    def _ln(self, p, ops, x, out, part):
        ops.layer_norm(x, p[self._n(f"{part}.g")], p[self._n(f"{part}.b")], out, K.IDENTITY)

    def _ln_backward(self, p, g, ops, x, dy, dz, part):
        ops.layer_norm_backward(x, dy, dy, p[self._n(f"{part}.g")], dz, g[self._n(f"{part}.g")],
                                g[self._n(f"{part}.b")], K.IDENTITY)

    def _dq(self, key, x, ws, rows):
        """Where the backward writes dLoss/d(x's GEMM input): the quantized copy's buffer
        (free once the weight gradient has read it; x itself stays for the straight-through
        mask), else x's own."""
        return x if self.quant is None else ws[f"q.{key}"][:rows]

    def _ff(self, p, ops, x, out, ws, rows, ff, drop, progress):
        """out = x + 1/2 FF(x)."""
        l, pre, act, tmp = (ws[k][:rows] for k in (f"l_{ff}", f"{ff}_pre", f"{ff}_act", "tmp"))
        self._ln(p, ops, x, l, f"{ff}.ln")
        matmul(_quantized(self, f"{ff}.w1", l, ws, rows, p, ops), p[self._n(f"{ff}.w1.w")], pre)
        _progress(progress)
        ops.bias_swish(pre, p[self._n(f"{ff}.w1.b")], act)
        matmul(_quantized(self, f"{ff}.w2", act, ws, rows, p, ops), p[self._n(f"{ff}.w2.w")], tmp)
        _progress(progress)
        ops.add_bias(tmp, p[self._n(f"{ff}.w2.b")])
        self._drop(ops, tmp, drop, ff)
        ops.add_scaled(x, tmp, 0.5, out)

    def _ff_backward(self, p, g, ops, x, grad, ws, rows, ff, drop, progress):
        """grad (dLoss/d out) <- dLoss/dx, through out = x + 1/2 FF(x)."""
        l, pre, act, tmp = (ws[k][:rows] for k in (f"l_{ff}", f"{ff}_pre", f"{ff}_act", "tmp"))
        assign(tmp, grad)
        ops.scale(tmp, 0.5)                     # d FF's output: exact (a power of two)
        self._drop(ops, tmp, drop, ff)
        ops.column_sums(tmp, g[self._n(f"{ff}.w2.b")])
        da = self._dq(f"{ff}.w2", act, ws, rows)        # the forward's GEMM input, then d act
        matmul(da, tmp, g[self._n(f"{ff}.w2.w")], trans_a=True)
        matmul(tmp, p[self._n(f"{ff}.w2.w")], da, trans_b=True)
        _progress(progress)
        _straight_through(self, f"{ff}.w2", act, da, p, g, ops)
        ops.swish_backward(pre, da, da)
        ops.column_sums(da, g[self._n(f"{ff}.w1.b")])
        dl = self._dq(f"{ff}.w1", l, ws, rows)
        matmul(dl, da, g[self._n(f"{ff}.w1.w")], trans_a=True)
        matmul(da, p[self._n(f"{ff}.w1.w")], dl, trans_b=True)
        _progress(progress)
        _straight_through(self, f"{ff}.w1", l, dl, p, g, ops)
        self._ln_backward(p, g, ops, x, dl, tmp, f"{ff}.ln")
        ops.add_scaled(grad, tmp, 1.0, grad)

    def _mhsa(self, p, ops, x, out, ws, rows, lengths, drop, progress):
        d = self.n_in
        l, qkv, att, tmp = (ws[k][:rows] for k in ("l_mhsa", "qkv", "att", "tmp"))
        self._ln(p, ops, x, l, "mhsa.ln")
        matmul(_quantized(self, "mhsa.qkv", l, ws, rows, p, ops), p[self._n("mhsa.qkv.w")], qkv)
        _progress(progress)
        ops.add_bias(qkv, p[self._n("mhsa.qkv.b")])
        qh, kh, vh, oh = (self._heads(ws, k, lengths) for k in ("qh", "kh", "vh", "oh"))
        ops.to_heads(qkv, 0, qh, lengths, True, 1.0 / np.sqrt(self.dk))
        ops.to_heads(qkv, d, kh, lengths, True, 1.0)
        ops.to_heads(qkv, 2 * d, vh, lengths, False, 1.0)
        prob = self._scores(ws, lengths, "p", qh.dtype)
        batched_matmul(qh, kh, prob, trans_b=True)
        ops.masked_softmax(prob, prob, lengths)
        batched_matmul(prob, vh, oh)
        _progress(progress)
        ops.from_heads(oh, att, 0, lengths, False, 1.0)
        matmul(_quantized(self, "mhsa.out", att, ws, rows, p, ops), p[self._n("mhsa.out.w")], tmp)
        _progress(progress)
        ops.add_bias(tmp, p[self._n("mhsa.out.b")])
        self._drop(ops, tmp, drop, "mhsa")
        ops.add_scaled(x, tmp, 1.0, out)

    def _mhsa_backward(self, p, g, ops, x, grad, ws, rows, lengths, drop, progress):
        d = self.n_in
        l, qkv, att, tmp = (ws[k][:rows] for k in ("l_mhsa", "qkv", "att", "tmp"))
        assign(tmp, grad)
        self._drop(ops, tmp, drop, "mhsa")
        ops.column_sums(tmp, g[self._n("mhsa.out.b")])
        datt = self._dq("mhsa.out", att, ws, rows)
        matmul(datt, tmp, g[self._n("mhsa.out.w")], trans_a=True)
        matmul(tmp, p[self._n("mhsa.out.w")], datt, trans_b=True)
        _progress(progress)
        _straight_through(self, "mhsa.out", att, datt, p, g, ops)
        qh, kh, vh, oh = (self._heads(ws, k, lengths) for k in ("qh", "kh", "vh", "oh"))
        ops.to_heads(datt, 0, oh, lengths, False, 1.0)                  # d oh
        prob = self._scores(ws, lengths, "p", qh.dtype)
        dprob = self._scores(ws, lengths, "dp", qh.dtype)
        batched_matmul(oh, vh, dprob, trans_b=True)                     # dP = dO V^T
        batched_matmul(prob, oh, vh, trans_a=True)                      # dV = P^T dO over V
        ops.masked_softmax_backward(prob, dprob, dprob, lengths)         # dS over dP
        batched_matmul(dprob, kh, oh)                                   # dQ = dS K over dO
        batched_matmul(dprob, qh, kh, trans_a=True)                     # dK = dS^T Q over K
        _progress(progress)
        ops.from_heads(oh, qkv, 0, lengths, True, 1.0 / np.sqrt(self.dk))
        ops.from_heads(kh, qkv, d, lengths, True, 1.0)
        ops.from_heads(vh, qkv, 2 * d, lengths, False, 1.0)
        ops.column_sums(qkv, g[self._n("mhsa.qkv.b")])
        dl = self._dq("mhsa.qkv", l, ws, rows)
        matmul(dl, qkv, g[self._n("mhsa.qkv.w")], trans_a=True)
        matmul(qkv, p[self._n("mhsa.qkv.w")], dl, trans_b=True)
        _progress(progress)
        _straight_through(self, "mhsa.qkv", l, dl, p, g, ops)
        self._ln_backward(p, g, ops, x, dl, tmp, "mhsa.ln")
        ops.add_scaled(grad, tmp, 1.0, grad)

    def _norm_after_dw(self, p, ops, c, n, lengths):
        gamma, beta = p[self._n("conv.norm.g")], p[self._n("conv.norm.b")]
        if self.norm == "ln":
            ops.layer_norm(c, gamma, beta, n, K.IDENTITY)
        else:
            ops.instance_norm(c, gamma, beta, n, K.IDENTITY, lengths)

    def _conv(self, p, ops, x, out, ws, rows, lengths, drop, progress):
        l, gbuf, u, c, n, s, tmp = (ws[k][:rows] for k in ("l_conv", "g", "u", "c", "n", "s",
                                                           "tmp"))
        self._ln(p, ops, x, l, "conv.ln")
        matmul(_quantized(self, "conv.w1", l, ws, rows, p, ops), p[self._n("conv.w1.w")], gbuf)
        _progress(progress)
        ops.bias_glu(gbuf, p[self._n("conv.w1.b")], u)
        ops.depthwise(_quantized(self, "conv.dw", u, ws, rows, p, ops), p[self._n("conv.dw.w")],
                      p[self._n("conv.dw.b")], c, lengths, self.left)
        self._norm_after_dw(p, ops, c, n, lengths)
        ops.swish(n, s)
        matmul(_quantized(self, "conv.w2", s, ws, rows, p, ops), p[self._n("conv.w2.w")], tmp)
        _progress(progress)
        ops.add_bias(tmp, p[self._n("conv.w2.b")])
        self._drop(ops, tmp, drop, "conv")
        ops.add_scaled(x, tmp, 1.0, out)

    def _conv_backward(self, p, g, ops, x, grad, ws, rows, lengths, drop, progress):
        l, gbuf, u, c, n, s, tmp = (ws[k][:rows] for k in ("l_conv", "g", "u", "c", "n", "s",
                                                           "tmp"))
        assign(tmp, grad)
        self._drop(ops, tmp, drop, "conv")
        ops.column_sums(tmp, g[self._n("conv.w2.b")])
        ds = self._dq("conv.w2", s, ws, rows)
        matmul(ds, tmp, g[self._n("conv.w2.w")], trans_a=True)
        matmul(tmp, p[self._n("conv.w2.w")], ds, trans_b=True)     # d s
        _progress(progress)
        _straight_through(self, "conv.w2", s, ds, p, g, ops)
        ops.swish_backward(n, ds, ds)                               # d n over it
        gamma = p[self._n("conv.norm.g")]
        gg, gb = g[self._n("conv.norm.g")], g[self._n("conv.norm.b")]
        if self.norm == "ln":                                       # d c over it
            ops.layer_norm_backward(c, ds, ds, gamma, ds, gg, gb, K.IDENTITY)
        else:
            ops.instance_norm_backward(c, ds, ds, gamma, ds, gg, gb, K.IDENTITY, lengths)
        uq = u if self.quant is None else ws["q.conv.dw"][:rows]    # what the taps read
        ops.depthwise_backward(uq, ds, p[self._n("conv.dw.w")], n, g[self._n("conv.dw.w")],
                               g[self._n("conv.dw.b")], lengths, self.left)   # d u over n
        _straight_through(self, "conv.dw", u, n, p, g, ops)
        ops.glu_backward(gbuf, n, gbuf)                             # d g over g
        ops.column_sums(gbuf, g[self._n("conv.w1.b")])
        dl = self._dq("conv.w1", l, ws, rows)
        matmul(dl, gbuf, g[self._n("conv.w1.w")], trans_a=True)
        matmul(gbuf, p[self._n("conv.w1.w")], dl, trans_b=True)
        _progress(progress)
        _straight_through(self, "conv.w1", l, dl, p, g, ops)
        self._ln_backward(p, g, ops, x, dl, tmp, "conv.ln")
        ops.add_scaled(grad, tmp, 1.0, grad)

    # ---- the layer's passes -------------------------------------------------------------

    def forward(self, p, x, y, ops, progress=None, ws=None, lengths=None, drop=None):
        """y <- the block of x; drop = (utterance keys, nb) in a training pass with dropout."""
        rows = lengths.rows
        x1, x2, x3, x4 = (ws[k][:rows] for k in ("x1", "x2", "x3", "x4"))
        self._ff(p, ops, x, x1, ws, rows, "ff1", drop, progress)
        self._mhsa(p, ops, x1, x2, ws, rows, lengths, drop, progress)
        self._conv(p, ops, x2, x3, ws, rows, lengths, drop, progress)
        self._ff(p, ops, x3, x4, ws, rows, "ff2", drop, progress)
        self._ln(p, ops, x4, y, "ln")

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None, lengths=None,
                 drop=None):
        """dx <- dLoss/dx from dy (dx may be dy's buffer: dy is read first, by the last
        norm's backward, which writes over it row by row)."""
        rows = lengths.rows
        x1, x2, x3, x4 = (ws[k][:rows] for k in ("x1", "x2", "x3", "x4"))
        grad = dx if dx is not None else ws["grad"][:rows]
        self._ln_backward(p, g, ops, x4, dy, grad, "ln")
        self._ff_backward(p, g, ops, x3, grad, ws, rows, "ff2", drop, progress)
        self._conv_backward(p, g, ops, x2, grad, ws, rows, lengths, drop, progress)
        self._mhsa_backward(p, g, ops, x1, grad, ws, rows, lengths, drop, progress)
        self._ff_backward(p, g, ops, x, grad, ws, rows, "ff1", drop, progress)
