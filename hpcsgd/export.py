"""`hpcsgd export`: a model's weights as integers with their scales, for integer inference;
or a CTC or RNN-T model as ONNX, for recognizers outside hpcsgd (hpcsgd/export_onnx.py,
hpcsgd/export_onnx_rnnt.py; a causal model for sherpa-onnx's online recognizer:
hpcsgd/export_onnx_streaming.py; docs/export.md).

    hpcsgd export RUN_DIR|CHECKPOINT --int8|--int4 --out MODEL.h5
    hpcsgd eval MODEL.h5 --data ARCHIVE          (and infer: the integer weights)
    hpcsgd export RUN_DIR|CHECKPOINT --onnx OUT_DIR [--cmvn global|utterance] [--stats ARCHIVE]
    hpcsgd export RUN_DIR|CHECKPOINT --onnx OUT_DIR --streaming [--chunk-ms MS] [--stats ARCHIVE]

Every weight matrix W is written as its grid's integer codes k (int8; --int4: two's-complement
nibbles packed two per byte, the first value in the low nibble) and its step s, so that
s * k is, bit for bit, the fake-quantized weight the quantization-aware model trained with
(model/quantize.py). Biases and learned clip values stay float32. A model trained without
quantized weights is quantized after training with the MAX rule at the export's width (said
on the console). Evaluation and inference load s * k as float32 and run the model's float32
GEMMs on them (dequantize, then GEMM: NumPy has no integer BLAS), with the activations
quantized as in training: the outputs equal the fake-quantized model's exactly.

File: attrs format = "hpcsgd-int", bits, meta (the checkpoint's meta, the model's qat
description completed); datasets int/<W> (codes), with attrs step and shape (a model with a
clip value per output unit: step/<W>, the step of each column, instead of the attribute);
float/<name>. hpcsgd/model_io.py reads it (eval, infer, decode, train.init_from).
"""
import copy
import json
import os

import h5py
import numpy as np

from hpcsgd import export_onnx, export_onnx_int, export_onnx_rnnt, export_onnx_streaming
from hpcsgd.data import archive
from hpcsgd.data import cmvn as norm
from hpcsgd.errors import UserError
from hpcsgd.model import build
from hpcsgd.model.encoder import time_stride
from hpcsgd.model.quantize import codes_of
from hpcsgd.model_io import FORMAT, load_model, pack_int4

EXAMPLES = """examples:
  hpcsgd export runs/qat4 --int4 --out runs/qat4/model_int4.h5
  hpcsgd eval runs/qat4/model_int4.h5 --data runs/demo/archive/cv
  hpcsgd export runs/demo/ctc --onnx runs/demo/ctc_onnx     (then the sherpa-onnx call it prints)
  hpcsgd export runs/demo/lstm_ctc --onnx runs/demo/lstm_ctc_online --streaming   (online)"""


def add_arguments(parser):
    parser.add_argument("model", help="run directory (latest checkpoint) or checkpoint file")
    width = parser.add_mutually_exclusive_group(required=True)
    width.add_argument("--int8", action="store_const", const=8, dest="bits",
                       help="8-bit codes (int8)")
    width.add_argument("--int4", action="store_const", const=4, dest="bits",
                       help="4-bit codes, two per byte")
    width.add_argument("--onnx", metavar="OUT_DIR",
                       help="a CTC model as OUT_DIR/model.onnx, an RNN-T model as "
                            "OUT_DIR/{encoder,decoder,joiner}.onnx, and tokens.txt for "
                            "sherpa-onnx (float32, or a quantization-aware model's "
                            "INT8/INT4 integer graph; the normalisation inside: --cmvn; "
                            "docs/export.md)")
    parser.add_argument("--out", help="the exported model (HDF5; --int8 and --int4)")
    parser.add_argument("--stats", metavar="ARCHIVE",
                        help="--onnx: the archive whose feature options the recognizer must "
                             "use and, unless the model trained with data.cmvn_scope global "
                             "(its statistics are in the checkpoint), whose speakers' CMVN "
                             "statistics, summed, normalise every utterance (default: the "
                             "run's data.train)")
    parser.add_argument("--onnx-int8", action="store_true",
                        help="--onnx of a quantization-aware model with weights of 4 bits or "
                             "fewer: their codes as int8 QDQ (onnxruntime's integer GEMM) "
                             "instead of int4 (smaller, slower; docs/export.md)")
    parser.add_argument("--cmvn", choices=("global", "utterance"), default=None,
                        help="--onnx: normalise with the training archive's summed "
                             "statistics, or each utterance with its own (default: as the "
                             "model trained, data.cmvn_scope; global for speaker; "
                             "docs/export.md: what each costs)")
    parser.add_argument("--streaming", action="store_true",
                        help="--onnx: a causal model (stack, lstm, dense, conv F k1) for "
                             "sherpa-onnx's online recognizer: graphs with the LSTM states in "
                             "and out, the global CMVN (train it with data.cmvn_scope=global; "
                             "docs/export.md)")
    parser.add_argument("--chunk-ms", type=float, default=None, metavar="MS",
                        help="--streaming: the frames sherpa-onnx feeds per encoder call, in "
                             "ms: a multiple of 10 ms x the encoder's stride (default: the "
                             "most such within 320 ms)")


