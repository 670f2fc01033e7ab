"""`hpcsgd export RUN --onnx OUT_DIR`: a CTC model as an ONNX graph that leaves hpcsgd --
decoded by sherpa-onnx's offline CTC recognizer (or any ONNX runtime) from the audio. An RNN-T
model goes to hpcsgd/export_onnx_rnnt.py (three graphs; its encoder is encoder() below);
--streaming, a causal model for sherpa-onnx's online recognizer (the LSTM states in and out),
to hpcsgd/export_onnx_streaming.py.

    hpcsgd export runs/demo/ctc --onnx runs/demo/ctc_onnx [--cmvn global|utterance]
                                                          [--stats TRAIN_ARCHIVE]

OUT_DIR/model.onnx   the graph (opset 17; INT4: 21), float32 weights (a QAT model's: integers,
                     below).
                     Inputs and outputs are those of icefall's zipformer CTC export,
                     which sherpa-onnx's zipformer_ctc loader reads
                     (sherpa-onnx/csrc/offline-zipformer-ctc-model.cc):
                       x              float32 (N, T, D)   fbank frames, batch-major
                       x_lens         int64   (N,)        frames of each utterance
                       log_probs      float32 (N, T', V)  log-posteriors, column 0 the blank
                       log_probs_len  int64   (N,)        T' of each: ceil(frames / stride)
OUT_DIR/tokens.txt   sherpa-onnx's `symbol id` table: <blk> 0 (its greedy search takes the
                     blank's id from that symbol), the rest as spelled below.

Why that loader: NeMo's (from_nemo_ctc) overwrites the feature options with librosa's mel
filters and a Hann window, which no Kaldi fbank model can match, and puts the blank last;
WeNet's forces dither 1 and decodes one stream at a time. The zipformer CTC loader takes the
graph as it is: batch-major features, the lengths, blank anywhere (from tokens.txt), and
leaves the feature options to the caller. Its one fixed assumption, a subsampling factor of
4, only scales the timestamps sherpa-onnx reports (× 40 ms per output step).

The graph, per layer, the same arithmetic as hpcsgd's forward (model/*.py):
  normalisation  hpcsgd normalises per speaker, which a recognizer of single utterances
                 cannot (docs/export.md measures what each substitute costs). --cmvn global
                 (default): (x - mean) * inv_std with the training archive's speakers' CMVN
                 stats summed; --cmvn utterance: each utterance by its own mean (and
                 variance, floored as hpcsgd's CMVN floors it) over its valid frames. Then
                 the padding frames are zeroed: sherpa-onnx pads a batch with log(1e-10),
                 and the mask makes that invisible, as hpcsgd's zero padding is.
  stack K        zero-pad T to a multiple of K, reshape (N, T/K, K*D)
  conv F kK sS dD [ahead] [ln|in]
                 Conv over (N, C, T), pads (p, (K-1)D - p) with p = (K-1)D // 2 (0: ahead),
                 T' = ceil(T/S)
                 output steps, each reading its input steps t'S - p + jD (zero outside);
                 W (K*C, F) -> (F, C, K); LayerNormalization over channels, or instance norm
                 over each utterance's valid steps (masked sums), then ReLU or sigmoid
  blstm/lstm H   ONNX LSTM (time-major), gates reordered from hpcsgd's i f g o to ONNX's
                 i o f c; W (C, 4H) -> (4H, C), U (H, 4H) -> R (4H, H), b -> Wb, Rb = 0;
                 sequence_lens per utterance (the backward direction starts at each one's own
                 end, as hpcsgd's does); output [forward | backward]
  dense F        MatMul + bias + activation
  conv2d C D     the Conformer's front end: the features as a (N, 1, T, F) image, two 3x3
                 stride-2 Convs padded by 1 with ReLU, (N, C, T/4, F/4) -> (N, T/4, F/4*C),
                 MatMul to D
  conformer ...  LayerNormalization, the macaron feed-forwards with swish, rotary attention
                 (hpcsgd's tables, computed in the graph from T in float64 as hpcsgd
                 computes them: no length limit) with the padding's keys masked, GLU, a
                 grouped Conv as the depthwise convolution over the masked steps, its layer
                 or instance norm, the final layer norm
  output         MatMul + bias, LogSoftmax over the tokens
Every encoder layer's output is masked past its utterance's length, as the Network does, so a
padded batch gives each utterance what it gives alone.

Not exported yet (refused with the model named): hybrid frame classifiers (they need a
decoding graph and priors, not a CTC search).

A quantization-aware CTC or RNN-T model (docs/qat.md) gets its integer graph: the same
builders, with the Graph's hooks (gemm_input, weight, matmul) taken over by
hpcsgd/export_onnx_int.py's IntGraph (INT8 QDQ, or INT4 codes as int4 tensors cast and scaled,
the grids it trained on; the models without an exact integer form refused there, named).
"""
import os

