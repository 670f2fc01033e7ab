"""Quantization-aware training (the IBM paper, ../shared/seeds/004_...): which tensor is fake-
quantized on which grid, and the straight-through backward. The kernels are
hpcsgd.model.kernels_quant (CPU) and hpcsgd.model.kernels_cuda (GPU ranks), through the
device's ops.

What is quantized (docs/qat.md):
  weights      every weight matrix (not the biases), on a symmetric grid of 2^b - 1 levels;
               the clip value alpha by rule:
                 max   alpha = max |W|
                 sawb  alpha = c1 sqrt(E[W^2]) - c2 E|W| (IBM's coefficients per bit width;
                       at most max |W|)
                 pact  a learned alpha (a "clip" parameter), gradient sum(dWq sign(W)) where
                       |W| >= alpha; the clipped weights get no gradient
               max and sawb pass the gradient straight through to every weight; with
               weight_scale "channel" they take one alpha per output unit (a column of W).
  activations  the input of every layer's GEMM(s), per layer input:
                 max / sawb  alpha from the minibatch's statistics (dynamic)
                 pact  a learned range [alpha_n, alpha_p] (a "clip" parameter)
                 bac   PACT on the first layer's input (and after a ReLU, which has no
                       bound); the fixed bounds of the activation below elsewhere: [0, 1]
                       after a sigmoid, [-1, 1] after an LSTM
               a signed input (features, LSTM outputs) gets the symmetric grid, a one-signed
               one (sigmoid, ReLU) the affine grid [0, alpha] of 2^b levels; a learned range
               the affine grid [alpha_n, alpha_p]. Gradient: straight through inside the
               range [lo, hi], zero outside; PACT's clip values get the sums outside.
  LSTM state   the hidden state h_{t-1} fed to the recurrent GEMM, at every step, on the
               fixed symmetric grid [-1, 1] (the paper's alpha_h = 1; |h| < 1, so its
               straight-through gradient is the identity); the cell state stays float.
  float parts  qat first_layer "float": the first layer's weights and input (the RNN-T
               recipe); a layer's float_weights and an input it marks unquantized (the
               transducer's joint: its encoder projection, predictor projection and output)
  inside       a layer's own sublayers (the RNN-T's prediction network) get the LSTM state's
               grid; a layer with input_bits quantizes its own GEMM inputs (model/transducer.py);
               a layer with gemm_inputs() (a Conformer block) has each of them quantized by the
               activation rule (bac: pact, none of them bounded), the quantizer's
               quantize_inner / inner_backward called from its passes (model/conformer.py)

Learned clip values are parameters: role "clip", exchange "float" (summed in float32 by every
exchange, never through a gradient codec), trained by the optimizer, checkpointed.
"""
from typing import NamedTuple

import numpy as np

from hpcsgd.device import assign, to_host
from hpcsgd.model.flat import ParamSpec
from hpcsgd.model.kernels_quant import ref_stats

WEIGHT_RULES = ("none", "max", "sawb", "pact")
WEIGHT_SCALES = ("tensor", "channel")   # one clip value per matrix, or per output unit
ACTIVATION_RULES = ("none", "max", "sawb", "pact", "bac")
# SAWB (Choi et al. 2018, IBM's published fit), alpha = c1 sqrt(E[w^2]) - c2 E|w| per bit
# width; 4 bits: the 15-level variant, as this grid has 2^b - 1 levels (+-7)
SAWB = {2: (3.12, 2.064), 3: (7.509, 6.892), 4: (12.035, 12.03), 8: (31.76, 35.04)}
MIN_STEP = 1e-12   # an all-zero tensor: any positive step quantizes it to zero


class Grid(NamedTuple):
    """The values step * k, k integer in [klo, khi]; (lo, hi) the clip range the
    straight-through gradient passes inside. Fields in the model's dtype."""
    lo: float
    hi: float
    step: float
    inv: float
    klo: float
    khi: float


def symmetric_grid(alpha, bits, dtype=np.float32):
    """+-(2^(b-1) - 1) levels of alpha / (2^(b-1) - 1): 2^b - 1 values, zero exact."""
    t = np.dtype(dtype).type
    levels = 2 ** (bits - 1) - 1
    step = t(max(float(alpha) / levels, MIN_STEP))
    a = t(alpha)
    return Grid(-a, a, step, t(1) / step, t(-levels), t(levels))


def channel_grid(alphas, bits, dtype=np.float32):
    """symmetric_grid per output unit: step, inv, lo and hi vectors (one per column of the
    weight matrix), the levels shared."""
    t = np.dtype(dtype).type
    levels = 2 ** (bits - 1) - 1
    a = np.asarray(alphas, np.float64)
    step = np.maximum(a / levels, MIN_STEP).astype(dtype)
    alpha = a.astype(dtype)
    return Grid(-alpha, alpha, step, (t(1) / step).astype(dtype), t(-levels), t(levels))


