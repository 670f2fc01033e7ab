"""`hpcsgd export RUN --onnx OUT_DIR --streaming [--chunk-ms MS]`: a model whose encoder
is causal (`stack`, `lstm`, `dense`, `conv F k1`) as graphs that sherpa-onnx's ONLINE
recognizer runs on audio as it arrives, the LSTM states carried from one chunk to the next.

    hpcsgd export runs/so762/lstm_rnnt --onnx runs/so762/lstm_rnnt_online --streaming

RNN-T: the conventions of icefall's lstm_transducer_stateless2 export, which sherpa-onnx's
OnlineLstmTransducerModel loads (sherpa-onnx/csrc/online-lstm-transducer-model.cc, model_type
"lstm" in the encoder's metadata):
  OUT_DIR/encoder.onnx  x (N, T, D) float32 fbank, h (L, N, H), c (L, N, H) float32 ->
                        encoder_out (N, T/stride, joint), next_h, next_c: the encoder from
                        the states h, c (the chunk's first frame continues where the last
                        chunk stopped) and the transducer's encoder projection
  OUT_DIR/decoder.onnx, joiner.onnx, tokens.txt  the offline export's (export_onnx_rnnt:
                        the decoder reruns the prediction network over sherpa-onnx's window
                        of the hypothesis' last tokens; the online searches pass the same
                        window as the offline ones)
CTC: sherpa-onnx's online zipformer2 CTC loader (online-zipformer2-ctc-model.cc), which takes
batch-major features, leaves the Kaldi fbank options to the caller and sizes its states from
the graph's metadata (WeNet's sizes its caches from the caller's chunk_size and
num_left_chunks and decodes one stream at a time; T-one's fixes 300 ms frames at 8 kHz;
NeMo's online CTC loader leaves the features alone too, but transposes them to (N, C, T) and
wants NeMo's three caches and a vocab_size without the blank):
  OUT_DIR/model.onnx    x (N, T, D), then the loader's 8 state tensors -> log_probs (N,
                        T/stride, V), then the 8 states. The loader builds them from the
                        metadata of one zipformer "layer" sized to carry the LSTMs' states:
                        cached_key (L, N, H) holds h, cached_val1 (L, N, H) holds c; the other
                        six (cached_nonlin_attn (1, N, L, 3), cached_val2 (L, N, H),
                        cached_conv1/2 (N, 4, 1), embed_states (N, 128, 3, 19), processed_lens
                        (N,)) pass through unchanged
  OUT_DIR/tokens.txt    the offline export's

States: L = the encoder's LSTM layers (1 if it has none: a state that passes through), H =
their widest; layer l reads h[l, :, :H_l], c[l, :, :H_l] and writes them back, zero beyond.
sherpa-onnx starts every stream from zeros, which is where hpcsgd's LSTMs start an utterance.

Chunks: sherpa-onnx feeds T frames at a time and advances by decode_chunk_len (metadata),
the chunk, --chunk-ms / 10 ms: a multiple of the encoder's stride so that a stack or a
strided layer cuts the chunks where it cuts the utterance. T = the chunk plus the encoder's
lookahead: the frames its `conv F kK ahead` layers read past the chunk ((K-1)D each, times
the stride below it), 0 for an encoder of causal layers only. The lookahead frames pass
through every layer below the last lookahead conv, and each LSTM there runs twice: over the
chunk from the carried state, whose end state is what it carries on, then over the lookahead
frames from that state (their outputs feed the convolution, and are recomputed as part of
the next chunk). A lookahead conv is a "valid" convolution, so the graph emits the chunk's
frames only. With the states carried, chunk after chunk gives exactly the whole utterance's
forward; only the end differs: sherpa-onnx decodes a chunk once one frame more than T has
arrived, so the last partial chunk needs tail padding (the printed call appends T + 1 frames
of zeros), whose silence frames the model then also sees, and which the lookahead of the
utterance's last frames reads where hpcsgd's whole-utterance forward reads zeros.

A chunked BLSTM (`blstm H cC rR [lL]`, model/chunked_blstm.py) runs as ONNX's bidirectional
LSTM (L of them, each over the whole window) over the chunk and its R steps of lookahead from
zero states, and keeps the chunk's C outputs; it carries no state, and fixes the chunk (C
times the stride below it): the chunk it trained on. Above it only layers that read no frame ahead (they would read its outputs for
the next chunk, which the next chunk's window computes).

Normalisation: the global CMVN of the offline export (--cmvn global), folded into the graph:
a stream has no utterance statistics before its end, so --cmvn utterance is refused.
Layers that read the future without bound are refused by name: blstm (its backward
direction starts at the utterance's end), a centred conv with a kernel over 1 (it reads
(K-1)D//2 frames behind, a state these graphs do not carry: `ahead` convs read only ahead),
a strided `ahead` conv, a conv's instance norm `in` (the utterance's statistics),
conv2d (its 3x3 kernels read the next frame) and conformer blocks (attention over the whole
utterance).
"""