import numpy as np

from hpcsgd.data import archive
from hpcsgd.data import cmvn as norm
from hpcsgd.data.splice import VAR_FLOOR
from hpcsgd.decode.ctc import SPACE, WORD_START
from hpcsgd.errors import UserError
from hpcsgd.families import of_model
from hpcsgd.model.chunked_blstm import ChunkedBLSTM
from hpcsgd.model.conformer import ConformerBlock, Conv2dSubsampling
from hpcsgd.model.conv import Conv1d, StackFrames
from hpcsgd.model.kernels_conformer import rope_frequencies
from hpcsgd.model.kernels_lstm import GATES
from hpcsgd.model.kernels_norm import EPS
from hpcsgd.model.layers import Dense
from hpcsgd.model.lstm import LSTM

OPSET = 17       # LayerNormalization is 17; ONNX Runtime and sherpa-onnx's bundled one run it
IR_VERSION = 8   # the IR of opset 17's release, so older runtimes load the file too
ONNX_GATES = [0, 3, 1, 2]   # hpcsgd's gate blocks i f g o, taken in ONNX's order i o f c
# sherpa-onnx's FeatureExtractorConfig: the options its Python constructor takes, and the
# defaults of those it does not (sherpa-onnx/csrc/features.h), which hpcsgd's must equal
SHERPA_FIXED = {"frame_shift_ms": 10.0, "frame_length_ms": 25.0, "preemph_coeff": 0.97,
                "remove_dc_offset": True, "window_type": "povey", "round_to_power_of_two": True}


class Graph:
    """The nodes and initializers of the graph being built, and fresh names for its values."""

    def __init__(self):
        from onnx import helper, numpy_helper
        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes, self.inits, self.count = [], [], 0
        self.cache = {}   # values shared by layers (the rotary tables of a head width and rate)

    def name(self, hint):
        self.count += 1
        return f"{hint}_{self.count}"

    def const(self, array, hint="c"):
        name = self.name(hint)
        self.inits.append(self.numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type, inputs, hint=None, outputs=1, domain=None, **attrs):
        names = [self.name(hint or op_type.lower()) for _ in range(outputs)]
        self.nodes.append(self.helper.make_node(op_type, list(inputs), names, domain=domain,
                                                **attrs))
        return names[0] if outputs == 1 else names

    # What the integer graph of a quantization-aware model (export_onnx_int.IntGraph)
    # replaces: a GEMM's input (quantized there on the grid it trained on, `key` its name in
    # model/quantize.py: a layer's index, or "{layer}.{part}" inside a layer) and a weight
    # matrix (its integer codes). The float graph takes both as they are.
    opset, ir_version = OPSET, IR_VERSION   # an INT4 graph's: 21, 10 (4-bit tensors)

    def gemm_input(self, x, key):
        return x

    def weight(self, p, name, layout=None, axis=1):
        """p[name], hpcsgd's (K, N) matrix, as the constant an op reads: layout(W) in that
        op's layout, whose output units lie along `axis`."""
        w = p[name] if layout is None else layout(p[name])
        return self.const(np.ascontiguousarray(w, np.float32), name)

    def matmul(self, x, p, name):
        return self.op("MatMul", [x, self.weight(p, name)])


def steps(g, x, axis=1):
    """The time dimension of (N, T, C) x (or its axis `axis`), as a scalar int64."""
    return g.op("Gather", [g.op("Shape", [x]), g.const(np.int64(axis))], axis=0)


def strided(g, lens, stride):
    """ceil(lens / stride): what a stride-s layer leaves of each utterance (model.lengths)."""
    if stride == 1:
        return lens
    return g.op("Div", [g.op("Add", [lens, g.const(np.array([stride - 1], np.int64))]),
                        g.const(np.array([stride], np.int64))], hint="lens")


