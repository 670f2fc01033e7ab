"""A model: a stack of layers (hpcsgd.model.layers) on flat parameter buffers, with the
preallocated workspaces its forward and backward passes run in.

    net = dnn(440, [2048] * 7, 9304, "sigmoid", max_batch=1024)   # hpcsgd.model.dnn
    params, grads = net.new_params(), net.new_params()               # FlatParams of net.specs
    net.init(params, np.random.default_rng(seed))
    ce, correct = net.forward_backward(params, grads, x, y, n)     # grads overwritten

Workspaces: acts[i] (max_batch, n_out of layer i) holds layer i's output; backward writes the
layer's dz over it (fewer rows past a time stride when the batch's sequences are bounded:
max_sequences, model.lengths.strided_rows). delta (max_batch * the widest hidden input)
holds dLoss/dx of the layer being differentiated, read by the layer below before it writes
its own. Any n <= max_batch works on views of them; nothing is allocated per call but small
result scalars.

GPU ranks (device="cuda"): every buffer on the device; batches come from the host and are
copied into x_in / y_in; forward() copies its result back to the host.

precision="mixed" (docs/precision.md): training runs on w16, a float16 copy of the weights
made from the float32 master at the start of every forward_backward (so after every update,
fused or not), on the input rounded to float16 (x16), with every GEMM output and kernel
output rounded to float16 (model.ops.HalfOps); float16 values live in float32 buffers (the
GEMMs widen float16 operands to float32 anyway). The weight gradients are rounded to float16
and the loss scale taken off in float32 by unscale(). Inference (forward) uses the float32
master weights. precision="bf16": the same places rounded to bfloat16 instead (w16 and x16
then hold bfloat16 values; no loss scale: train.loss_scale=none).

GPU ranks with precision="mixed" store in float16 (`storage`): the activations, their
gradients (acts, delta), the recurrent layers' workspaces, w16 and x16 are float16 device
arrays, half the bytes; the GEMMs take float16 operands, accumulate in float32 and round once
to a float16 output, or to the float32 weight gradients (hpcsgd/device.py: matmul); the
kernels compute in float32 on float16 arrays. precision="bf16" stores the same buffers as
uint16 arrays holding bfloat16 bits (STORAGE), the same way (bfloat16 GEMM operands). The
same values as the emulation, up to the order of sums and CUDA's expf (docs/precision.md).
Master weights, optimizer state and the gradients (`grads`) stay float32. Inference (forward: cross-validation, eval) runs float32 on
the master weights as on CPU ranks, in float32 buffers of its own made at its first call
(training alone never makes them).

Dropout (set_dropout(p); model.dropout): a model of whole utterances drops each encoder
layer's output but frame stacking's (no parameters) before the layer above reads it, by masks
hashed from the batch's utterance keys (Targets.keys; model/kernels_dropout.py), into a
buffer of its own (dropped[i]): layer i's backward still reads its own output, layer i + 1's
reads the dropped one, and the backward pass multiplies the gradient by the same mask. A
layer that declares drops_inside (a Conformer block: its modules' outputs, model/conformer.py)
is handed p and the keys instead. Only forward_backward drops; forward (cross-validation,
eval, inference) never does.

qat (a model.quantize description): quantization-aware training. Every pass runs on wq, the
weights fake-quantized from the float32 master at its start, and on each layer's input
fake-quantized into aq[i]; backward passes the gradients straight through to the master and
the float inputs (model/quantize.py).
"""
import os

import numpy as np

from hpcsgd import half
from hpcsgd.device import assign, is_device, zeros
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model import quantize
from hpcsgd.model.flat import FlatParams, as_specs, matrices
from hpcsgd.model.lengths import Lengths, strided_rows
from hpcsgd.model.ops import GemmOnly, HalfOps, make_ops

