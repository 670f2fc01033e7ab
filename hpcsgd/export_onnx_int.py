"""`hpcsgd export RUN --onnx OUT_DIR` of a quantization-aware CTC model (docs/qat.md; an
RNN-T's encoder and decoder graphs too: hpcsgd/export_onnx_rnnt.py): the
graph of hpcsgd/export_onnx.py with the grids the model trained on, as integers that
onnxruntime's CPU provider runs as integer GEMMs. Which form follows from the run's qat
description (no option: the graph is the model that was trained):

  qat.weight_bits 5..8  INT8: every quantized weight matrix as int8 codes k and its step s
                        (one, or one per output unit) behind a DequantizeLinear; every
                        quantized GEMM input as Mul(1/s), Clip(klo, khi), QuantizeLinear
                        (scale 1, int8) and DequantizeLinear (scale s). onnxruntime's QDQ
                        transformer fuses DequantizeLinear x2 -> MatMul into
                        MatMulIntegerToFloat (int8 x int8 -> int32, then the scales);
                        a Conv whose output is not quantized (hpcsgd quantizes it only after
                        its bias, ReLU and mask, as the next GEMM's input) stays a float Conv
                        on the dequantized input and the constant s * k (Cast and Mul of the
                        codes, folded at load: a DequantizeLinear weight would be kept for
                        the QDQ fusions, dequantized at every call, and miss the float Conv's
                        NCHWc kernels: so762's Conformer's ten Convs 1.57 ms, not 1.18).
  qat.weight_bits 2..4  INT4: every quantized weight (MatMul and Conv) as ONNX int4 codes k
                        (two per byte, the first in the low nibble), Cast to float32 (exact)
                        and multiplied by hpcsgd's step (one, or one float32 per output unit):
                        s * k in float32, hpcsgd's fake-quantized weight bit for bit. The graph
                        is opset 21 (IR 10: the first with 4-bit tensors). All constant:
                        onnxruntime (1.32, and sherpa-onnx's bundled 1.28.2) folds it into a
                        float32 weight when it loads the graph, and runs float MatMuls and
                        Convs. Not a DequantizeLinear: onnxruntime keeps those unfolded for its
                        QDQ fusions (the weights dequantized at every run: RTF 0.0058 against
                        0.0041 on so762's Conformer), and fuses a DequantizeLinear(int4) ->
                        MatMul into MatMulNBits at the session's default accuracy_level 4, its
                        inputs requantized to int8 per block: not hpcsgd's arithmetic (and
                        sherpa-onnx does not set that option). Not MatMulNBits either: one
                        float32 scale per block of 16..256 weights (K padded to whole blocks)
                        where hpcsgd has one a unit: 100 bytes a column of K=144 against 76.
                        The GEMM inputs: the same int8 Q/DQ pair (a Conv's after the
                        Transpose or Unsqueeze in front of it: onnxruntime's QDQ propagation
                        through those writes an invalid opset-21 QuantizeLinear).
                        --onnx-int8: the INT8 form instead (the codes in int8: the integer
                        GEMM's speed, the INT8 file's size).

Why Mul(1/s) then QuantizeLinear with scale 1: hpcsgd rounds x * inv (inv = float32(1/s),
kernels_quant.fake_quant), QuantizeLinear divides by its scale; the quotients differ in the
last bit now and then, and at a half-way point that moves the code by one. With the product
computed by Mul and QuantizeLinear's scale 1 (x / 1 exact, round half to even as np.rint)
the codes are hpcsgd's bit for bit, whenever the input x is. The Clip to [klo, khi] in code
units is hpcsgd's clamp: QuantizeLinear's own saturation is to int8's [-128, 127], which
holds a symmetric 8-bit grid's [-127, 127] only with the clamp in front.

The grids, each mapped exactly (code k = q - zero_point, value s * k):
  symmetric (weights; signed inputs with max/fixed bounds): k in [-(2^(b-1) - 1), 2^(b-1) - 1],
      zero point 0
  one-signed [0, alpha] and a learned range [alpha_n, alpha_p] (affine_grid): 2^b codes
      k in [klo, klo + 2^b - 1], klo = rint(alpha_n / s); the zero point 0 when that fits
      int8, else -128 - klo. Not mappable: an 8-bit range that does not hold zero (klo > 0 or
      khi < 0 at 256 levels: no int8 zero point puts it in [-128, 127]); refused, named.
Refused, named: dynamic input grids (qat.activations max or sawb: their step comes from the
batch's statistics, which a graph of fixed scales does not have); (B)LSTM layers with
quantized activations (ONNX's LSTM has no integer form, and its recurrent input h_{t-1}
cannot be quantized at every step inside it). LSTMs with quantized weights and float inputs
run ONNX's float LSTM on the dequantized weights s * k (exact); at INT8 a GEMM with a float
input dequantizes its weights' int8 codes by Cast and Mul (matmul: onnxruntime would rewrite
DequantizeLinear -> MatMul as an int8-activation MatMulNBits), as INT4 does every weight's.
The Conformer's attention products (Q K^T, P V) stay float, as in training.
"""
import numpy as np