import numpy as np

from hpcsgd.errors import UserError
from hpcsgd.export_onnx import ONNX_GATES, Graph, conv, dense, lstm, save, sherpa_tokens, stack
from hpcsgd.export_onnx_rnnt import (CONTEXT_SIZE, affine, decoder_graph, finish,
                                     joiner_graph, transducer_tokens)
from hpcsgd.model.chunked_blstm import ChunkedBLSTM
from hpcsgd.model.conformer import ConformerBlock
from hpcsgd.model.conv import Conv1d, StackFrames
from hpcsgd.model.encoder import time_stride
from hpcsgd.model.kernels_lstm import GATES
from hpcsgd.model.layers import Dense
from hpcsgd.model.lstm import LSTM

CHUNK_FRAMES = 32   # the default chunk: 320 ms (rounded up to a multiple of the stride)
FRAME_MS = 10       # hpcsgd's fbank frame shift (the export refuses another: SHERPA_FIXED)
# the zipformer2 CTC loader's fixed state shapes (online-zipformer2-ctc-model.cc, InitStates)
EMBED_STATE = (128, 3, 19)
ZIP_DIM, ZIP_KERNEL = 4, 2   # encoder_dims, cnn_module_kernels: the smallest dummy states


def not_causal(model, meta_path):
    """Why this model's encoder cannot stream (None: it can)."""
    chunked = None   # the chunked BLSTM's spec, once one is below
    for text, layer in zip(model.describe["encoder"], model.layers):
        if isinstance(layer, (StackFrames, Dense)):
            continue
        if chunked and (isinstance(layer, ChunkedBLSTM) or isinstance(layer, Conv1d)
                        and not layer.left and layer.kernel > 1):
            return (f"{meta_path}: encoder layer {text!r} cannot stream above the chunked "
                    f"BLSTM {chunked!r}: it would read that layer's outputs for the next "
                    f"chunk, which come from the next chunk's window; above a chunked BLSTM "
                    f"only layers that read no frame ahead")
        if isinstance(layer, ChunkedBLSTM):
            chunked = text
            continue
        if isinstance(layer, LSTM):
            if layer.dirs == 1:
                continue
            why = "its backward direction starts at the utterance's end"
        elif isinstance(layer, Conv1d):
            if layer.norm == "in":
                why = "its instance norm needs the whole utterance's statistics"
            elif layer.kernel > 1 and layer.left:
                why = (f"hpcsgd's convolutions are centred: it reads {layer.left} frames "
                       f"behind and {(layer.kernel - 1) * layer.dilation - layer.left} "
                       f"ahead (a lookahead layer reads ahead only: 'conv F kK ahead')")
            elif layer.kernel > 1 and layer.stride > 1:
                why = "a strided lookahead conv would cut the chunks off its stride"
            else:
                continue
        elif isinstance(layer, ConformerBlock):
            why = "its self-attention reads the whole utterance"
        else:
            why = "its 3x3 kernels read the next frame"
        return (f"{meta_path}: encoder layer {text!r} cannot stream: {why}; a streaming "
                f"encoder is made of stack, lstm, dense, conv F k1 and conv F kK ahead "
                f"layers")
    return None