PRECISIONS = ("float32", "mixed", "bf16")
# the 16-bit format each reduced precision stores its values in (hpcsgd/half.py: round_to)
ROUNDING = {"float32": None, "mixed": "float16", "bf16": "bfloat16"}
# the arrays GPU ranks store each 16-bit format in: float16, and uint16 holding bfloat16's
# bits (NumPy and Numba have no bfloat16 dtype; it is float32's upper half)
STORAGE = {"float16": np.float16, "bfloat16": np.uint16}
# GPU ranks under mixed store in float16 arrays; False: in float32 buffers holding float16
# values, as the CPU emulation does (tests/test_mixed_cuda.py compares the two bit for bit)
FLOAT16_STORAGE = True
# the same for bf16 (tests/test_bf16_cuda.py); HPCSGD_BF16_STORAGE=0 in a rank's environment
# makes it False there (a whole training run emulated, for that test's comparison)
BF16_STORAGE = os.environ.get("HPCSGD_BF16_STORAGE", "1") != "0"


def storage_dtype(precision, device, dtype=np.float32):
    """The dtype of a training pass's buffers: the 16-bit format's array on GPU ranks (float16
    under mixed, uint16 bfloat16 bits under bf16) unless its switch above is off, else the
    model's (an emulation keeps 16-bit values in float32 buffers)."""
    rounding = ROUNDING[precision]
    on = {"float16": FLOAT16_STORAGE, "bfloat16": BF16_STORAGE}.get(rounding, False)
    return np.dtype(STORAGE[rounding] if device == "cuda" and on else dtype)


def gemm_flop_per_frame(layers):
    """FLOP of the GEMMs of one training frame: forward, dW and dX (none for the input
    layer's input: its dx_macs, all of its GEMM for a Dense layer). A layer after a time
    stride runs on fewer rows than the input has frames: its share is scaled by them."""
    rate, macs = 1.0, []
    for layer in layers:
        rate /= getattr(layer, "stride", 1)   # the layer's output rows per input frame
        macs.append(layer.gemm_macs * rate)
    first = getattr(layers[0], "dx_macs", layers[0].gemm_macs) * macs[0] / max(
        layers[0].gemm_macs, 1)
    return 2 * (3 * sum(macs) - first)