from hpcsgd.errors import UserError
from hpcsgd.export_onnx import Graph
from hpcsgd.model.lstm import LSTM
from hpcsgd.model.quantize import affine_grid, codes_of, symmetric_grid

INT4_OPSET = 21      # int4 tensors (Cast from int4)
INT4_IR_VERSION = 10  # the IR that has them


def refusal(model, meta_path):
    """Why this quantization-aware model has no exact integer graph (None: it has one)."""
    quant = model.quant
    if quant.exported:
        return (f"{meta_path}: an integer model written by --int8/--int4: export the run "
                f"directory or checkpoint it came from (the grids are taken from its clips)")
    dynamic = sorted({r for r in quant.rules + [quant.inner_rule if quant.inner else "none"]
                      if r in ("max", "sawb")})
    if dynamic:
        return (f"{meta_path}: quantization-aware model with dynamic input grids "
                f"(qat.activations={quant.a_rule}: the step of each minibatch's statistics); an "
                f"ONNX graph has fixed scales: train with qat.activations=pact or bac")
    for text, layer in zip(model.describe["encoder"], model.layers):
        if isinstance(layer, LSTM) and quant.a_rule != "none":
            return (f"{meta_path}: encoder layer {text!r} with quantized activations: ONNX's "
                    f"LSTM has no integer form and cannot quantize h_(t-1) at each step "
                    f"(an LSTM with quantized weights and qat.activations=none is exported)")
    return None


def zero_point(grid, what):
    """The int8 zero point that holds the grid's codes [klo, khi] (0 where it fits)."""
    klo, khi = int(grid.klo), int(grid.khi)
    if -128 <= klo and khi <= 127:
        return 0
    zp = -128 - klo   # the codes from int8's lowest up
    if -128 <= zp <= 127 and khi + zp <= 127:
        return zp
    raise UserError(f"{what}: its grid's range [{float(grid.lo):g}, {float(grid.hi):g}] (codes "
                    f"[{klo}, {khi}], step {float(grid.step):g}) holds no zero: no int8 zero "
                    f"point puts its codes in [-128, 127]")


