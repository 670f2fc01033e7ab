"""`hpcsgd export RUN --onnx OUT_DIR` of an RNN-T model: its encoder, prediction network and
joint as three ONNX graphs that sherpa-onnx's offline transducer recognizer decodes from the
audio (greedy_search, modified_beam_search), in the conventions of icefall's transducer
export (sherpa-onnx/csrc/offline-transducer-model.cc), model_type "transducer".

    hpcsgd export runs/so762/rnnt --onnx runs/so762/rnnt_onnx [--cmvn global|utterance]

OUT_DIR/encoder.onnx  x (N, T, D) float32 fbank, x_lens (N,) int64 -> encoder_out
                      (N, T', joint): the encoder (export_onnx.encoder: the CTC export's
                      graph of every layer, the normalisation folded in) and the transducer's
                      encoder projection enc = x We + be; encoder_out_lens (N,) int64
OUT_DIR/decoder.onnx  y (N, CONTEXT_SIZE) int64, the hypothesis' last tokens as sherpa-onnx
                      passes them -> decoder_out (N, joint): pred = LSTM(E[...]) Wp + bp
OUT_DIR/joiner.onnx   encoder_out (N, joint), decoder_out (N, joint) -> logit (N, V):
                      tanh(enc + pred) (or enc * pred: joint_mode mul) Wo + bo
OUT_DIR/tokens.txt    as the CTC export's: <blk> 0, sherpa-onnx's transducer searches take
                      the blank as id 0, which is hpcsgd's: no id is permuted
The streaming export (hpcsgd/export_onnx_streaming.py) writes this decoder and joiner beside
its own encoder: sherpa-onnx's online transducer searches pass the decoder the same window.

Why not sherpa-onnx's NeMo transducer loader (model_type "nemo_transducer"), the one with a
stateful LSTM decoder: it overwrites the feature options (offline-recognizer-transducer-nemo-
impl.h, PostInit: low_freq 0, librosa mel filters, no DC removal; no metadata key turns that
off, is_giga_am only changes it otherwise), so no model trained on Kaldi fbank recognizes
anything through it; and it wants the blank last and (N, C, T) tensors. The icefall loader
leaves the features to the caller, but its decoder is stateless: sherpa-onnx passes the last
`context_size` tokens of the hypothesis (metadata of decoder.onnx), the start padded as
[-1, .., -1, 0] (0: the blank). The prediction network here is an LSTM over the whole
history, so the decoder graph reruns it over the window each time: it counts the u emitted
tokens (ids > 0; a search never emits the blank), takes the window's last min(u + 1,
CONTEXT_SIZE) entries -- the blank start symbol, then y_1 .. y_u -- left-aligned, and runs
the LSTM layers from the zero state over them (ONNX LSTM with each row's sequence_lens),
keeping each row's last output: the same pred as hpcsgd's Transducer.start then step per
token. Exact while a hypothesis has fewer than CONTEXT_SIZE tokens; past that the LSTM
sees only the last CONTEXT_SIZE tokens, from the zero state. The price is compute: each call
runs u + 1 LSTM steps instead of one (quadratic in the hypothesis' length), the window
trimmed to the longest row's so that a large CONTEXT_SIZE costs nothing itself.

A quantization-aware model (export.write_onnx: graph, an IntGraph per file, params its
fake-quantized weights): what QAT quantizes (model/transducer.py), on the grids it trained
on (hpcsgd/export_onnx_int.py's forms). encoder.onnx: the encoder as a CTC model's integer
graph, the projection float. decoder.onnx: the embedding's codes (INT8: int8 behind a
DequantizeLinear; INT4: int4, Cast and scaled) gathered per token, the LSTM weights' codes,
each LSTM's input above the first on the fixed grid of [-1, 1]; with quantized activations
h_(t-1) too, at every step, which ONNX's LSTM cannot do: the layer is a Scan
(quantized_lstm); without, ONNX's float LSTM on the weights' values. joiner.onnx: float, as
QAT keeps the joint. At INT4 the encoder and decoder are opset 21 / IR 10 (int4 tensors:
finish takes the graph's), the joiner opset 17. The encoder's (B)LSTMs with quantized
activations and dynamic grids are refused as for CTC (export_onnx_int.refusal).

sherpa-onnx's searches against hpcsgd's (decode/rnnt.py): its greedy_search emits at most one
token per frame (hpcsgd's up to MAX_SYMBOLS = 3); it takes a token named <unk> for a second
blank (so tokens.txt spells a BPE inventory's <unk> as ⁇: transducer_tokens); its
modified_beam_search is hpcsgd's beam_search, except that it ranks the final hypotheses by
log-probability / (context_size + tokens), which with CONTEXT_SIZE = 1024 is nearly hpcsgd's
unnormalised ranking.
"""