def valid(g, x, lens, time=1, axes=(2,)):
    """float32 1 at each utterance's steps, 0 on the padding past its length: (N, T) (T the
    size of x's axis `time`) with size-1 axes inserted at `axes`: (N, T, 1) by default.
    Built once per lengths value and shape: every builder that changes the steps gives a new
    lengths value (strided(), the streaming graphs' Sub), so one lengths value means one T,
    and the layers that share it share one mask (an 8-block Conformer asked for it 24 times,
    8 nodes each)."""
    key = ("valid", lens, time, tuple(axes))
    if key not in g.cache:
        t = g.op("Range", [g.const(np.int64(0)), steps(g, x, time), g.const(np.int64(1))])
        inside = g.op("Less", [g.op("Unsqueeze", [t, g.const(np.array([0], np.int64))]),
                               g.op("Unsqueeze", [lens, g.const(np.array([1], np.int64))])])
        g.cache[key] = g.op("Unsqueeze", [g.op("Cast", [inside], to=1),
                                          g.const(np.array(axes, np.int64))], hint="mask")
    return g.cache[key]


def masked(g, x, lens):
    return g.op("Mul", [x, valid(g, x, lens)], hint="masked")


def deviations(g, x, lens):
    """Each channel of each utterance over its valid steps: (x - mean) with the padding 0,
    and the variance (N, 1, C) (two passes, as hpcsgd's norms compute them)."""
    m = valid(g, x, lens)
    count = g.op("Unsqueeze", [g.op("Cast", [lens], to=1), g.const(np.array([1, 2], np.int64))])
    axis = g.const(np.array([1], np.int64))
    mean = g.op("Div", [g.op("ReduceSum", [g.op("Mul", [x, m]), axis], keepdims=1), count])
    dev = g.op("Mul", [g.op("Sub", [x, mean]), m])
    var = g.op("Div", [g.op("ReduceSum", [g.op("Mul", [dev, dev]), axis], keepdims=1), count])
    return dev, var


def normalize(g, x, lens, mean, inv_std, utterance):
    """The features normalised, the padding zeroed: (x - mean) * inv_std with global
    statistics, or utterance "mean"/"meanvar": each utterance by its own statistics (its
    mean, and 1 / sqrt(its variance floored as hpcsgd's CMVN floors it))."""
    if utterance is None:
        x = g.op("Mul", [g.op("Sub", [x, g.const(np.asarray(mean, np.float32).reshape(-1),
                                                   "cmvn_mean")]),
                         g.const(np.asarray(inv_std, np.float32).reshape(-1), "cmvn_inv_std")],
                 hint="normalized")
        return masked(g, x, lens)
    dev, var = deviations(g, masked(g, x, lens), lens)
    if utterance == "mean":
        return dev
    var = g.op("Max", [var, g.const(np.float32(VAR_FLOOR))])
    return g.op("Div", [dev, g.op("Sqrt", [var])], hint="normalized")


def activation(g, x, name):
    return g.op({"relu": "Relu", "sigmoid": "Sigmoid"}[name], [x])


def stack(g, x, lens, layer):
    """Frame stacking: rows t' = [x_{t'k} .. x_{t'k+k-1}], zeros past the end."""
    k = layer.k
    t = g.op("Shape", [x], start=1, end=2)
    pad = g.op("Mod", [g.op("Sub", [g.const(np.array([k], np.int64)),
                                    g.op("Mod", [t, g.const(np.array([k], np.int64))])]),
                       g.const(np.array([k], np.int64))])
    zeros = g.const(np.zeros(1, np.int64))
    pads = g.op("Concat", [zeros, zeros, zeros, zeros, pad, zeros], axis=0)
    x = g.op("Pad", [x, pads])
    return g.op("Reshape", [x, g.const(np.array([0, -1, k * layer.n_in], np.int64))],
                hint="stacked"), strided(g, lens, k)