class Network:
    def __init__(self, layers, max_batch=1024, dtype=np.float32, device="cpu", describe=None,
                 precision="float32", steps=None, qat=None, max_sequences=None):
        self.layers = list(layers)
        qat = quantize.check(qat)
        if qat and precision != "float32":
            raise ValueError("quantization-aware training: precision float32 only")
        # before the workspaces: an LSTM's quantized hidden state needs one
        self.quant = quantize.Quantizer(self.layers, qat, dtype, device) if qat else None
        self.specs = as_specs([s for layer in self.layers for s in layer.specs()]
                              + (self.quant.specs() if self.quant else []))
        # the criterion's labels: the output's width, but an RNN-T's output layer gives the
        # encoder's joint projection and scores its tokens inside the loss
        last = self.layers[-1]
        self.input_dim = self.layers[0].n_in
        self.num_labels = getattr(last, "num_tokens", last.n_out)
        self.max_batch, self.dtype, self.device = int(max_batch), np.dtype(dtype), device
        # a batch of whole sequences holds at most max_sequences of them (the loader's bound):
        # every buffer past a time stride needs fewer rows (model.lengths.strided_rows)
        self.max_sequences = int(max_sequences) if max_sequences else None
        self.layer_rows, stride = [], 1   # the most rows of each layer's output
        for layer in self.layers:
            stride *= getattr(layer, "stride", 1)
            self.layer_rows.append(strided_rows(self.max_batch, stride, self.max_sequences))
            if hasattr(layer, "max_sequences"):   # a layer with strides inside (conv2d)
                layer.max_sequences = self.max_sequences
        self.describe = describe or {}   # the builder's arguments (checkpoints, logs)
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: expected one of {PRECISIONS}")
        self.precision = precision
        self.rounding = ROUNDING[precision]   # None, "float16" or "bfloat16"
        self.half = self.rounding is not None   # a 16-bit float emulation (mixed or bf16)
        self.storage = storage_dtype(precision, device, self.dtype)
        # a layer that grows buffers of its own (a Conformer block's attention products)
        # makes them where the model's live
        for layer in self.layers:
            if getattr(layer, "takes_device", False):
                layer.device, layer.dtype, layer.storage = device, self.dtype, self.storage
        self.acts, self.workspaces = self._pass_buffers(self.storage)
        # dLoss/dx of a layer's input: not of the model's, unless its clip values are learned
        first = 0 if self.quant and self.quant.learns_input(0) else 1
        self.delta = zeros(self.max_batch * max([layer.n_in for layer in self.layers[first:]],
                                                default=1), self.storage, device)
        widest = max(getattr(layer, "width", layer.n_out) for layer in self.layers)
        self.ops = make_ops(device, self.max_batch, widest, self.dtype)
        # recurrent layers: sequences of `steps` frames (time-major rows) unless a pass is
        # told otherwise; sequence layers (recurrent, convolutions) take the batch's Lengths
        self.recurrent = any(getattr(layer, "recurrent", False) for layer in self.layers)
        self.sequence = any(getattr(layer, "sequence", False) for layer in self.layers)
        # the output layer's criterion reads frame labels, or a batch's token sequences
        # (targets of whole utterances: CTC, whose passes take their lengths from them)
        self.frame_labels = not getattr(self.layers[-1], "tokens", False)
        self.steps = steps
        # the first layer that has parameters: the input gradient of those above it is needed
        self.first_learning = next((i + 1 for i, layer in enumerate(self.layers)
                                    if layer.specs()), 1)
        self.parallel = any(hasattr(layer, "whole") for layer in self.layers)
        self._inference = None if self.storage != self.dtype else (self.acts, self.workspaces)
        if self.half:
            if self.dtype != np.float32:
                raise ValueError(f"precision {precision}: the model's dtype must be float32")
            self.round = half.round_to(self.rounding)
            # the 16-bit copy of W and of the input
            self.w16 = FlatParams(self.specs, self.storage, device)
            self.x16 = zeros((self.max_batch, self.input_dim), self.storage, device)
            self.half_ops = HalfOps(self.ops, self.rounding)
        if self.quant:
            self.wq = self.new_params()   # the fake-quantized weights a pass runs on
            self.aq = [zeros((self._rows_in(i), layer.n_in), self.dtype, device)
                       if rule != "none" else None
                       for i, (layer, rule) in enumerate(zip(self.layers, self.quant.rules))]
        self.graphs = None   # use_cuda_graphs(): hpcsgd/graphs.py
        self.dropout, self.dropped = 0.0, [None] * len(self.layers)   # set_dropout()
        if device == "cuda":
            self.x_in = zeros((self.max_batch, self.input_dim), self.dtype, "cuda")
            self.y_in = zeros(self.max_batch, np.int32, "cuda")
            # forward's host copy: the output layer's width (an RNN-T's: the joint's)
            self.out_host = np.empty((self.max_batch, last.n_out), self.dtype)

    def _pass_buffers(self, dtype):
        """Each layer's output (acts) and, for a recurrent or model-parallel layer, its
        workspaces (scratch: gates, cells, one step's products; None for the others)."""
        acts = [zeros((rows, layer.n_out), dtype, self.device)
                for layer, rows in zip(self.layers, self.layer_rows)]
        workspaces = [{name: zeros(shape, dtype, self.device)
                       for name, shape in layer.workspace(self._rows_in(i)).items()}
                      if hasattr(layer, "workspace") else None
                      for i, layer in enumerate(self.layers)]
        return acts, workspaces

    def _rows_in(self, i):
        """The most rows of layer i's input."""
        return self.layer_rows[i - 1] if i else self.max_batch

    def set_dropout(self, p):
        """Drop each encoder layer's output with probability p in training passes (the module
        docstring): the layers below the output layer that have parameters get a buffer for
        their dropped output. A model of whole utterances only: the masks are keyed by them."""
        if not 0 <= p < 1:
            raise ValueError(f"dropout {p}: expected 0 <= p < 1")
        if p and self.frame_labels:
            raise ValueError("dropout: models of whole utterances (CTC, RNN-T) only: the masks "
                             "are keyed by the batch's utterances")
        self.dropout = float(p)
        # a layer that drops inside it (a Conformer block: its modules' outputs) gets p
        for layer in self.layers:
            if getattr(layer, "drops_inside", False):
                layer.dropout = self.dropout
        self.dropped = [zeros((self.layer_rows[i], layer.n_out), self.storage, self.device)
                        if p and i < len(self.layers) - 1 and layer.specs()
                        and not getattr(layer, "drops_inside", False) else None
                        for i, layer in enumerate(self.layers)]

    def activation_buffers(self):
        """{name: array} of the buffers a training pass stores its activations and their
        gradients in: every layer's output (overwritten by its dz), the backward's delta,
        the recurrent layers' workspaces and, under mixed or bf16, the 16-bit input copy;
        each max_batch rows tall (or empty)."""
        out = {f"acts{i}": a for i, a in enumerate(self.acts)}
        out["delta"] = self.delta
        out.update({f"{i}.{k}": v for i, ws in enumerate(self.workspaces) if ws
                    for k, v in ws.items()})
        out.update({f"dropped{i}": d for i, d in enumerate(self.dropped) if d is not None})
        if self.half:
            out["x16"] = self.x16
        return out

    def activation_bytes(self, rows=None):
        """Bytes of activation_buffers() for a pass of `rows` rows (default: max_batch, what
        is allocated; else scaled by rows / max_batch, which each layer's share follows)."""
        total = sum(a.size * a.dtype.itemsize for a in self.activation_buffers().values())
        return total if rows is None else total * int(rows) // self.max_batch

    # ---- parameters ------------------------------------------------------------------------

    def new_params(self):
        """A zeroed FlatParams of this model's specs and dtype (params, grads, state), on the
        model's device."""
        return FlatParams(self.specs, self.dtype, self.device)

    def ready_offsets(self):
        """Where the backward pass leaves finished gradients: offsets[i] is the lowest flat
        offset from which every exchanged gradient is final once layers i.. have run their
        backward (the exchanged matrices from there on all belong to them), the exchanged
        prefix's end when none is. An overlapped exchange (exchange.overlap) sums
        flat[offsets[i]:] while layers below i still compute."""
        placed = sorted((m for m in matrices(self.specs) if m.exchange != "none"),
                        key=lambda m: m.offset)
        end = sum(m.size for m in placed)
        offsets, done = [], set()
        for layer in reversed(self.layers):
            done.update(s.name for s in as_specs(layer.specs()))
            lo = end
            for m in reversed(placed):
                if m.name not in done:
                    break
                lo = m.offset
            offsets.append(lo)
        return offsets[::-1]

    def init(self, params, rng):
        """Every layer's init, in layer order, from the numpy Generator `rng`. On a GPU: drawn
        on the host, then copied (the same weights as a CPU run with the same seed)."""
        host = params if self.device == "cpu" else FlatParams(self.specs, self.dtype)
        for layer in self.layers:
            layer.init(host.views, rng)
        if self.quant:   # learned clip values: no draws (the float layers' init is unchanged)
            self.quant.init(host.views)
        if host is not params:
            assign(params.flat, host.flat)

    @property
    def size(self):
        return sum(s.shape[0] * s.shape[1] for s in self.specs)

    def gemm_flop_per_frame(self):
        return gemm_flop_per_frame(self.layers)

    # ---- passes ----------------------------------------------------------------------------

    def _check(self, x, n):
        if not 0 < n <= self.max_batch:
            raise ValueError(f"minibatch of {n} frames: expected 1..{self.max_batch} (max_batch)")
        if x.dtype != self.dtype or x.ndim != 2 or x.shape[1] != self.input_dim \
                or x.shape[0] < n or not (is_device(x) or x.flags.c_contiguous):
            raise ValueError(f"input {x.dtype}{x.shape}: expected C-contiguous {self.dtype} "
                             f"(>= {n}, {self.input_dim})")

    def _to_device(self, x, y, n):
        """GPU ranks: host frames (and frame labels) -> the device input buffers; device
        arrays pass through. Host-to-device copies, queued on the default stream. Token
        targets stay on the host: the criterion copies what it needs (model.ops)."""
        if self.device == "cpu" or is_device(x):
            return x, y
        self.x_in[:n].copy_to_device(x[:n])
        labels = getattr(y, "labels", None)   # token targets' frame labels (model.frame_ce)
        if labels is not None and not self.frame_labels and not is_device(labels):
            self.y_in[:len(labels)].copy_to_device(np.ascontiguousarray(labels, np.int32))
            return self.x_in, y._replace(labels=self.y_in[:len(labels)])
        if y is None or not self.frame_labels:
            return self.x_in, y
        self.y_in[:n].copy_to_device(np.ascontiguousarray(y[:n], np.int32))
        return self.x_in, self.y_in

    def _sequences(self, layer, ws, lengths, keys=None):
        """The extra arguments of a layer's passes: a sequence layer's input Lengths, the
        workspaces of a layer that has them, and in a training pass with dropout the
        utterance keys of a layer that drops inside it (nothing for the others)."""
        extra = {"ws": ws} if ws is not None else {}
        if getattr(layer, "sequence", False):
            extra["lengths"] = lengths
        if keys is not None and getattr(layer, "drops_inside", False):
            extra["drop"] = (keys, lengths.nb)
        return extra

    def _last_ws(self, workspaces=None):
        """The output layer's workspaces, if it has any (a split softmax)."""
        ws = (workspaces or self.workspaces)[-1]
        return {"ws": ws} if ws else {}

    def _geometry(self, n, steps=None, lengths=None):
        """The Lengths (model.lengths) of every layer's input and of the output, for a pass
        of n time-major rows: whole sequences of `lengths` (frames per sequence, or a
        Lengths), or chunks of `steps` frames (a recurrent frame model; default its own);
        None for a frame model (every layer n rows)."""
        if not self.sequence:
            return None
        if lengths is None:
            steps = steps or self.steps
            if not steps or n % steps:
                raise ValueError(f"minibatch of {n} rows: expected whole sequences of {steps} "
                                 f"time steps (time-major, hpcsgd.data.sequences)")
            lengths = Lengths.full_batch(n // steps, steps)
        elif not isinstance(lengths, Lengths):
            lengths = Lengths(lengths)
        if lengths.rows != n:
            raise ValueError(f"minibatch of {n} rows: its {lengths.nb} sequences of up to "
                             f"{lengths.steps} steps are {lengths.rows} rows")
        if self.max_sequences and lengths.nb > self.max_sequences:
            raise ValueError(f"a batch of {lengths.nb} sequences: the model's buffers hold at "
                             f"most {self.max_sequences} (max_sequences)")
        geo = [lengths]
        for layer in self.layers:
            geo.append(layer.out_lengths(geo[-1]) if hasattr(layer, "out_lengths")
                       else geo[-1])
        return geo

    def out_rows(self, n, steps=None, lengths=None):
        """Rows of the output of a pass over n input rows (fewer after a time stride)."""
        geo = self._geometry(n, steps, lengths)
        return n if geo is None else geo[-1].rows

    def out_lengths(self, n, lengths):
        """The Lengths of a pass's output over whole sequences of these frames."""
        return self._geometry(n, None, lengths)[-1]

    def pop_skipped(self):
        """Sequences the criterion gave no loss since the last call (CTC: no alignment fits
        them after the subsampling), then zero; 0 for a frame criterion."""
        out = getattr(self.layers[-1], "skipped", 0)
        if out:
            self.layers[-1].skipped = 0
        return out

    def pop_frame_ce(self):
        """A CTC model's frame CE head since the last call: (CE summed, output steps, argmax
        hits), then zero; zeros without one (model/ctc.py)."""
        pop = getattr(self.layers[-1], "pop_frame_ce", None)
        return pop() if pop else np.zeros(3)

    def _mask(self, a, lengths, ops):
        """Zero the padding rows of a sequence batch's activation or gradient: what a layer
        reads past a sequence's end is then zero, as for that sequence alone."""
        if lengths is not None and not lengths.full:
            ops.mask_rows(a, lengths)

    def _forward(self, params, x, n, ops, progress=None, geo=None, buffers=None, keys=None):
        """keys: the batch's utterance keys in a training pass with dropout (else None)."""
        a = x[:n]
        acts, workspaces = buffers or (self.acts, self.workspaces)
        last = len(self.layers) - 1
        for i, (layer, out, ws) in enumerate(zip(self.layers, acts, workspaces)):
            rows_in, rows = (n, n) if geo is None else (geo[i].rows, geo[i + 1].rows)
            if self.quant:
                out_q = self.aq[i][:rows_in] if self.aq[i] is not None else None
                a = self.quant.quantize_input(i, a, out_q, params, ops)
            layer.forward(params, a, out[:rows], ops, progress,
                          **self._sequences(layer, ws, geo[i] if geo else None, keys))
            if geo is not None and i < last:
                self._mask(out[:rows], geo[i + 1], ops)
            a = out[:rows]
            if keys is not None and self.dropped[i] is not None:   # padding stays 0
                a = self.dropped[i][:rows]
                ops.dropout(out[:rows], a, keys, geo[i + 1].nb, i + 1, self.dropout)
        return a

    def pass_weights(self, params):
        """The weights a pass runs on (what a search outside the Network, the RNN-T's, must
        use): params, or under quantization-aware training their fake-quantized copy."""
        return self._quantized(params, self.ops)

    def _quantized(self, params, ops):
        """The weights a pass runs on: the master's, or their fake-quantized copy."""
        if not self.quant:
            return params
        self.quant.quantize_weights(params, self.wq, ops)
        return self.wq

    def forward_backward(self, params, grads, x, y, n, progress=None, ops=None,
                         loss_scale=1.0, steps=None, lengths=None, ready=None):
        """One minibatch: x[:n] (n, input_dim) frames, y[:n] (n,) integer labels in
        [0, num_labels) (host arrays; a GPU model copies them to the device). Overwrites every
        view of `grads` with the gradient of the cross-entropy SUMMED over the n frames.
        Returns (ce_sum: float, nats summed over the frames; n_correct: int, frames whose
        argmax posterior equals the label). `progress`, if given, is called after every GEMM.
        `ops` replaces the element-wise kernels (model.ops.GemmOnly: the GEMMs alone).
        loss_scale multiplies the loss gradient (so grads come out scaled); mixed precision
        leaves the weight gradients as float32 GEMM results: unscale() finishes both.
        A label -1 marks a frame outside the loss (a sequence's context or padding); `steps`:
        the sequence length of a recurrent model's time-major rows (default: its own), or
        `lengths`: whole sequences of these frames (non-increasing), padded to the longest.
        A model with token targets (CTC) takes y = hpcsgd.data.utterances.Targets (the
        sequences' frames, token ids, offsets) and returns (loss summed over the sequences,
        tokens in the targets). `ready`, if given, is called with i after layer i's backward
        (its gradients and those of the layers above it are final: ready_offsets())."""
        ops = ops or self.ops
        self._check(x, n)
        geo = self._geometry(n, steps, lengths if self.frame_labels else y.frames)
        if self.frame_labels:
            lab = y[:n]
            if not is_device(lab) and (lab.shape != (n,) or lab.min() < -1
                                       or lab.max() >= self.num_labels):
                raise ValueError(f"labels: expected {n} integers in [0, {self.num_labels}) or "
                                 f"-1 (no loss), got shape {lab.shape}, range [{lab.min()}, "
                                 f"{lab.max()}]")
        else:
            check_targets(y, self.num_labels)
        x, y = self._to_device(x, y, n)
        # an overflow (float16, or a scaled gradient) is detected by unscale(), not warned of
        with np.errstate(over="ignore", invalid="ignore"):
            if self.graphs is not None and ops is self.ops and progress is None \
                    and ready is None:
                # one CUDA Graph per shape, buffers and scale: the same pass, one launch
                steps = geo[0].steps if geo else None
                key = (n, float(loss_scale), steps, id(params), id(grads), id(x), id(y))
                return self.graphs.run(key, lambda: self._forward_backward(
                    params, grads, x, y, n, None, ops, loss_scale, geo), n)
            return self._forward_backward(params, grads, x, y, n, progress, ops, loss_scale,
                                          geo, ready)

    def frames_in_loss(self, y, n):
        """Input frames a pass of n rows trains on (the per-sample learning rate's count):
        a frame model's labelled rows (not a chunk's context or padding, labelled -1), the
        frames of a batch of whole utterances (not the padding)."""
        if not self.frame_labels:
            return int(np.sum(y.frames))
        return int(np.count_nonzero(np.asarray(y[:n]) >= 0)) if self.recurrent else n

    def use_cuda_graphs(self):
        """GPU ranks: capture forward_backward as CUDA Graphs from now on (hpcsgd/graphs.py),
        where it can be: not with quantization-aware training (its statistics come back to the
        host inside the pass: refused) nor model parallelism (collectives inside the pass);
        a pass given MPI_Test between GEMMs (double buffering's progress) runs eagerly."""
        from hpcsgd.graphs import Graphs
        if self.device != "cuda" or self.quant or self.parallel:
            raise ValueError("train.cuda_graphs: GPU ranks only, without qat.* or "
                             "model.parallel (their passes read back to the host)")
        self.graphs = Graphs(self.ops)

    def _forward_backward(self, params, grads, x, y, n, progress, ops, loss_scale, geo,
                          ready=None):
        if self.half:   # the 16-bit copy of the weights and input; 16-bit stores
            self.round(params.flat, self.w16.flat)
            self.round(x[:n], self.x16[:n])
            params, x = self.w16, self.x16
            ops = ops if isinstance(ops, GemmOnly) else (
                self.half_ops if ops is self.ops else HalfOps(ops, self.rounding))
        master, params = params, self._quantized(params, ops)
        if self.quant:   # the clip values' decay is per sample (inner inputs: conformer.py)
            self.quant.frames = n * loss_scale
        keys = self._dropout_keys(y)
        logits = self._forward(params, x, n, ops, progress, geo, keys=keys)
        if self.frame_labels:
            ce, correct = self.layers[-1].loss(params, grads, logits, y[:n], ops, loss_scale,
                                               **self._last_ws())
        else:   # token targets of whole sequences, at the output's (subsampled) lengths
            ce, correct = self.layers[-1].loss(params, grads, logits, y, ops, loss_scale,
                                               lengths=geo[-1], **self._last_ws())
        dy = None                      # the loss has turned the logits into dLoss/dz
        quant = self.quant
        for i in range(len(self.layers) - 1, -1, -1):
            layer = self.layers[i]
            rows_in, rows = (n, n) if geo is None else (geo[i].rows, geo[i + 1].rows)
            dropped = keys is not None and i > 0 and self.dropped[i - 1] is not None
            inp = (self.dropped[i - 1] if dropped else self.acts[i - 1])[:rows_in] if i > 0 \
                else x[:rows_in]
            # dLoss/dx only where a layer below it learns (or the input's learned clip):
            # not below a parameterless first layer such as frame stacking
            wants_dx = i >= self.first_learning or (quant and quant.learns_input(0))
            dx = self.delta[:rows_in * layer.n_in].reshape(rows_in, layer.n_in) \
                if wants_dx else None
            layer.backward(params, grads,
                           self.aq[i][:rows_in] if quant and quant.grids[i] is not None else inp,
                           self.acts[i][:rows], dy, dx, ops, progress,
                           **self._sequences(layer, self.workspaces[i], geo[i] if geo else None,
                                             keys))
            if geo is not None and dx is not None:
                self._mask(dx, geo[i], ops)
            if dropped and dx is not None:   # d(dropped)/d(output): the same mask and scale
                ops.dropout(dx, dx, keys, geo[i].nb, i, self.dropout)
            if quant:   # straight through to the float input (before the layer below reuses it)
                quant.input_backward(i, inp, dx, master, grads, ops, n * loss_scale)
            if ready is not None:
                ready(i)
            dy = dx
        if quant:
            quant.weights_backward(master, grads, ops, n * loss_scale)
        return ce, correct

    def _dropout_keys(self, y):
        """A training pass's utterance keys for dropout (on the device for GPU ranks: one
        small host-to-device copy a pass), or None without dropout."""
        if not self.dropout:
            return None
        keys = getattr(y, "keys", None)
        if keys is None or len(keys) != len(y.frames):
            raise ValueError("dropout: the batch's Targets carry no utterance keys (one per "
                             "utterance: hpcsgd.data.utterances)")
        keys = np.ascontiguousarray(keys, np.uint64)
        return keys if self.device == "cpu" else cuda.to_device(keys)

    def unscale(self, grads, loss_scale):
        """The gradient forward_backward left, made the float32 gradient of the summed loss:
        mixed precision rounds it to float16 first (the GEMMs' float16 outputs; an overflow
        becomes Inf here), bf16 to bfloat16, then it is multiplied by 1 / loss_scale in
        float32. Returns (non-finite values, max |gradient|): the overflow vote's inputs
        (hpcsgd/step.py)."""
        return half.unscale(grads.flat, loss_scale, self.rounding)

    def forward(self, params, x, n, out=None, log=True, steps=None, lengths=None):
        """Log-posteriors (log=True) or posteriors of x[:n], shape (rows, num_labels): rows
        n, or fewer after a time stride (out_rows). Written into `out` (a C-contiguous
        (>= rows, num_labels) host array of the model's dtype) if given, else returned as a
        view of the model's workspace (a GPU model's host copy), valid until the next call.
        Recurrent frame models: x[:n] is time-major sequences of `steps` frames (default:
        the model's; a whole utterance is steps = n). Sequence models of whole utterances
        (CTC): `lengths`, the frames of each of the batch's sequences (non-increasing), x[:n]
        their time-major rows."""
        self._check(x, n)
        geo = self._geometry(n, steps, lengths)
        x, _ = self._to_device(x, None, n)
        params = self._quantized(params, self.ops)
        if self._inference is None:   # 16-bit storage: float32 buffers for the float32 pass
            self._inference = self._pass_buffers(self.dtype)
        z = self._forward(params, x, n, self.ops, geo=geo, buffers=self._inference)
        rows = len(z)
        self.layers[-1].posteriors(params, z, self.ops, log, **self._last_ws(self._inference[1]))
        if self.device == "cuda":
            host = out[:rows] if out is not None else self.out_host[:rows]
            z.copy_to_host(host)   # a device -> host copy: sync point
            return host
        if out is None:
            return z
        out[:rows] = z
        return out[:rows]


def check_targets(targets, num_labels):
    """A batch's token targets (hpcsgd.data.utterances.Targets): offsets that cut ids into
    one sequence per frame count, token ids 1..num_labels-1 (0 is the blank)."""
    frames, ids, offsets = targets.frames, targets.ids, targets.offsets
    if len(offsets) != len(frames) + 1 or (len(offsets) and (offsets[0] != 0
                                                             or offsets[-1] != len(ids))):
        raise ValueError(f"targets: {len(offsets)} offsets for {len(frames)} sequences and "
                         f"{len(ids)} tokens")
    if len(ids) and (ids.min() < 1 or ids.max() >= num_labels):
        raise ValueError(f"targets: token ids in [{ids.min()}, {ids.max()}], expected "
                         f"1..{num_labels - 1} (0 is the blank)")