def trained_chunk(model):
    """A chunked BLSTM's chunk in input frames (its C steps times the stride below it), or
    None: the chunk such an encoder streams with is the one it trained with."""
    stride = 1
    for layer in model.layers[:-1]:
        if isinstance(layer, ChunkedBLSTM):
            return layer.chunk * stride
        stride *= layer.k if isinstance(layer, StackFrames) else getattr(layer, "stride", 1)
    return None


def chunk_frames(model, chunk_ms):
    """Frames per chunk: chunk_ms / 10, which must be a multiple of the encoder's stride;
    None: the most of them within 320 ms (at least one stride), so that the default meets
    the usual latency budget of a chunked streaming model. A chunked BLSTM fixes it to its
    chunk."""
    stride = time_stride(model.describe["encoder"])
    fixed = trained_chunk(model)
    if fixed and chunk_ms is not None and chunk_ms != fixed * FRAME_MS:
        raise UserError(f"--chunk-ms {chunk_ms:g}: this encoder's chunked BLSTM was trained "
                        f"on chunks of {fixed * FRAME_MS} ms, the chunk it streams with "
                        f"(leave --chunk-ms out)")
    if fixed:
        return fixed
    if chunk_ms is None:
        return max(CHUNK_FRAMES // stride, 1) * stride
    frames = chunk_ms / FRAME_MS
    if frames != int(frames) or frames < 1 or int(frames) % stride:
        raise UserError(f"--chunk-ms {chunk_ms:g}: expected a multiple of {FRAME_MS * stride} "
                        f"ms (the encoder's stride, {stride} frames of {FRAME_MS} ms)")
    return int(frames)


def lookahead_frames(model):
    """Input frames the encoder reads past a chunk: each `ahead` conv's (K-1)D steps, in
    input frames (times the stride below it)."""
    frames, stride = 0, 1
    for layer in model.layers[:-1]:
        if isinstance(layer, Conv1d) and not layer.left:
            frames += (layer.kernel - 1) * layer.dilation * stride
        elif isinstance(layer, ChunkedBLSTM):
            frames += layer.right * stride
        stride *= layer.k if isinstance(layer, StackFrames) else getattr(layer, "stride", 1)
    return frames


def state_size(model):
    """(L, H) of the state tensors: LSTM layers (at least 1) and the widest one's cells."""
    cells = [layer.cells for layer in model.layers[:-1]
             if isinstance(layer, LSTM) and not isinstance(layer, ChunkedBLSTM)]
    return max(len(cells), 1), max(cells, default=1)


def lstm_from(g, x, layer, p, h, c, index, width, steps=None):
    """One forward LSTM layer (ONNX LSTM, gates reordered as export_onnx.lstm reorders them)
    from row `index` of the states h, c (L, N, width) -> (y (N, T, H), its h and c, each
    (1, N, width), zero beyond H): after the last step, or with `steps` after that many (the
    chunk's; the steps after them, the lookahead, continue from there into y only)."""
    cells = layer.cells
    order = np.concatenate([np.arange(q * cells, (q + 1) * cells) for q in ONNX_GATES])
    W = p[layer.W][:, order].T[None]
    R = p[layer.U[0]][:, order].T[None]
    B = np.concatenate([p[layer.b][0, order], np.zeros(GATES * cells)])[None]
    i64 = lambda v: g.const(np.array(v, np.int64))   # noqa: E731
    begin, end, axes = i64([index, 0]), i64([index + 1, cells]), i64([0, 2])
    h0 = g.op("Slice", [h, begin, end, axes])
    c0 = g.op("Slice", [c, begin, end, axes])
    as32 = lambda a: np.ascontiguousarray(a, np.float32)   # noqa: E731
    weights = [g.const(as32(W), layer.W), g.const(as32(R), layer.U[0]),
               g.const(as32(B), layer.b), ""]
    xt = g.op("Transpose", [x], perm=[1, 0, 2])   # time-major

    def run(x_tnd, h_in, c_in):
        return g.op("LSTM", [x_tnd, *weights, h_in, c_in], hidden_size=cells,
                    direction="forward", outputs=3, hint="lstm")
    if steps is None:
        y, h1, c1 = run(xt, h0, c0)
    else:   # the chunk, then its lookahead from the chunk's end state
        cut = lambda a, b: g.op("Slice", [xt, i64([a]), i64([b]), i64([0])])  # noqa: E731
        y, h1, c1 = run(cut(0, steps), h0, c0)
        y_ahead, _, _ = run(cut(steps, np.iinfo(np.int64).max), h1, c1)
        y = g.op("Concat", [y, y_ahead], axis=0)
    y = g.op("Transpose", [g.op("Squeeze", [y, i64([1])])], perm=[1, 0, 2])   # (N, T, H)
    if width > cells:
        pads = i64([0, 0, 0, 0, 0, width - cells])
        h1, c1 = g.op("Pad", [h1, pads]), g.op("Pad", [c1, pads])
    return y, h1, c1


def encoder(g, model, p, mean, inv_std, h, c, chunk):
    """x (N, chunk + its lookahead, D) and the states h, c -> (the encoder's output over the
    chunk (N, chunk/stride, C), next h, next c)."""
    act = model.describe["activation"]
    x = g.op("Mul", [g.op("Sub", ["x", g.const(np.asarray(mean, np.float32).reshape(-1),
                                                "cmvn_mean")]),
                     g.const(np.asarray(inv_std, np.float32).reshape(-1), "cmvn_inv_std")],
             hint="normalized")
    # every row of a chunk is full: the layer builders' lengths are T for each
    shape = g.op("Shape", [x])
    i64 = lambda v: g.const(np.array(v, np.int64))   # noqa: E731
    lens = g.op("Expand", [g.op("Gather", [shape, i64([1])], axis=0),
                           g.op("Gather", [shape, i64([0])], axis=0)], hint="lens")
    _, width = state_size(model)
    hs, cs = [], []
    # the chunk's steps and the lookahead's at each layer's input
    steps, ahead = chunk, lookahead_frames(model)
    for layer in model.layers[:-1]:
        if isinstance(layer, StackFrames):
            x, lens = stack(g, x, lens, layer)
            steps, ahead = steps // layer.k, ahead // layer.k
        elif isinstance(layer, Conv1d):
            reads = (layer.kernel - 1) * layer.dilation if not layer.left else 0
            if reads:   # lookahead: only the steps whose every tap the input holds
                lens = g.op("Sub", [lens, g.const(np.array(reads, np.int64))])
            x, lens = conv(g, x, lens, layer, p, act, valid=bool(reads))
            steps, ahead = steps // layer.stride, (ahead - reads) // layer.stride
        elif isinstance(layer, ChunkedBLSTM):   # the chunk's window, from zero states
            for blstm, _ in layer.stack():      # its BLSTMs over the whole window
                x, _ = lstm(g, x, lens, blstm, p)
            x = g.op("Slice", [x, i64([0]), i64([steps]), i64([1])], hint="chunk")
            lens = g.op("Sub", [lens, g.const(np.array(ahead, np.int64))])
            ahead = 0
        elif isinstance(layer, LSTM):
            x, h1, c1 = lstm_from(g, x, layer, p, h, c, len(hs), width,
                                  steps if ahead else None)
            hs.append(h1)
            cs.append(c1)
        else:
            x, lens = dense(g, x, lens, layer, p, act)
    if not hs:   # nothing recurrent: the state passes through
        return x, g.op("Identity", [h]), g.op("Identity", [c])
    concat = lambda parts: parts[0] if len(parts) == 1 else g.op("Concat", parts, axis=0)  # noqa
    return x, concat(hs), concat(cs)


def rnnt_encoder_graph(model, params, mean, inv_std, chunk, props=None):
    """x, h, c -> encoder_out, next_h, next_c (the module docstring)."""
    from onnx import TensorProto
    g, out = Graph(), model.layers[-1]
    p = {name: np.asarray(params[name]) for name in params.views}
    L, H = state_size(model)
    x, h, c = encoder(g, model, p, mean, inv_std, "h", "c", chunk)
    g.nodes.append(g.helper.make_node("Identity", [affine(g, x, p, out.W, out.b)],
                                      ["encoder_out"]))
    g.nodes.append(g.helper.make_node("Identity", [h], ["next_h"]))
    g.nodes.append(g.helper.make_node("Identity", [c], ["next_c"]))
    F = TensorProto.FLOAT
    # what the loader reads: the states' shapes (L, 1, d_model) and (L, 1, rnn_hidden_size),
    # the frames per call (T) and per step (decode_chunk_len)
    meta = {"model_type": "lstm", "num_encoder_layers": str(L), "d_model": str(H),
            "rnn_hidden_size": str(H), "T": str(chunk + lookahead_frames(model)),
            "decode_chunk_len": str(chunk)}
    return finish(g, "hpcsgd_rnnt_streaming_encoder",
                  [("x", F, ["N", "T", model.input_dim]), ("h", F, [L, "N", H]),
                   ("c", F, [L, "N", H])],
                  [("encoder_out", F, ["N", "T_out", out.joint]), ("next_h", F, [L, "N", H]),
                   ("next_c", F, [L, "N", H])], {**(props or {}), **meta})


def ctc_state_specs(L, H):
    """(name, shape) of the zipformer2 CTC loader's states for the metadata ctc_graph writes
    (its InitStates with N for the batch): the LSTMs' h in cached_key, c in cached_val1."""
    return [("h", [L, "N", H]), ("cached_nonlin_attn", [1, "N", L, 3 * ZIP_DIM // 4]),
            ("c", [L, "N", H]), ("cached_val2", [L, "N", H]),
            ("cached_conv1", ["N", ZIP_DIM, ZIP_KERNEL // 2]),
            ("cached_conv2", ["N", ZIP_DIM, ZIP_KERNEL // 2]),
            ("embed_states", ["N", *EMBED_STATE])]


def ctc_graph(model, params, mean, inv_std, chunk, props=None):
    """x and the loader's 8 states -> log_probs and the 8 states (the module docstring)."""
    from onnx import TensorProto
    g, out = Graph(), model.layers[-1]
    p = {name: np.asarray(params[name]) for name in params.views}
    L, H = state_size(model)
    x, h, c = encoder(g, model, p, mean, inv_std, "h", "c", chunk)
    z = g.op("Add", [g.op("MatMul", [x, g.const(p[out.W].astype(np.float32), out.W)]),
                     g.const(p[out.b].reshape(-1).astype(np.float32), out.b)], hint="logits")
    g.nodes.append(g.helper.make_node("LogSoftmax", [z], ["log_probs"], axis=-1))
    F, I64 = TensorProto.FLOAT, TensorProto.INT64
    inputs, outputs = [("x", F, ["N", "T", model.input_dim])], [
        ("log_probs", F, ["N", "T_out", model.num_labels])]   # V static: the loader reads it
    for name, shape in ctc_state_specs(L, H):
        new = {"h": h, "c": c}.get(name) or g.op("Identity", [name])
        g.nodes.append(g.helper.make_node("Identity", [new], [f"new_{name}"]))
        inputs.append((name, F, shape))
        outputs.append((f"new_{name}", F, shape))
    g.nodes.append(g.helper.make_node("Identity", ["processed_lens"], ["new_processed_lens"]))
    inputs.append(("processed_lens", I64, ["N"]))
    outputs.append(("new_processed_lens", I64, ["N"]))
    # one zipformer stack of one layer, its sizes chosen so that the loader's states carry
    # (L, N, H) twice; key and value dims: query_head_dims x num_heads
    meta = {"model_type": "zipformer2", "encoder_dims": str(ZIP_DIM),
            "query_head_dims": str(H), "value_head_dims": str(H), "num_heads": "1",
            "num_encoder_layers": "1", "cnn_module_kernels": str(ZIP_KERNEL),
            "left_context_len": str(L), "T": str(chunk + lookahead_frames(model)),
            "decode_chunk_len": str(chunk),
            "lstm_layers": str(L), "lstm_state_width": str(H)}
    return finish(g, "hpcsgd_ctc_streaming", inputs, outputs, {**(props or {}), **meta})


def write(model, params, out_dir, mean, inv_std, chunk, props, options, tokens):
    """Write the streaming graphs and tokens.txt of the CTC or RNN-T model into out_dir ->
    {"model" (CTC) or "encoder", "decoder", "joiner" (RNN-T), "tokens", "code", "chunk"}."""
    ahead = lookahead_frames(model)
    props = {**props, "streaming": f"chunks of {chunk} frames, LSTM states carried"
             + (f", {ahead} frames of lookahead" if ahead else "")}
    if model.describe["type"] == "rnnt":
        out = model.layers[-1]
        common = {**props, "predictor": ", ".join(model.describe["predictor"]),
                  "embed": str(out.embed), "joint": str(out.joint), "joint_mode": out.mode_name}
        protos = {"encoder": rnnt_encoder_graph(model, params, mean, inv_std, chunk, common),
                  "decoder": decoder_graph(model, params, CONTEXT_SIZE,
                                           {**common, "context_size": str(CONTEXT_SIZE)}),
                  "joiner": joiner_graph(model, params, common)}
        text = transducer_tokens(tokens["symbols"], tokens["kind"])
    else:
        protos = {"model": ctc_graph(model, params, mean, inv_std, chunk, props)}
        text = sherpa_tokens(tokens["symbols"], tokens["kind"])
    done = {**save(protos, out_dir, text), "chunk": chunk, "lookahead": ahead}
    done["code"] = sherpa_code(done, options, chunk + ahead)
    return done


def sherpa_code(files, options, frames):
    """The Python that runs the exported files in sherpa-onnx's online recognizer, which
    reads `frames` (T: the chunk and its lookahead) a call."""
    feat = ", ".join(f"{k}={v!r}" for k, v in options.items())
    rate = options["sampling_rate"]
    if "encoder" in files:
        model = f"""transducer=OnlineTransducerModelConfig(
            encoder={files['encoder']!r},
            decoder={files['decoder']!r},
            joiner={files['joiner']!r}),
        model_type="lstm","""
    else:
        model = f"""zipformer2_ctc=OnlineZipformer2CtcModelConfig(
            model={files['model']!r}),"""
    tail = (frames + 1) * rate * FRAME_MS // 1000
    return f"""import numpy as np
from sherpa_onnx.lib._sherpa_onnx import (   # the classes that take the whole config
    FeatureExtractorConfig, OnlineModelConfig, OnlineRecognizer, OnlineRecognizerConfig,
    OnlineTransducerModelConfig, OnlineZipformer2CtcModelConfig)
config = OnlineRecognizerConfig(
    feat_config=FeatureExtractorConfig({feat}),
    model_config=OnlineModelConfig(
        {model}
        tokens={files['tokens']!r}, num_threads=1),
    enable_endpoint=False, decoding_method="greedy_search")
recognizer = OnlineRecognizer(config)
# per utterance: float samples in [-1, 1] at {rate} Hz, as they arrive
#   s = recognizer.create_stream()
#   for piece in pieces:                       # e.g. 0.32 s each
#       s.accept_waveform({rate}, piece)
#       while recognizer.is_ready(s): recognizer.decode_stream(s)
#       print(recognizer.get_result(s))         # the text so far
#   s.accept_waveform({rate}, np.zeros({tail}, np.float32))   # tail padding: the last chunk
#   s.input_finished()
#   while recognizer.is_ready(s): recognizer.decode_stream(s)
#   print(recognizer.get_result(s))
"""