import numpy as np

from hpcsgd.export_onnx import Graph, encoder, lstm, save, sherpa_tokens

# the decoder's window: sherpa-onnx copies this many int64 per hypothesis per call (8 KB, a
# trifle beside the LSTM), the graph reads only the longest row's tokens; hypotheses of up
# to CONTEXT_SIZE - 1 tokens get the LSTM over their whole history
CONTEXT_SIZE = 1024
UNK_SURFACE = "\u2047"   # ⁇, how sentencepiece writes <unk> in decoded text


def affine(g, x, p, w, b):
    """x @ p[w] + p[b] (the transducer's projections, float32)."""
    return g.op("Add", [g.op("MatMul", [x, g.const(p[w].astype(np.float32), w)]),
                        g.const(p[b].reshape(-1).astype(np.float32), b)])


def finish(g, name, inputs, outputs, props):
    """The checked ModelProto of g's nodes; inputs, outputs: (name, onnx type, shape). At g's
    opset and IR (an INT4 IntGraph's: 21, 10, for its int4 tensors; else 17, 8)."""
    import onnx
    from onnx import helper
    value = lambda spec: helper.make_tensor_value_info(*spec)   # noqa: E731
    proto = helper.make_model(
        helper.make_graph(g.nodes, name, [value(i) for i in inputs], [value(o) for o in outputs],
                          g.inits),
        producer_name="hpcsgd", opset_imports=[helper.make_opsetid("", g.opset)])
    proto.ir_version = g.ir_version
    helper.set_model_props(proto, props)
    onnx.checker.check_model(proto)
    return proto


def encoder_graph(model, params, mean=None, inv_std=None, utterance=None, props=None, g=None):
    """x, x_lens -> encoder_out (N, T', joint), encoder_out_lens: the encoder as the CTC
    export builds it (with the normalisation), then the transducer's encoder projection.
    g: the Graph to build in (a quantization-aware model's: an IntGraph, params its
    fake-quantized weights; the projection stays float, as QAT keeps it)."""
    from onnx import TensorProto
    g, out = g or Graph(), model.layers[-1]
    p = {name: np.asarray(params[name]) for name in params.views}
    x, lens = encoder(g, model, p, mean, inv_std, utterance)
    g.nodes.append(g.helper.make_node("Identity", [affine(g, x, p, out.W, out.b)],
                                      ["encoder_out"]))
    g.nodes.append(g.helper.make_node("Identity", [lens], ["encoder_out_lens"]))
    return finish(g, "hpcsgd_rnnt_encoder",
                  [("x", TensorProto.FLOAT, ["N", "T", model.input_dim]),
                   ("x_lens", TensorProto.INT64, ["N"])],
                  [("encoder_out", TensorProto.FLOAT, ["N", "T_out", out.joint]),
                   ("encoder_out_lens", TensorProto.INT64, ["N"])], props or {})