def affine_grid(lo, hi, bits, dtype=np.float32):
    """2^b values step * k, step = (hi - lo) / (2^b - 1), k from rint(lo / step): zero exact,
    the range [lo, hi] to within step / 2."""
    t = np.dtype(dtype).type
    lo, hi = float(lo), max(float(hi), float(lo))
    step = t(max((hi - lo) / (2 ** bits - 1), MIN_STEP))
    klo = float(np.rint(t(lo) / step))
    return Grid(t(lo), t(hi), step, t(1) / step, t(klo), t(klo + 2 ** bits - 1))


def codes_of(wq, grid):
    """The integer codes of fake-quantized weights wq = s * k (exact: |k| <= 127, so the
    rounding of wq * (1/s) is far below 1/2), checked against wq."""
    k = np.rint(wq * grid.inv)
    if not np.array_equal((k.astype(wq.dtype) * grid.step).astype(wq.dtype), wq):
        raise RuntimeError("fake-quantized weights are not on their grid")
    return k.astype(np.int8)


def sawb_alpha(mean_sq, mean_abs, max_abs, bits):
    """SAWB's clip value, kept in (0, max |x|]."""
    c1, c2 = SAWB[bits]
    alpha = c1 * np.sqrt(mean_sq) - c2 * mean_abs
    return float(min(max(alpha, MIN_STEP), max_abs)) if max_abs > 0 else 0.0


def sawb_alphas(mean_sq, mean_abs, max_abs, bits):
    """sawb_alpha per output unit (arrays)."""
    c1, c2 = SAWB[bits]
    alpha = np.minimum(np.maximum(c1 * np.sqrt(mean_sq) - c2 * mean_abs, MIN_STEP), max_abs)
    return np.where(max_abs > 0, alpha, 0.0)


def check(qat):
    """A model's qat description -> itself with defaults, or None when nothing is quantized.
    Raises ValueError naming the bad field."""
    if not qat:
        return None
    out = {"weights": "none", "weight_bits": 8, "activations": "none", "activation_bits": 8,
           "pact_init": 4.0, "clip_decay": 1e-4, "weight_scale": "tensor", **qat}
    if out["weight_scale"] not in WEIGHT_SCALES:
        raise ValueError(f"qat weight_scale {out['weight_scale']!r}: expected one of "
                         f"{WEIGHT_SCALES}")
    if out["weight_scale"] == "channel" and out["weights"] == "pact":
        raise ValueError("qat weights pact with weight_scale channel: a learned clip per "
                         "output unit is not built (use max or sawb per channel)")
    if out["weights"] not in WEIGHT_RULES:
        raise ValueError(f"qat weights {out['weights']!r}: expected one of {WEIGHT_RULES} "
                         f"(bac is a rule for bounded activations)")
    if out["activations"] not in ACTIVATION_RULES:
        raise ValueError(f"qat activations {out['activations']!r}: expected one of "
                         f"{ACTIVATION_RULES}")
    for what in ("weight", "activation"):
        bits = out[f"{what}_bits"]
        if not 2 <= int(bits) <= 8:
            raise ValueError(f"qat {what}_bits {bits}: expected 2..8")
        if out[what + "s"] == "sawb" and int(bits) not in SAWB:
            raise ValueError(f"qat {what}s sawb at {bits} bits: SAWB's coefficients are "
                             f"published for {sorted(SAWB)} bits only")
    if out["weights"] == "none" and out["activations"] == "none":
        return None
    return out


def input_rule(rule, i, bounds):
    """The rule of layer i's input whose range is `bounds` ((lo, hi), None for unknown)."""
    if rule != "bac":
        return rule
    bounded = bounds[0] is not None and bounds[1] is not None
    return "fixed" if i > 0 and bounded else "pact"


