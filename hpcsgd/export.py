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

from hpcsgd.errors import UserError
from hpcsgd.model import build
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
                            "sherpa-onnx (float32, or a quantization-aware CTC model's "
                            "INT8/INT4 integer graph; the normalisation inside: --cmvn; "
                            "docs/export.md)")
    parser.add_argument("--out", help="the exported model (HDF5; --int8 and --int4)")
    parser.add_argument("--stats", metavar="ARCHIVE",
                        help="--onnx: the archive whose speakers' CMVN statistics, summed, "
                             "normalise every utterance, and whose feature options the "
                             "recognizer must use (default: the run's data.train)")
    parser.add_argument("--onnx-int8", action="store_true",
                        help="--onnx of a quantization-aware model with weights of 4 bits or "
                             "fewer: their codes as int8 QDQ (onnxruntime's integer GEMM) "
                             "instead of MatMulNBits (smaller, slower; docs/export.md)")
    parser.add_argument("--cmvn", choices=("global", "utterance"), default=None,
                        help="--onnx: normalise with the summed statistics of --stats "
                             "(default), or each utterance with its own (docs/export.md: "
                             "what each costs against training's per-speaker CMVN)")
    parser.add_argument("--streaming", action="store_true",
                        help="--onnx: a causal model (stack, lstm, dense, conv F k1) for "
                             "sherpa-onnx's online recognizer: graphs with the LSTM states in "
                             "and out, global CMVN (docs/export.md)")
    parser.add_argument("--chunk-ms", type=float, default=None, metavar="MS",
                        help="--streaming: the frames sherpa-onnx feeds per encoder call, in "
                             "ms: a multiple of 10 ms x the encoder's stride (default: 320 "
                             "ms rounded up to one)")


def codes_of(wq, grid):
    """The integer codes of fake-quantized weights wq = s * k (exact: |k| <= 127, so the
    rounding of wq * (1/s) is far below 1/2), checked against wq."""
    k = np.rint(wq * grid.inv)
    if not np.array_equal((k.astype(wq.dtype) * grid.step).astype(wq.dtype), wq):
        raise RuntimeError("fake-quantized weights are not on their grid")
    return k.astype(np.int8)


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


def run_onnx(args):
    from hpcsgd import export_onnx
    if args.out:
        raise UserError("--onnx OUT_DIR names the output; --out is for --int8 and --int4")
    done = export_onnx.export(args.model, args.onnx, args.stats, args.cmvn or "global",
                              int8=args.onnx_int8, streaming=args.streaming,
                              chunk_ms=args.chunk_ms)
    graphs = ", ".join(done[k] for k in ("model", "encoder", "decoder", "joiner") if k in done)
    print(f"wrote {graphs} and {done['tokens']} (normalised with {done['cmvn']}; "
          f"quantization: {done['quantization']})")
    if "chunk" in done:
        print(f"streaming: chunks of {done['chunk']} frames ({done['chunk'] * 10} ms), the "
              f"LSTM states carried from chunk to chunk")
    print("sherpa-onnx, with hpcsgd's fbank options (dither 0, snip_edges, Kaldi's povey "
          "window, int16-range samples):\n")
    print(done["code"])
    return 0