def export(path, out, bits, say=print):
    """Write the integer model of the checkpoint (or run directory) at `path` to `out`;
    returns {"weights": bytes of the weights as integers, "float32": as float32, "file":
    bytes of the file}."""
    model, params, meta = load_model(path)
    qat = dict(model.describe.get("qat") or {})
    if qat.get("weights", "none") == "none":
        say(f"{meta['path']}: weights not trained quantized: quantized now with the MAX rule "
            f"at {bits} bits (post-training)")
        qat.update(weights="max", weight_bits=bits)
    if qat["weight_bits"] > bits:
        raise UserError(f"{meta['path']}: trained with {qat['weight_bits']}-bit weights; "
                        f"--int{bits} cannot hold their codes")
    describe = {**model.describe, "qat": qat}
    quantized = build(describe, max_batch=8)
    source = quantized.new_params()
    for name in source.views:
        if name in params.views:
            source[name][...] = params[name]
        elif name.startswith("clip_"):   # a learned clip the float model had no value for
            raise UserError(f"{meta['path']}: no {name}")
    quantized.quant.quantize_weights(source, quantized.wq, quantized.ops)
    meta = copy.deepcopy({k: v for k, v in meta.items() if k != "path"})
    meta["model"] = describe
    weights = set(quantized.quant.weights)
    sizes = {"weights": 0, "float32": 0}
    tmp = out + ".tmp"
    with h5py.File(tmp, "w") as f:
        f.attrs["format"], f.attrs["bits"], f.attrs["meta"] = FORMAT, bits, json.dumps(meta)
        for spec in quantized.specs:
            name = spec.name
            if name in weights:
                grid = quantized.quant.w_grids[name]
                codes = codes_of(quantized.wq[name], grid)
                data = pack_int4(codes) if bits == 4 else codes
                d = f.create_dataset(f"int/{name}", data=data)
                d.attrs["shape"] = list(spec.shape)
                if np.ndim(grid.step):   # a step per output unit (qat.weight_scale=channel)
                    f.create_dataset(f"step/{name}", data=np.asarray(grid.step, np.float32))
                    sizes["weights"] += 4 * np.size(grid.step)
                else:
                    d.attrs["step"] = float(grid.step)
                sizes["weights"] += data.nbytes
                sizes["float32"] += codes.size * 4
            else:
                f.create_dataset(f"float/{name}", data=source[name])
    os.replace(tmp, out)   # nothing half-written under the final name
    sizes["file"] = os.path.getsize(out)
    return sizes


def run(args):
    if args.onnx:
        return run_onnx(args)
    given = [flag for flag, value in (("--stats", args.stats), ("--cmvn", args.cmvn),
                                      ("--onnx-int8", args.onnx_int8),
                                      ("--streaming", args.streaming),
                                      ("--chunk-ms", args.chunk_ms is not None)) if value]
    if given:
        raise UserError(f"{', '.join(given)}: for --onnx only (the integer export keeps "
                        f"hpcsgd's CMVN)")
    if not args.out:
        raise UserError(f"--int{args.bits}: name the exported file with --out MODEL.h5")
    if not args.out.endswith((".h5", ".hdf5")):
        raise UserError(f"--out {args.out}: expected an .h5 file name")
    sizes = export(args.model, args.out, args.bits)
    print(f"wrote {args.out}: weights {sizes['weights']:,} bytes as int{args.bits} "
          f"({sizes['float32'] / max(sizes['weights'], 1):.1f}x smaller than float32's "
          f"{sizes['float32']:,}); file {sizes['file']:,} bytes")
    return 0