def decoder_graph(model, params, context_size=CONTEXT_SIZE, props=None, g=None):
    """y (N, context_size) int64 -> decoder_out (N, joint): the prediction network over the
    blank start symbol and the window's emitted tokens (the module docstring). g: as
    encoder_graph's (an IntGraph: the embedding's codes, each LSTM input above the first and
    each h_(t-1) on its grid where QAT quantizes them: quantized_lstm)."""
    from onnx import TensorProto
    g, out = g or Graph(), model.layers[-1]
    p = {name: np.asarray(params[name]) for name in params.views}
    i64 = lambda v: g.const(np.array(v, np.int64))   # noqa: E731
    # u: the tokens emitted (ids > 0; the start is -1 .. -1 0), n = min(u + 1, C) inputs
    u = g.op("ReduceSum", [g.op("Cast", [g.op("Greater", ["y", i64(0)])], to=7), i64([1])],
             keepdims=0)
    n = g.op("Min", [g.op("Add", [u, i64(1)]), i64(context_size)], hint="inputs")
    longest = g.op("ReduceMax", [n], keepdims=0)
    steps = g.op("Range", [i64(0), longest, i64(1)])
    # row b's inputs left-aligned: y[b, C - n_b + s] for s < longest (clipped at C - 1 past
    # n_b: sequence_lens leaves those steps out)
    first = g.op("Sub", [i64(context_size), n])
    at = g.op("Add", [g.op("Unsqueeze", [first, i64([1])]), g.op("Unsqueeze", [steps, i64([0])])])
    at = g.op("Min", [at, i64(context_size - 1)])
    tok = g.op("Max", [g.op("GatherElements", ["y", at], axis=1), i64(0)])   # -1 -> any row
    x = g.op("Gather", [g.weight(p, out.E), tok], axis=0)
    for k, layer in enumerate(out.pred):
        if k:   # QAT: on the fixed grid of [-1, 1] (Transducer._quantized_input)
            x = g.gemm_input(x, layer.W[:-2])
        if layer.hidden_grid is None:
            x, _ = lstm(g, x, n, layer, p)
        else:
            x = quantized_lstm(g, x, layer, p)
    # each row's output after its last input: a one-hot over the steps (exact: x * 1 + 0s)
    last = g.op("Equal", [g.op("Unsqueeze", [steps, i64([0])]),
                          g.op("Unsqueeze", [g.op("Sub", [n, i64(1)]), i64([1])])])
    pick = g.op("Unsqueeze", [g.op("Cast", [last], to=1), i64([2])])
    h = g.op("ReduceSum", [g.op("Mul", [x, pick]), i64([1])], keepdims=0)
    g.nodes.append(g.helper.make_node("Identity", [affine(g, h, p, out.Wp, out.bp)],
                                      ["decoder_out"]))
    return finish(g, "hpcsgd_rnnt_decoder", [("y", TensorProto.INT64, ["N", context_size])],
                  [("decoder_out", TensorProto.FLOAT, ["N", out.joint])], props or {})


def quantized_lstm(g, x, layer, p):
    """A forward LSTM layer whose recurrent GEMM reads h_(t-1) on the layer's hidden grid at
    every step, as quantization-aware training runs it (LSTM.forward, LSTM.step): ONNX's LSTM
    cannot, so the steps are a Scan over x W + b (N, S, 4H) time-major, its body
    v = xw_t + Q(h_(t-1)) U, hpcsgd's gates i f g o, c = f c + i g, h = o tanh(c), from the
    zero state. Every row runs all S steps (a row's steps past its own inputs read clipped
    tokens and are never picked: the decoder takes each row's output at its last input)."""
    from onnx import TensorProto, helper
    h = layer.cells
    xw = g.op("Add", [g.matmul(x, p, layer.W),
                      g.const(p[layer.b].reshape(-1).astype(np.float32), layer.b)])
    xw = g.op("Transpose", [xw], perm=[1, 0, 2])   # (S, N, 4H)
    outer, g.nodes = g.nodes, []   # the body's nodes (its constants: the outer graph's)
    h_prev, c_prev, xw_t = (g.name(f"{layer.W[:-2]}.{v}") for v in ("h_prev", "c_prev", "xw_t"))
    v = g.op("Add", [xw_t, g.matmul(g.gemm_input(h_prev, layer.W[:-2] + ".h"), p, layer.U[0])])
    i, f, gg, o = g.op("Split", [v, g.const(np.full(4, h, np.int64))], axis=-1, outputs=4)
    c = g.op("Add", [g.op("Mul", [g.op("Sigmoid", [f]), c_prev]),
                     g.op("Mul", [g.op("Sigmoid", [i]), g.op("Tanh", [gg])])], hint="c")
    y = g.op("Mul", [g.op("Sigmoid", [o]), g.op("Tanh", [c])], hint="h")
    outs = [g.op("Identity", [a]) for a in (y, c, y)]
    body, g.nodes = g.nodes, outer
    value = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa
    body = helper.make_graph(body, f"{layer.W[:-2]}_step", [value(a) for a in (h_prev, c_prev,
                                                                            xw_t)],
                             [value(a) for a in outs])
    shape = g.op("Concat", [g.op("Shape", [x], start=0, end=1),
                            g.const(np.array([h], np.int64))], axis=0)
    zero = g.op("ConstantOfShape", [shape], value=helper.make_tensor("zero", TensorProto.FLOAT,
                                                                     [1], [0.0]))
    _, _, ys = g.op("Scan", [zero, zero, xw], outputs=3, body=body, num_scan_inputs=1)
    return g.op("Transpose", [ys], perm=[1, 0, 2])   # (N, S, H)