class IntGraph(Graph):
    """The graph of a quantization-aware model: its quantized weights as integer codes, its
    quantized GEMM inputs through Q/DQ (the module docstring)."""

    def __init__(self, model, params, int4=True):
        """int4 False: weights of 4 bits or fewer as int8 codes too (the INT8 form)."""
        super().__init__()
        quant = model.quant
        quant.quantize_weights(params, model.wq, model.ops)
        self.int4 = int4 and quant.w_rule != "none" and quant.w_bits <= 4
        if self.int4:
            self.opset, self.ir_version = INT4_OPSET, INT4_IR_VERSION
        self.codes = {}   # weight name -> (int8 codes (K, N), step: scalar or per column)
        if quant.w_rule != "none":
            for w in quant.weights:
                grid = quant.w_grids[w]
                self.codes[w] = (codes_of(np.asarray(model.wq[w]), grid),
                                 np.asarray(grid.step, np.float32))
        self.grids = {}   # GEMM input key -> grid
        for i in range(len(model.layers)):
            grid = quant.input_grid(i, None, params, model.ops)   # pact or fixed: no x read
            if grid is not None:
                self.grids[i] = grid
        for name in quant.inner:   # learned ranges (qat.activations pact, or bac: pact there)
            lo, hi = quant._clips(params, f"clip_{name}")
            self.grids[name] = affine_grid(lo, hi, quant.a_bits, quant.dtype)
        # an RNN-T's prediction network (model/transducer.py): each LSTM's input above the
        # first ("pred.lstm.k") and its h_(t-1) ("pred.lstm.k.h") on the fixed grid of [-1, 1]
        out = model.layers[-1]
        for k, layer in enumerate(getattr(out, "pred", ())):
            if k and out.input_bits:
                self.grids[layer.W[:-2]] = symmetric_grid(1.0, out.input_bits, quant.dtype)
            if layer.hidden_grid is not None:
                self.grids[layer.W[:-2] + ".h"] = layer.hidden_grid
        self.zero_points = {key: zero_point(grid, f"the input of layer {key}"
                                            if isinstance(key, int) else f"GEMM input {key}")
                            for key, grid in self.grids.items()}
        self.counts = {"weights_int8": 0, "weights_int4": 0, "inputs": 0}
        self.on_grid = set()   # the values gemm_input quantized

    def gemm_input(self, x, key):
        """x on the grid of the GEMM input `key`: s * clip(rint(x * inv), klo, khi), the
        codes in int8 between QuantizeLinear and DequantizeLinear."""
        grid = self.grids.get(key)
        if grid is None:
            return x
        self.counts["inputs"] += 1
        zp = self.const(np.int8(self.zero_points[key]), "zp")
        k = self.op("Clip", [self.op("Mul", [x, self.const(np.float32(grid.inv), "inv")]),
                             self.const(np.float32(grid.klo)), self.const(np.float32(grid.khi))])
        q = self.op("QuantizeLinear", [k, self.const(np.float32(1.0)), zp], hint="codes")
        out = self.op("DequantizeLinear", [q, self.const(np.float32(grid.step), "step"), zp],
                      hint="quantized")
        self.on_grid.add(out)
        return out

    def weight(self, p, name, layout=None, axis=1):
        """A quantized weight as the constant s * k (codes_times_step): what a Conv reads
        (onnxruntime runs a Conv whose output is not quantized in float; folded at load, the
        weight gets its float kernels, NCHWc included, where a DequantizeLinear would be
        kept for the QDQ fusions and run at every call), an embedding's rows, a MatMul's
        float input's weight, and every weight at INT4."""
        if name not in self.codes:
            return super().weight(p, name, layout, axis)
        codes, step = self.codes[name]
        codes = np.ascontiguousarray(codes if layout is None else layout(codes), np.int8)
        self.counts["weights_int4" if self.int4 else "weights_int8"] += 1
        return codes_times_step(self, codes, step, name, axis, self.int4)

    def matmul(self, x, p, name):
        if name in self.codes and not self.int4 and x in self.on_grid:
            # INT8, an input on its grid: the codes behind a DequantizeLinear, which
            # onnxruntime's QDQ transformer fuses with x's into MatMulIntegerToFloat. With a
            # float input (qat.activations none; an RNN-T's embedding rows) `weight`'s s * k
            # instead: onnxruntime would rewrite DequantizeLinear -> MatMul as a MatMulNBits
            # that quantizes x to int8 (its default accuracy_level 4)
            codes, step = self.codes[name]
            self.counts["weights_int8"] += 1
            w = self.op("DequantizeLinear", [self.const(np.ascontiguousarray(codes, np.int8),
                                                        name + "_codes"),
                                             self.const(step, name + "_step"),
                                             self.const(np.zeros(step.shape, np.int8), "zp")],
                        hint=name, **({"axis": 1} if step.ndim else {}))
            return self.op("MatMul", [x, w])
        return super().matmul(x, p, name)


def codes_times_step(g, codes, step, name, axis=1, int4=True):
    """s * k in float32 in graph g: the codes k as an int4 initializer (or int8), Cast to
    float32 (exact) and multiplied by the step s (a scalar, or one per index of `axis`): the
    same float32 product as hpcsgd's fake-quantized weight. All constant: onnxruntime folds it
    into a float32 weight when it loads the graph (the module docstring)."""
    if int4:
        g.inits.append(int4_tensor(codes, g.name(name + "_int4")))
        k = g.inits[-1].name
    else:
        k = g.const(codes, name + "_codes")
    step = np.asarray(step, np.float32)
    if step.ndim:   # per unit along `axis`: broadcast over the other axes
        shape = [1] * codes.ndim
        shape[axis] = step.size
        step = step.reshape(shape)
    return g.op("Mul", [g.op("Cast", [k], to=1), g.const(step, name + "_step")], hint=name)


def int4_tensor(codes, name):
    """An ONNX int4 TensorProto of int8 codes in [-8, 7]: two's complement nibbles, two per
    byte, the first in the low nibble (the ONNX spec's packing), an odd count's last high
    nibble 0."""
    from onnx import TensorProto, helper
    if codes.size and (codes.min() < -8 or codes.max() > 7):
        raise UserError(f"weight codes in [{codes.min()}, {codes.max()}]: int4 holds [-8, 7]")
    flat = (codes.reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if flat.size % 2:
        flat = np.append(flat, np.uint8(0))
    packed = flat[0::2] | (flat[1::2] << 4)
    return helper.make_tensor(name, TensorProto.INT4, codes.shape, packed.tobytes(), raw=True)


def describe(g, quant):
    """One line for the model's metadata: what is integer in the graph (g built: its counts).
    The weights' codes as int4 tensors (INT4) or int8 tensors (INT8: behind a
    DequantizeLinear, or Cast and Mul before a float input)."""
    kind = (f"INT4 weights ({g.counts['weights_int4']} int4 tensors)"
            if g.int4 else f"INT8 weights ({g.counts['weights_int8']} int8 tensors)")
    return (f"{kind}; {g.counts['inputs']} GEMM inputs on {quant.a_bits}-bit grids through "
            f"QuantizeLinear/DequantizeLinear (qat {quant.qat})")