class Quantizer:
    """The fake quantization of one Network: built from its layers and qat description."""

    def __init__(self, layers, qat, dtype, device="cpu"):
        self.qat, self.dtype, self.device = qat, np.dtype(dtype), device
        self.w_rule, self.w_bits = qat["weights"], int(qat["weight_bits"])
        self.per_channel = qat.get("weight_scale", "tensor") == "channel"
        self.a_rule, self.a_bits = qat["activations"], int(qat["activation_bits"])
        self.clip_decay = float(qat["clip_decay"])
        self.exported = False   # integer weights loaded (hpcsgd/export.py): already on the grid
        # the range each layer's input can take: the features are signed and unbounded
        self.bounds = [(None, None)] + [getattr(layer, "output_range", (None, None))
                                        for layer in layers[:-1]]
        self.rules = [input_rule(self.a_rule, i, b) for i, b in enumerate(self.bounds)]
        # float layers: the first one where qat says so (the INT4 RNN-T recipe), and what a
        # layer keeps float itself (the transducer's joint: its input and projections)
        first_float = qat.get("first_layer") == "float"
        floats = {s.name for s in layers[0].specs()} if first_float else set()
        for i, layer in enumerate(layers):
            floats |= set(getattr(layer, "float_weights", ()))
            if (i == 0 and first_float) or not getattr(layer, "quantized_input", True):
                self.rules[i] = "none"
        # the inputs of GEMMs inside a layer (a Conformer block's: gemm_inputs()), each on
        # the activation rule's grid, named "{layer}.{key}"; bac is pact there (none of
        # them has fixed bounds: layer norms, swish, the attention's output)
        self.inner = {}
        self.inner_rule = "pact" if self.a_rule == "bac" else self.a_rule
        self.inner_grids = {}
        self.frames = 1.0   # the pass's frames x loss scale (Network.forward_backward sets it)
        for i, layer in enumerate(layers):
            if hasattr(layer, "gemm_inputs") and self.a_rule != "none" \
                    and not (i == 0 and first_float):
                layer.quant = self
                for key in layer.gemm_inputs():
                    self.inner[f"{layer.name}.{key}"] = layer
        self.weights = [s.name for layer in layers for s in layer.specs()
                        if s.role == "weight" and s.name not in floats]
        self.others = [s.name for layer in layers for s in layer.specs()
                       if s.role != "weight" or s.name in floats]
        self.others += [s.name for s in self.specs()]   # the learned clips
        self.grids = [None] * len(layers)   # the grid of each input in the last forward
        self.w_grids = {}
        init = float(qat["pact_init"])
        self.pact_init = [(lo if lo is not None else -init, hi if hi is not None else init)
                          for lo, hi in self.bounds]
        # the LSTM's hidden state: the fixed grid [-1, 1]
        hidden = symmetric_grid(1.0, self.a_bits, dtype) if self.a_rule != "none" else None
        for layer in layers + [sub for layer in layers for sub in getattr(layer, "sublayers",
                                                                         ())]:
            if getattr(layer, "recurrent", False):
                layer.hidden_grid = hidden
        for layer in layers:   # a layer that quantizes inputs inside it (the predictor's)
            if hasattr(layer, "input_bits"):
                layer.input_bits = self.a_bits if self.a_rule != "none" else None

    # ---- the clip parameters ---------------------------------------------------------------

    def specs(self):
        out = []
        if self.w_rule == "pact":
            out += [ParamSpec(f"clip_{w}", (1, 1), "clip", "float") for w in self.weights]
        out += [ParamSpec(f"clip_in{i}", (1, 2), "clip", "float")
                for i, rule in enumerate(self.rules) if rule == "pact"]
        if self.inner_rule == "pact":
            out += [ParamSpec(f"clip_{name}", (1, 2), "clip", "float") for name in self.inner]
        return out

    def init(self, views):
        """Learned clip values' start (host views): a weight's SAWB alpha at its bit width
        (MAX's where SAWB has no coefficients), so that the clipped weights give the clip a
        gradient from the first step; an input's bounds, or +-qat.pact_init where it has
        none."""
        if self.w_rule == "pact":
            for w in self.weights:
                mx, msq, mab = ref_stats(views[w])
                alpha = sawb_alpha(msq, mab, mx, self.w_bits) if self.w_bits in SAWB else mx
                views[f"clip_{w}"][0, 0] = alpha
        for i, rule in enumerate(self.rules):
            if rule == "pact":
                views[f"clip_in{i}"][0, :] = self.pact_init[i]
        if self.inner_rule == "pact":
            init = float(self.qat["pact_init"])
            for name in self.inner:
                views[f"clip_{name}"][0, :] = (-init, init)

    def learns_input(self, i):
        return self.rules[i] == "pact"

    def _clips(self, params, name):
        return to_host(params[name])[0].astype(np.float64)

    # ---- weights ---------------------------------------------------------------------------

    def quantize_weights(self, params, wq, ops):
        """wq <- params with every weight matrix fake-quantized (biases and clips copied)."""
        if self.exported or self.w_rule == "none":
            assign(wq.flat, params.flat)
            return
        for name in self.others:   # small: one pass over the weights is the kernel's
            assign(wq[name], params[name])
        for w in self.weights:
            W = params[w]
            if self.per_channel:   # a clip value per output unit (a column of W)
                mx, msq, mab = ops.column_abs_stats(W)
                alphas = mx if self.w_rule == "max" else sawb_alphas(msq, mab, mx, self.w_bits)
                grid = self.w_grids[w] = channel_grid(alphas, self.w_bits, self.dtype)
                ops.fake_quant(W, wq[w], grid)
                continue
            if self.w_rule == "pact":
                alpha = max(self._clips(params, f"clip_{w}")[0], MIN_STEP)
            else:
                mx, msq, mab = ops.abs_stats(W)
                alpha = mx if self.w_rule == "max" else sawb_alpha(msq, mab, mx, self.w_bits)
            grid = self.w_grids[w] = symmetric_grid(alpha, self.w_bits, self.dtype)
            ops.fake_quant(W, wq[w], grid)

    def weights_backward(self, params, grads, ops, frames):
        """PACT weights: no gradient for the clipped weights, and their clip value's, with
        qat.clip_decay's L2 pull (per sample: `frames` = frames x loss scale)."""
        if self.w_rule != "pact" or self.exported:
            return
        for w in self.weights:
            grid, name = self.w_grids[w], f"clip_{w}"
            d_lo, d_hi = ops.fake_quant_backward(params[w], grads[w], grid.lo, grid.hi)
            alpha = self._clips(params, name)
            set_row(grads[name], [d_hi - d_lo + self.clip_decay * frames * alpha[0]])

    # ---- activations -----------------------------------------------------------------------

    def input_grid(self, i, x, params, ops):
        rule, bits = self.rules[i], self.a_bits
        if rule == "none":
            return None
        lo_bound, hi_bound = self.bounds[i]
        if rule == "fixed":
            if lo_bound < 0:
                return symmetric_grid(max(-lo_bound, hi_bound), bits, self.dtype)
            return affine_grid(lo_bound, hi_bound, bits, self.dtype)
        if rule == "pact":
            lo, hi = self._clips(params, f"clip_in{i}")
            return affine_grid(lo, hi, bits, self.dtype)
        mx, msq, mab = ops.abs_stats(x)
        alpha = mx if rule == "max" else sawb_alpha(msq, mab, mx, bits)
        if lo_bound is None or lo_bound < 0:
            return symmetric_grid(alpha, bits, self.dtype)
        return affine_grid(0.0, alpha, bits, self.dtype)

    def quantize_input(self, i, x, out, params, ops):
        """Layer i's input x fake-quantized into out (returned); x itself if not quantized."""
        grid = self.grids[i] = self.input_grid(i, x, params, ops)
        if grid is None:
            return x
        ops.fake_quant(x, out, grid)
        return out

    def input_backward(self, i, x, dx, params, grads, ops, frames):
        """dx (the gradient of the quantized input) <- that of x, straight through inside the
        range; a learned range gets the sums outside it, and qat.clip_decay's L2 pull."""
        grid = self.grids[i]
        # max: nothing is clipped; fixed: the activation cannot leave its bounds
        if grid is None or dx is None or self.rules[i] in ("max", "fixed"):
            return
        d_lo, d_hi = ops.fake_quant_backward(x, dx, grid.lo, grid.hi)
        if self.rules[i] == "pact":
            name = f"clip_in{i}"
            lo, hi = self._clips(params, name) * (self.clip_decay * frames)
            set_row(grads[name], [d_lo + lo, d_hi + hi])


    # ---- inputs of the GEMMs inside a layer (model/conformer.py) -------------------------

    def quantize_inner(self, name, x, out, params, ops):
        """The input `name` ("{layer}.{key}") of a GEMM inside a layer fake-quantized into
        out (returned): a dynamic symmetric grid (max, sawb) or the learned range (pact)."""
        if self.inner_rule == "pact":
            lo, hi = self._clips(params, f"clip_{name}")
            grid = affine_grid(lo, hi, self.a_bits, self.dtype)
        else:
            mx, msq, mab = ops.abs_stats(x)
            alpha = mx if self.inner_rule == "max" else sawb_alpha(msq, mab, mx, self.a_bits)
            grid = symmetric_grid(alpha, self.a_bits, self.dtype)
        self.inner_grids[name] = grid
        ops.fake_quant(x, out, grid)
        return out

    def inner_backward(self, name, x, dx, params, grads, ops):
        """dx (the gradient of the quantized input) <- that of its float input x, straight
        through inside the range; a learned range gets the sums outside it and
        qat.clip_decay's pull (as input_backward)."""
        if self.inner_rule == "max":   # nothing is clipped
            return
        grid = self.inner_grids[name]
        d_lo, d_hi = ops.fake_quant_backward(x, dx, grid.lo, grid.hi)
        if self.inner_rule == "pact":
            clip = f"clip_{name}"
            lo, hi = self._clips(params, clip) * (self.clip_decay * self.frames)
            set_row(grads[clip], [d_lo + lo, d_hi + hi])


def set_row(view, values):
    """view (1, n) <- values (host numbers; a GPU view gets a small copy)."""
    row = np.asarray(values, dtype=view.dtype).reshape(1, -1)
    if isinstance(view, np.ndarray):
        view[...] = row
    else:
        view.copy_to_device(row)