def joiner_graph(model, params, props=None):
    """encoder_out, decoder_out (N, joint) -> logit (N, V): Transducer.joint_logits."""
    from onnx import TensorProto
    g, out = Graph(), model.layers[-1]
    p = {name: np.asarray(params[name]) for name in params.views}
    mix = g.op("Add" if out.mode_name == "add" else "Mul", ["encoder_out", "decoder_out"])
    g.nodes.append(g.helper.make_node("Identity", [affine(g, g.op("Tanh", [mix]), p, out.Wo,
                                                          out.bo)], ["logit"]))
    return finish(g, "hpcsgd_rnnt_joiner",
                  [("encoder_out", TensorProto.FLOAT, ["N", out.joint]),
                   ("decoder_out", TensorProto.FLOAT, ["N", out.joint])],
                  [("logit", TensorProto.FLOAT, ["N", out.num_tokens])], props or {})


def transducer_tokens(symbols, kind):
    """tokens.txt as the CTC export writes it (export_onnx.sherpa_tokens), but sentencepiece's
    <unk> (a BPE inventory has it; prep drops the utterances that need it, so it is never a
    target) spelled as its surface form ⁇: sherpa-onnx's transducer searches take a symbol
    named <unk> for a second blank, hpcsgd's for a token, and the two would part where it
    wins."""
    return sherpa_tokens([UNK_SURFACE if s == "<unk>" else s for s in symbols], kind)


def write(model, params, out_dir, norm, props, options, tokens, graph=None):
    """Write encoder.onnx, decoder.onnx, joiner.onnx and tokens.txt of the RNN-T model into
    out_dir -> {"encoder", "decoder", "joiner", "tokens", "code", "quantization"}. norm:
    (mean, inv_std, utterance) as export_onnx.normalize takes them; props: the metadata of
    every file (the CTC export's keys); tokens: the checkpoint's inventory ({"kind",
    "symbols"}); graph: a quantization-aware model's fresh IntGraph per call (params its
    fake-quantized weights) for the encoder and decoder, whose "quantization" metadata then
    says what each holds (the joiner is float: QAT keeps the joint float)."""
    from onnx import helper
    from hpcsgd.export_onnx_int import describe
    out = model.layers[-1]
    common = {**props, "predictor": ", ".join(model.describe["predictor"]),
              "embed": str(out.embed), "joint": str(out.joint), "joint_mode": out.mode_name}
    gs = {part: graph() if graph else Graph() for part in ("encoder", "decoder")}
    protos = {
        # "zipformer2": a model_type sherpa-onnx's loader maps to its icefall transducer
        # conventions when the config does not name one (the printed call does)
        "encoder": encoder_graph(model, params, *norm, {**common, "model_type": "zipformer2"},
                                 g=gs["encoder"]),
        # vocab_size and context_size: the two keys the loader reads
        "decoder": decoder_graph(model, params, CONTEXT_SIZE,
                                 {**common, "context_size": str(CONTEXT_SIZE)}, g=gs["decoder"]),
        "joiner": joiner_graph(model, params, common)}
    quantization = props.get("quantization")
    if graph:
        said = {part: describe(g, model.quant) for part, g in gs.items()}
        said["joiner"] = "none: float32 (quantization-aware training keeps the joint float)"
        for part, proto in protos.items():
            kept = {p.key: p.value for p in proto.metadata_props}
            helper.set_model_props(proto, {**kept, "quantization": said[part]})
        quantization = "; ".join(f"{part}: {text}" for part, text in said.items())
    done = save(protos, out_dir, transducer_tokens(tokens["symbols"], tokens["kind"]))
    done["code"] = sherpa_code(done, options)
    done["quantization"] = quantization
    return done


def sherpa_code(files, options, method="greedy_search"):
    """The Python that loads the exported files into sherpa-onnx with hpcsgd's fbank."""
    feat = ", ".join(f"{k}={v!r}" for k, v in options.items())
    rate = options["sampling_rate"]
    return f"""import sherpa_onnx
from sherpa_onnx.lib._sherpa_onnx import OfflineRecognizer   # takes the whole config
config = sherpa_onnx.OfflineRecognizerConfig(
    feat_config=sherpa_onnx.FeatureExtractorConfig({feat}),
    model_config=sherpa_onnx.OfflineModelConfig(
        transducer=sherpa_onnx.OfflineTransducerModelConfig(
            encoder_filename={files['encoder']!r},
            decoder_filename={files['decoder']!r},
            joiner_filename={files['joiner']!r}),
        tokens={files['tokens']!r}, num_threads=1, model_type="transducer"),
    decoding_method={method!r}, max_active_paths=4)   # or "modified_beam_search"
recognizer = OfflineRecognizer(config)
# per utterance: float samples in [-1, 1] at {rate} Hz (soundfile.read)
#   s = recognizer.create_stream(); s.accept_waveform({rate}, samples)
#   recognizer.decode_stream(s); print(s.result.text)
"""