def conv(g, x, lens, layer, p, act, key=None, valid=False):
    """A 1-D convolution (model/conv.py), its norm and activation; its input quantized
    as the GEMM input `key` after the Transpose to (N, C, T) (the same values: onnxruntime's
    QDQ propagation of a DequantizeLinear through a Transpose writes an invalid opset-21
    QuantizeLinear). valid: no zeros after the input (the streaming graphs' lookahead conv
    reads real frames there, and emits fewer steps)."""
    k, c, f, d = layer.kernel, layer.n_in, layer.n_out, layer.dilation
    w = g.weight(p, layer.W, lambda a: a.reshape(k, c, f).transpose(2, 1, 0), axis=0)
    inputs = [g.gemm_input(g.op("Transpose", [x], perm=[0, 2, 1]), key), w]
    if not layer.norm:
        inputs.append(g.const(p[layer.b].reshape(-1).astype(np.float32), layer.b))
    z = g.op("Conv", inputs, kernel_shape=[k], strides=[layer.stride], dilations=[d],
             pads=[layer.left, 0 if valid else (k - 1) * d - layer.left], hint="conv")
    z = g.op("Transpose", [z], perm=[0, 2, 1])
    lens = strided(g, lens, layer.stride)
    gain = g.const(p[layer.g].reshape(-1).astype(np.float32), layer.g) if layer.norm else None
    shift = g.const(p[layer.b].reshape(-1).astype(np.float32), layer.b) if layer.norm else None
    if layer.norm == "ln":
        z = g.op("LayerNormalization", [z, gain, shift], axis=-1, epsilon=EPS)
    elif layer.norm == "in":   # each channel over the utterance's valid steps
        dev, var = deviations(g, z, lens)
        inv = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var, g.const(np.float32(EPS))])])])
        z = g.op("Add", [g.op("Mul", [g.op("Mul", [dev, inv]), gain]), shift])
    return activation(g, z, act), lens


def lstm(g, x, lens, layer, p):
    """An LSTM layer (model/lstm.py) as ONNX's LSTM, time-major inside."""
    h, dirs = layer.cells, layer.dirs
    order = np.concatenate([np.arange(q * h, (q + 1) * h) for q in ONNX_GATES])
    W, R, B = [], [], []
    for d in range(dirs):
        cols = slice(d * GATES * h, (d + 1) * GATES * h)
        W.append(p[layer.W][:, cols][:, order].T)
        R.append(p[layer.U[d]][:, order].T)
        B.append(np.concatenate([p[layer.b][0, cols][order], np.zeros(GATES * h)]))
    as32 = lambda parts: np.ascontiguousarray(np.stack(parts), np.float32)   # noqa: E731
    seq = g.op("Cast", [lens], to=6)   # ONNX's sequence_lens are int32
    y = g.op("LSTM", [g.op("Transpose", [x], perm=[1, 0, 2]), g.const(as32(W), layer.W),
                      g.const(as32(R), "R" + layer.W[1:]), g.const(as32(B), layer.b), seq],
             hidden_size=h, direction="bidirectional" if dirs == 2 else "forward", hint="lstm")
    y = g.op("Transpose", [y], perm=[2, 0, 1, 3])   # (T, dirs, N, H) -> (N, T, dirs, H)
    return g.op("Reshape", [y, g.const(np.array([0, 0, dirs * h], np.int64))]), lens