def write_onnx(path, out_dir, stats=None, cmvn=None, int8=False, streaming=False,
           chunk_ms=None):
    """Write OUT_DIR/model.onnx and tokens.txt for the CTC model at `path` (run directory or
    checkpoint); for an RNN-T model encoder.onnx, decoder.onnx, joiner.onnx and tokens.txt
    (export_onnx_rnnt.write). cmvn "global": normalised with the training archive's statistics
    summed over its speakers (those the checkpoint keeps when it trained with them,
    data.cmvn_scope global; else those of the archive `stats`, default the run's training
    archive); "utterance": each utterance with its own (the archive then gives only the
    feature options); None: as the model trained (speaker scope: global). int8: a
    quantization-aware model's weights of 4 bits or fewer as int8 codes behind
    DequantizeLinear (onnxruntime's integer GEMM) instead of int4 codes
    (export_onnx_int.py). streaming: graphs with the LSTM states in and out for sherpa-onnx's
    online recognizer, chunks of chunk_ms (export_onnx_streaming.write). Returns {"model"
    (RNN-T: "encoder", "decoder", "joiner"), "tokens", "options", "code", "cmvn",
    "quantization"} (streaming: and "chunk", in frames)."""
    if cmvn is not None and cmvn not in export_onnx.CMVN_CHOICES:
        raise UserError(f"--cmvn {cmvn!r}: expected one of {', '.join(export_onnx.CMVN_CHOICES)}")
    try:
        import onnx
    except ImportError:
        raise UserError("--onnx needs the onnx package (pip install onnx; the test extra "
                        "has it)") from None
    if not os.path.exists(path):
        raise UserError(f"{path}: no such run directory or checkpoint")
    model, params, meta = load_model(path, max_batch=8)
    kind, scope, trained_stats = norm.spec(meta["data"])   # how the model trained
    if cmvn is None:
        cmvn = "utterance" if scope == "utterance" and not streaming else "global"
    why = export_onnx.unsupported(model, meta["path"], streaming)
    if streaming:   # hpcsgd/export_onnx_streaming.py
        why = why or export_onnx_streaming.not_causal(model, meta["path"])
        if not why and model.quant:
            why = (f"{meta['path']}: --streaming: a quantization-aware model; the streaming "
                   f"graphs are float32 (export it without --streaming for its integer graph)")
        if not why and cmvn == "utterance":
            why = ("--cmvn utterance with --streaming: a stream has no utterance statistics "
                   "before its end; the streaming graph normalises with --cmvn global")
    g = None
    if model.quant and not why:   # quantization-aware: its integer graph
        why = export_onnx_int.refusal(model, meta["path"])
        g = None if why else export_onnx_int.IntGraph(model, params, int4=not int8)
    if why:
        raise UserError(why)
    if int8 and not model.quant:
        raise UserError(f"{meta['path']}: --onnx-int8: a float model (no quantization-aware "
                        f"training): its graph is float32")
    if chunk_ms is not None and not streaming:
        raise UserError("--chunk-ms: for --streaming only (the offline graph takes whole "
                        "utterances)")
    chunk = export_onnx_streaming.chunk_frames(model, chunk_ms) if streaming else None
    tokens = meta.get("tokens") or {}
    if len(tokens.get("symbols") or ()) != model.num_labels:
        raise UserError(f"{meta['path']}: no token inventory of {model.num_labels} symbols in "
                        f"the checkpoint's meta")
    if not stats:
        stats = meta["config"]["data.train"]
        if not os.path.isdir(stats):
            raise UserError(f"{meta['path']}: its training archive {stats} (data.train, "
                            f"relative to where it trained) is not there: name the archive "
                            f"for the statistics and feature options with --stats")
    index = archive.read_index(stats)
    extractor = json.loads(index["extractor_config"])
    if index["feature_dim"] != model.input_dim:
        raise UserError(f"--stats {stats}: {index['feature_dim']}-dim features, the model "
                        f"reads {model.input_dim}")
    options = export_onnx.feature_options(extractor)
    utterance = kind if cmvn == "utterance" and kind != "none" else None
    if trained_stats is not None:   # the statistics it trained with, kept in the checkpoint
        shift, inv_std = norm.global_shift_scale(trained_stats, kind)
        mean = -shift
        source = f"the checkpoint's (data.cmvn_scope global, {int(trained_stats[0, -1])} frames)"
    else:
        mean, inv_std, speakers, frames = export_onnx.global_cmvn(stats, kind)
        source = f"{os.path.abspath(stats)}: {speakers} speakers, {frames} frames"
    how = (f"each utterance's own {kind} statistics" if utterance else
           f"global {kind} statistics of {source}")
    how += f"; trained with data.cmvn_scope {scope}"
    # an integer graph's line counts what it holds: written once it is built (below, and
    # export_onnx_rnnt.write for each RNN-T file)
    quantization = "none: float32"
    props = {"model_author": "hpcsgd", "vocab_size": str(model.num_labels), "blank_id": "0",
             "subsampling_factor": str(time_stride(model.describe["encoder"])),
             "encoder": ", ".join(model.describe["encoder"]), "token_kind": tokens["kind"],
             "cmvn": how,
             "extractor_config": json.dumps(extractor, sort_keys=True),
             "sherpa_feat_config": json.dumps(options, sort_keys=True),
             "checkpoint": os.path.abspath(meta["path"]), "quantization": quantization}
    if streaming:
        done = export_onnx_streaming.write(model, params, out_dir, mean, inv_std, chunk, props,
                                           options, tokens)
        return {**done, "options": options, "cmvn": how, "quantization": quantization}
    if model.describe["type"] == "rnnt":   # three graphs (hpcsgd/export_onnx_rnnt.py)
        # a QAT model: the encoder and decoder each in a fresh IntGraph, on its weights' grids
        graph = (lambda: export_onnx_int.IntGraph(model, params, int4=not int8)) if g else None
        done = export_onnx_rnnt.write(model, model.wq if g else params, out_dir,
                                      (mean, inv_std, utterance), props, options, tokens, graph)
        return {**done, "options": options, "cmvn": how}
    # an integer graph reads the fake-quantized weights where it keeps a float op (an LSTM)
    proto = export_onnx.graph(model, model.wq if g else params, mean, inv_std, utterance, g=g)
    if g:   # its counts, now that the graph is built
        quantization = props["quantization"] = export_onnx_int.describe(g, model.quant)
    # sherpa-onnx's generic CTC loader picks the zipformer CTC conventions by model_type
    onnx.helper.set_model_props(proto, {"model_type": "zipformer2_ctc", **props})
    done = export_onnx.save({"model": proto}, out_dir, export_onnx.sherpa_tokens(tokens["symbols"], tokens["kind"]))
    return {**done, "options": options, "code": export_onnx.sherpa_code(out_dir, options), "cmvn": how,
            "quantization": quantization}


def run_onnx(args):
    if args.out:
        raise UserError("--onnx OUT_DIR names the output; --out is for --int8 and --int4")
    done = write_onnx(args.model, args.onnx, args.stats, args.cmvn,
                      int8=args.onnx_int8, streaming=args.streaming, chunk_ms=args.chunk_ms)
    graphs = ", ".join(done[k] for k in ("model", "encoder", "decoder", "joiner") if k in done)
    print(f"wrote {graphs} and {done['tokens']} (normalised with {done['cmvn']}; "
          f"quantization: {done['quantization']})")
    if "chunk" in done:
        ahead = (f", each read with the {done['lookahead']} frames after it "
                 f"({done['lookahead'] * 10} ms of lookahead)" if done["lookahead"] else "")
        print(f"streaming: chunks of {done['chunk']} frames ({done['chunk'] * 10} ms){ahead}, "
              f"the LSTM states carried from chunk to chunk")
    print("sherpa-onnx, with hpcsgd's fbank options (dither 0, snip_edges, Kaldi's povey "
          "window, int16-range samples):\n")
    print(done["code"])
    return 0