def frontend(g, x, lens, layer, p, key=None):
    """The Conformer's Conv2d subsampling (model/conformer.py): the features as a one-channel
    (time, frequency) image, two 3x3 stride-2 convolutions padded by 1 with ReLU (unfold2d's
    taps: W (9*Cin, C) -> (C, Cin, 3, 3)), the first's output zeroed past each utterance's
    steps, then (N, C, T/4, F/4) -> (N, T/4, F/4*C) and the linear map. The image quantized
    as the GEMM input `key` after the Unsqueeze (as conv() quantizes after its Transpose)."""
    n, c = layer.name, layer.channels

    def conv2d(x, part, c_in):
        w = g.weight(p, f"{n}.{part}.w",
                     lambda a: a.reshape(3, 3, c_in, c).transpose(3, 2, 0, 1), axis=0)
        y = g.op("Conv", [x, w, g.const(p[f"{n}.{part}.b"].reshape(-1).astype(np.float32))],
                 kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
        return g.op("Relu", [y])

    image = g.gemm_input(g.op("Unsqueeze", [x, g.const(np.array([1], np.int64))]),
                         key)   # (N, 1, T, F)
    a1 = conv2d(image, "conv1", 1)
    mid = strided(g, lens, 2)
    a1 = g.op("Mul", [a1, valid(g, a1, mid, time=2, axes=[1, 3])])
    a2 = conv2d(g.gemm_input(a1, f"{n}.conv2"), "conv2", c)
    flat = g.op("Reshape", [g.op("Transpose", [a2], perm=[0, 2, 3, 1]),
                            g.const(np.array([0, 0, -1], np.int64))])
    return linear(g, flat, p, f"{n}.out"), strided(g, mid, 2)


def linear(g, x, p, name):
    """x @ p[name.w] + p[name.b], x quantized as the GEMM input `name` where it trained so."""
    return g.op("Add", [g.matmul(g.gemm_input(x, name), p, f"{name}.w"),
                        g.const(p[f"{name}.b"].reshape(-1).astype(np.float32), f"{name}.b")])


def layer_norm(g, x, p, name):
    return g.op("LayerNormalization", [x, g.const(p[f"{name}.g"].reshape(-1).astype(np.float32)),
                                       g.const(p[f"{name}.b"].reshape(-1).astype(np.float32))],
                axis=-1, epsilon=EPS)


def swish(g, x):
    return g.op("Mul", [x, g.op("Sigmoid", [x])])


def rotary_tables(g, cos, sin):
    """(T, dk/2) cos and sin -> (T, dk) [cos | cos] and [-sin | sin]: what rotary()
    multiplies the (N, H, T, dk) heads and their swapped halves by."""
    return (g.op("Concat", [cos, cos], axis=-1),
            g.op("Concat", [g.op("Neg", [sin]), sin], axis=-1))


def rotary(g, x, cos2, sin2, half):
    """The rotary embedding of (N, H, T, dk) head blocks: each (a, b) pair of the first and
    second halves turned by the step's angle, as kernels_conformer.to_heads turns them:
    x [cos | cos] + [b | a] [-sin | sin] = [a cos - b sin | b cos + a sin], the same roundings
    (b (-sin) is -(b sin) exactly). cos2, sin2: rotary_tables()."""
    a, b = g.op("Split", [x, g.const(np.array([half, half], np.int64))], axis=-1, outputs=2)
    swapped = g.op("Concat", [b, a], axis=-1)
    return g.op("Add", [g.op("Mul", [x, cos2]), g.op("Mul", [swapped, sin2])])


def rope(g, t, dk):
    """The rotary tables (cos, sin) (T, dk/2) float32 of the steps 0..T-1 (T the int64 scalar
    t), computed in the graph as kernels_conformer.rope_tables computes them: the angles
    t * f_i in float64 (the same products), their sine and cosine in float64, rounded once to
    float32 (float32 angles would drift from hpcsgd's at long T). Nothing of T's size is
    stored: any length runs. sherpa-onnx's runtime has Sin but no Cos for float64, so
    cos a = 1 - 2 sin^2(a/2) (a/2 exact; within 1e-15 of cos a, far below float32's half step
    except at a rounding midpoint: tests/test_export_onnx.py checks the tables equal)."""
    pos = g.op("Cast", [g.op("Range", [g.const(np.int64(0)), t, g.const(np.int64(1))])], to=11)
    angle = g.op("Mul", [g.op("Unsqueeze", [pos, g.const(np.array([1], np.int64))]),
                         g.const(rope_frequencies(dk), f"rope_freq_{dk}")], hint="angle")
    s = g.op("Sin", [g.op("Mul", [angle, g.const(np.float64(0.5))])])
    cos = g.op("Sub", [g.const(np.float64(1.0)),
                       g.op("Mul", [g.op("Mul", [s, s]), g.const(np.float64(2.0))])])
    return (g.op("Cast", [cos], to=1, hint="rope_cos"),
            g.op("Cast", [g.op("Sin", [angle])], to=1, hint="rope_sin"))


def block(g, x, lens, layer, p):
    """A Conformer block (model/conformer.py): the macaron feed-forwards, rotary self-attention
    over each utterance's own steps (the padding's keys masked), the convolution module (GLU,
    a depthwise convolution reading only the utterance's steps, its norm, swish), the final
    layer norm."""
    n = lambda part: f"{layer.name}.{part}"   # noqa: E731
    d, h, dk = layer.n_in, layer.heads, layer.dk

    def ff(x, part):
        y = linear(g, swish(g, linear(g, layer_norm(g, x, p, n(f"{part}.ln")), p,
                                      n(f"{part}.w1"))), p, n(f"{part}.w2"))
        return g.op("Add", [x, g.op("Mul", [y, g.const(np.float32(0.5))])])

    x = ff(x, "ff1")
    qkv = linear(g, layer_norm(g, x, p, n("mhsa.ln")), p, n("mhsa.qkv"))
    if ("rope", dk, lens) not in g.cache:   # one pair per head width and rate
        g.cache["rope", dk, lens] = rotary_tables(g, *rope(g, steps(g, x), dk))
    turn = g.cache["rope", dk, lens]

    def part(first, last):
        return g.op("Slice", [qkv, g.const(np.array([first * d], np.int64)),
                              g.const(np.array([last * d], np.int64)),
                              g.const(np.array([-1], np.int64))])

    def heads(first, last):   # (N, T, H', dk) -> (N, H', T, dk)
        y = g.op("Reshape", [part(first, last),
                             g.const(np.array([0, 0, (last - first) * h, dk], np.int64))])
        return g.op("Transpose", [y], perm=[0, 2, 1, 3])

    # q and k turned together, (N, 2H, T, dk): one rotary for both
    qk = rotary(g, heads(0, 2), *turn, dk // 2)
    q, k = g.op("Split", [qk, g.const(np.array([h, h], np.int64))], axis=1, outputs=2)
    q = g.op("Mul", [q, g.const(np.float32(1.0 / np.sqrt(dk)))])
    v = heads(2, 3)
    scores = g.op("MatMul", [q, g.op("Transpose", [k], perm=[0, 1, 3, 2])])
    # the padding's keys: + -inf (+ 0 elsewhere: the scores unchanged), one (N, 1, 1, T)
    # tensor for all blocks, cheaper than a Where over every (N, H, T, T) score
    if ("key_mask", lens) not in g.cache:
        keys = g.op("Cast", [valid(g, x, lens, axes=[1, 2])], to=9)   # (N, 1, 1, T) bool
        g.cache["key_mask", lens] = g.op("Where", [keys, g.const(np.float32(0)),
                                                   g.const(np.float32(-np.inf))])
    scores = g.op("Add", [scores, g.cache["key_mask", lens]])
    att = g.op("MatMul", [g.op("Softmax", [scores], axis=-1), v])
    att = g.op("Reshape", [g.op("Transpose", [att], perm=[0, 2, 1, 3]),
                           g.const(np.array([0, 0, d], np.int64))])
    x = g.op("Add", [x, linear(g, att, p, n("mhsa.out"))])
    # the convolution module
    z = linear(g, layer_norm(g, x, p, n("conv.ln")), p, n("conv.w1"))
    half = [g.op("Slice", [z, g.const(np.array([a], np.int64)), g.const(np.array([b], np.int64)),
                           g.const(np.array([-1], np.int64))]) for a, b in ((0, d), (d, 2 * d))]
    u = masked(g, g.op("Mul", [half[0], g.op("Sigmoid", [half[1]])]), lens)
    w = g.weight(p, n("conv.dw.w"), lambda a: a.T.reshape(d, 1, layer.kernel), axis=0)
    c = g.op("Conv", [g.gemm_input(g.op("Transpose", [u], perm=[0, 2, 1]), n("conv.dw")), w,
                      g.const(p[n("conv.dw.b")].reshape(-1).astype(np.float32))],
             kernel_shape=[layer.kernel], group=d,
             pads=[layer.left, layer.kernel - 1 - layer.left])
    c = g.op("Transpose", [c], perm=[0, 2, 1])
    if layer.norm == "ln":
        c = layer_norm(g, c, p, n("conv.norm"))
    else:
        dev, var = deviations(g, c, lens)
        inv_std = g.op("Reciprocal", [g.op("Sqrt", [g.op("Add", [var,
                                                                 g.const(np.float32(EPS))])])])
        c = g.op("Add", [g.op("Mul", [g.op("Mul", [dev, inv_std]),
                                      g.const(p[n("conv.norm.g")].reshape(-1)
                                              .astype(np.float32))]),
                         g.const(p[n("conv.norm.b")].reshape(-1).astype(np.float32))])
    x = g.op("Add", [x, linear(g, swish(g, c), p, n("conv.w2"))])
    x = ff(x, "ff2")
    return layer_norm(g, x, p, n("ln")), lens


def dense(g, x, lens, layer, p, act):
    y = g.op("Add", [g.matmul(x, p, layer.W),
                     g.const(p[layer.b].reshape(-1).astype(np.float32), layer.b)])
    return activation(g, y, act), lens


def unsupported(model, meta_path, streaming=False):
    """Why this model cannot be exported yet (None: it can); streaming: as the streaming
    graphs (export_onnx_streaming), which take what reads a bounded number of frames ahead."""
    describe = model.describe
    kind = describe.get("type", "dnn")
    if of_model(describe).GRAPH_TOPOLOGY == "hmm":   # a hybrid frame classifier
        return (f"{meta_path}: a hybrid {kind} model (frame posteriors over HMM states): it "
                f"needs a decoding graph and the label priors (hpcsgd mkgraph, hpcsgd decode "
                f"--graph), not a CTC search; only CTC and RNN-T models are exported to ONNX")
    if kind not in ("ctc", "rnnt"):
        return (f"{meta_path}: not yet exported: model type {kind!r} (the ONNX export "
                f"covers CTC and RNN-T models only)")
    for text, layer in zip(describe["encoder"], model.layers):
        if isinstance(layer, ChunkedBLSTM) and not streaming:
            return (f"{meta_path}: encoder layer {text!r} is a chunked BLSTM: it runs on "
                    f"chunks as they arrive, so export it with --streaming")
        if not isinstance(layer, (StackFrames, Conv1d, LSTM, Dense, Conv2dSubsampling,
                                  ConformerBlock)):
            return (f"{meta_path}: not yet exported: encoder layer {text!r} (the ONNX export "
                    f"covers stack, conv, lstm, blstm, dense, conv2d and conformer layers)")
    return None


def encoder(g, model, p, mean=None, inv_std=None, utterance=None):
    """The graph's inputs x, x_lens normalised (normalize()) and through the model's encoder
    layers (all but its output layer) -> (the encoder's output (N, T', C), its lengths):
    what a CTC graph's output layer and a transducer's encoder projection read. g's hooks
    quantize each GEMM's input (an IntGraph) or pass it (a float Graph)."""
    act = model.describe["activation"]
    lens = "x_lens"
    x = normalize(g, "x", lens, mean, inv_std, utterance)
    for i, layer in enumerate(model.layers[:-1]):
        if not isinstance(layer, (Conv1d, Conv2dSubsampling)):   # those quantize their
            x = g.gemm_input(x, i)                                 # own reshaped input
        if isinstance(layer, StackFrames):
            x, lens = stack(g, x, lens, layer)
        elif isinstance(layer, Conv1d):
            x, lens = conv(g, x, lens, layer, p, act, i)
        elif isinstance(layer, LSTM):
            x, lens = lstm(g, x, lens, layer, p)
        elif isinstance(layer, Conv2dSubsampling):
            x, lens = frontend(g, x, lens, layer, p, i)
        elif isinstance(layer, ConformerBlock):
            x, lens = block(g, x, lens, layer, p)
        else:
            x, lens = dense(g, x, lens, layer, p, act)
        x = masked(g, x, lens)
    return x, lens


def graph(model, params, mean=None, inv_std=None, utterance=None, name="hpcsgd_ctc", g=None):
    """The ONNX ModelProto of a CTC model (its layers and float32 parameters) with the
    normalisation in front: (x - mean) * inv_std, or with utterance "mean" or "meanvar" each
    utterance's own statistics (normalize()). g: the Graph to build in (default a float one;
    a quantization-aware model's: export_onnx_int.IntGraph)."""
    import onnx
    from onnx import TensorProto, helper
    g = g or Graph()
    p = {name: np.asarray(params[name]) for name in params.views}
    x, lens = encoder(g, model, p, mean, inv_std, utterance)
    out = model.layers[-1]
    z = g.op("Add", [g.matmul(g.gemm_input(x, len(model.layers) - 1), p, out.W),
                     g.const(p[out.b].reshape(-1).astype(np.float32), out.b)], hint="logits")
    g.nodes.append(helper.make_node("LogSoftmax", [z], ["log_probs"], axis=-1))
    g.nodes.append(helper.make_node("Identity", [lens], ["log_probs_len"]))
    dim = model.input_dim
    graph_ = helper.make_graph(
        g.nodes, name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", dim]),
         helper.make_tensor_value_info("x_lens", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("log_probs", TensorProto.FLOAT,
                                       ["N", "T_out", model.num_labels]),
         helper.make_tensor_value_info("log_probs_len", TensorProto.INT64, ["N"])],
        g.inits)
    proto = helper.make_model(graph_, producer_name="hpcsgd",
                              opset_imports=[helper.make_opsetid("", g.opset)])
    proto.ir_version = g.ir_version
    onnx.checker.check_model(proto)
    return proto


def global_cmvn(archive_dir, cmvn):
    """(mean, inv_std, speakers, frames) of an archive's per-speaker CMVN statistics summed
    over all its speakers: the one normalisation a recognizer of single utterances can apply.
    cmvn: the model's data.cmvn (none, mean, meanvar)."""
    total, speakers = norm.summed_stats(archive_dir)
    shift, scale = norm.global_shift_scale(total, cmvn)
    return -shift, scale, speakers, int(total[0, -1])


def sherpa_tokens(symbols, kind):
    """tokens.txt lines for sherpa-onnx, whose text is the symbols joined, a leading `▁` read
    as a space: phones each get one (text = the phones separated by spaces), the chars'
    `<space>` becomes `▁` (text = the words), BPE pieces stay as they are."""
    lines = []
    for i, sym in enumerate(symbols):
        if i == 0:
            sym = archive.BLANK
        elif kind == "phones":
            sym = WORD_START + sym
        elif kind == "chars" and sym == SPACE:
            sym = WORD_START
        if not sym or any(ch.isspace() for ch in sym):
            raise UserError(f"token {i} {sym!r}: sherpa-onnx's tokens.txt cannot hold a "
                            f"symbol with white space")
        lines.append(f"{sym} {i}")
    return "\n".join(lines) + "\n"


def feature_options(extractor):
    """sherpa-onnx's FeatureExtractorConfig arguments that give hpcsgd's fbank, from the
    archive's extractor config; a UserError naming an option it cannot set."""
    if extractor.get("feature_type") != "fbank":
        raise UserError(f"features {extractor.get('feature_type')!r}: sherpa-onnx's Python "
                        f"feature config computes fbank only (its MFCC switch is internal)")
    for key, want in SHERPA_FIXED.items():
        if extractor.get(key) != want:
            raise UserError(f"feature option {key}={extractor.get(key)!r}: sherpa-onnx's "
                            f"FeatureExtractorConfig fixes it at {want!r} (not settable from "
                            f"Python)")
    return {"sampling_rate": int(extractor["sample_rate"]),
            "feature_dim": int(extractor["num_mel_bins"]),
            "low_freq": float(extractor["low_freq"]), "high_freq": float(extractor["high_freq"]),
            "dither": float(extractor["dither"]),
            # sherpa-onnx scales [-1, 1] samples by 32768 when False: hpcsgd's int16 range
            "normalize_samples": float(extractor["audio_scale"]) != 32768.0,
            "snip_edges": bool(extractor["snip_edges"])}


def sherpa_code(out_dir, options):
    """The Python that loads what export.write_onnx wrote into sherpa-onnx, with hpcsgd's fbank."""
    feat = ", ".join(f"{k}={v!r}" for k, v in options.items())
    model, tokens = (os.path.join(out_dir, n) for n in ("model.onnx", "tokens.txt"))
    return f"""import sherpa_onnx
from sherpa_onnx.lib._sherpa_onnx import OfflineRecognizer   # takes the whole config
config = sherpa_onnx.OfflineRecognizerConfig(
    feat_config=sherpa_onnx.FeatureExtractorConfig({feat}),
    model_config=sherpa_onnx.OfflineModelConfig(
        zipformer_ctc=sherpa_onnx.OfflineZipformerCtcModelConfig(model={model!r}),
        tokens={tokens!r}, num_threads=1),
    decoding_method="greedy_search")
recognizer = OfflineRecognizer(config)
# per utterance: float samples in [-1, 1] at {options['sampling_rate']} Hz (soundfile.read)
#   s = recognizer.create_stream(); s.accept_waveform({options['sampling_rate']}, samples)
#   recognizer.decode_stream(s); print(s.result.text)
"""


CMVN_CHOICES = ("global", "utterance")


def save(protos, out_dir, tokens_text):
    """Each graph as OUT_DIR/<part>.onnx and the token table as tokens.txt, each under a
    temporary name first -> {part: its path, "tokens": tokens.txt's path}."""
    import onnx
    os.makedirs(out_dir, exist_ok=True)
    done = {}
    for part, proto in protos.items():
        done[part] = os.path.join(out_dir, f"{part}.onnx")
        onnx.save(proto, done[part] + ".tmp")
        os.replace(done[part] + ".tmp", done[part])   # nothing half-written under the name
    done["tokens"] = os.path.join(out_dir, "tokens.txt")
    archive.atomic_write_text(done["tokens"], tokens_text)
    return done
