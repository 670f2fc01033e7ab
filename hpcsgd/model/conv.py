"""Time convolutions over time-major batches of sequences (hpcsgd.model.lengths): the 1-D
convolution of DeepSpeech2's front end, Wav2Letter's stack and Kaldi's TDNN layers, and frame
stacking. Each is a GEMM over unfolded frames (model.kernels_seq: unfold, fold).

Conv1d(name, C, F, kernel k, stride s, dilation d): output step t' of a sequence reads its
input steps t'*s - p + j*d, j = 0..k-1, p = (k-1)*d // 2 (centred; outside the sequence the
input is zero), or p = 0 with ahead=True (spec "conv F kK ahead": step t' reads only itself
and the (k-1)*d steps after it, a causal encoder's bounded lookahead), so a sequence of L
steps gives ceil(L / s). Parameters {name}.w (k*C, F) and
{name}.b (1, F): a codec column of W is the fan-out of one input channel at one tap. Forward:
cols = unfold(x) (T'*nb, k*C), y = f(cols @ W + b); the unfolded input is kept for the
backward's dW = cols^T @ dz, whose buffer then takes dcols = dz @ W^T, folded into dx. Costs
per output row: 2 k C F FLOP forward, as much for dW and for dX; the workspace is k times
the input.

Conv1d(..., norm="ln") (spec "conv F kK ... ln"): y = f(LayerNorm(cols @ W)), each output row
normalized over its F channels (model.kernels_norm), then scaled and shifted by g{index} and
b{index} (1, F) (the norm's gamma and beta; no bias before it: the norm's beta is the shift).
norm="in" ("conv F kK ... in"): each channel of each sequence normalized over the sequence's
output steps instead (instance norm: batch norm's statistics over one utterance). The GEMM's
output z is kept in a workspace for the backward (rows x F more), which recomputes the
statistics from it; the norm's backward writes dz over y, then the GEMMs as above.

StackFrames(name, C, k): row t' = [x_{t'k}, ..., x_{t'k+k-1}] (zeros past the end): a
subsampling by k without parameters, the input of the next layer k*C wide.

Padding: the Network zeroes the padded rows of every sequence layer's output and input
gradient (Network._mask), so a convolution sees zeros past a sequence's end, as it would on
that sequence alone, and the weight gradients get nothing from the padding.
"""
import numpy as np

from hpcsgd.device import assign, matmul
from hpcsgd.model import kernels as K
from hpcsgd.model.flat import ParamSpec
from hpcsgd.model.layers import ACTIVATIONS, glorot_uniform

NORMS = (None, "ln", "in")   # none, layer norm (over channels), instance norm (over steps)


class Conv1d:
    """A 1-D convolution over time with an activation (ReLU or sigmoid)."""
    sequence = True   # Network passes its input's Lengths and its workspace

    def __init__(self, name, n_in, n_out, kernel, stride=1, dilation=1, activation="relu",
                 norm=None, ahead=False):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
        if min(kernel, stride, dilation) < 1:
            raise ValueError(f"convolution: kernel {kernel}, stride {stride}, dilation "
                             f"{dilation} must all be >= 1")
        self.W, self.b = f"{name}.w", f"{name}.b"
        if norm not in NORMS:
            raise ValueError(f"convolution norm {norm!r}: expected one of {NORMS}")
        self.norm = norm
        self.g = f"{name}.norm.g" if norm else None   # the norm's gain (gamma)
        self.n_in, self.n_out = int(n_in), int(n_out)
        self.kernel, self.stride, self.dilation = int(kernel), int(stride), int(dilation)
        # taps behind the output step: centred, or none for a lookahead layer
        self.left = 0 if ahead else (self.kernel - 1) * self.dilation // 2
        self.activation, self.kind = activation, ACTIVATIONS[activation]
        self.gemm_macs = self.kernel * self.n_in * self.n_out   # per output row
        self.output_range = (0.0, 1.0) if self.kind == K.SIGMOID else (0.0, None)

    def specs(self):
        gain = [ParamSpec(self.g, (1, self.n_out), "bias", "codec", "rows")] if self.g else []
        return [ParamSpec(self.W, (self.kernel * self.n_in, self.n_out), "weight", "codec",
                          "rows")] + gain + [ParamSpec(self.b, (1, self.n_out), "bias", "codec",
                                                       "rows")]

    def workspace(self, max_rows):
        out = {"cols": (max_rows, self.kernel * self.n_in)}
        if self.g:
            out["z"] = (max_rows, self.n_out)   # the GEMM's output, before the norm
        return out

    def init(self, views, rng):
        """Glorot over the k*C inputs, times 4 for sigmoid and sqrt(2) for ReLU (as Dense);
        the norm's gain 1 and every shift 0. Before a norm, U(-a, a) with a = 1 / sqrt(k*C)
        (PyTorch's Conv1d default, a third of He's for so762's W2L layers): the norm makes the
        forward pass blind to W's scale, but Adam's steps are not relative to it, so larger
        weights turn more slowly (on so762's W2L recipe with instance norms the two scales
        gave the same first 6 epochs: experiments/ctc_so762.md)."""
        W = views[self.W]
        if self.g:
            a = 1.0 / np.sqrt(W.shape[0])
            W[...] = rng.uniform(-a, a, size=W.shape).astype(W.dtype)
            views[self.g][...] = 1
        else:
            glorot_uniform(W, rng, 4.0 if self.kind == K.SIGMOID else np.sqrt(2.0))
        views[self.b][...] = 0

    def out_lengths(self, lengths):
        return lengths.strided(self.stride)

    def _shape(self, lengths):
        out = lengths.strided(self.stride)
        return (lengths.nb, lengths.steps, out.steps, self.kernel, self.stride, self.dilation,
                self.left), out.rows

    def _normalize(self, p, z, y, ops, lengths):
        if self.norm == "ln":
            ops.layer_norm(z, p[self.g], p[self.b], y, self.kind)
        else:
            ops.instance_norm(z, p[self.g], p[self.b], y, self.kind,
                              lengths.strided(self.stride))

    def forward(self, p, x, y, ops, progress=None, ws=None, lengths=None):
        shape, rows = self._shape(lengths)
        cols = ws["cols"][:rows]
        ops.unfold(x, cols, *shape)
        z = ws["z"][:rows] if self.g else y
        matmul(cols, p[self.W], z)                       # 2 rows k C F FLOP
        if progress is not None:
            progress()
        if self.g:
            self._normalize(p, z, y, ops, lengths)
        else:
            ops.bias_act(y, p[self.b], self.kind)

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None, lengths=None):
        shape, rows = self._shape(lengths)
        cols = ws["cols"][:rows]                         # the forward's unfolded input
        if self.norm == "ln":                            # dz over y
            ops.layer_norm_backward(ws["z"][:rows], y, dy, p[self.g], y, g[self.g],
                                    g[self.b], self.kind)
        elif self.norm == "in":
            ops.instance_norm_backward(ws["z"][:rows], y, dy, p[self.g], y, g[self.g],
                                       g[self.b], self.kind, lengths.strided(self.stride))
        else:
            ops.act_backward(y, dy, y, g[self.b], self.kind)
        matmul(cols, y, g[self.W], trans_a=True)
        if progress is not None:
            progress()
        if dx is not None:
            matmul(y, p[self.W], cols, trans_b=True)     # dcols, over the unfolded input
            if progress is not None:
                progress()
            ops.fold(cols, dx, *shape)


class StackFrames:
    """Frame stacking: every k consecutive steps of a sequence as one (subsampling by k)."""
    sequence = True

    def __init__(self, name, n_in, k):
        if k < 1:
            raise ValueError(f"frame stacking by {k}: expected >= 1")
        self.n_in, self.k = int(n_in), int(k)
        self.n_out, self.stride = self.k * self.n_in, self.k
        self.gemm_macs = 0
        self.output_range = (None, None)   # the input's values, moved

    def specs(self):
        return []

    def workspace(self, max_rows):
        """Where dLoss/dy is copied before it is folded into dx: the Network hands both in
        one buffer (delta). Only a model whose input gradient is wanted (a learned clip of
        the features, qat) uses it; stacking is the first layer otherwise."""
        return {"dy": (max_rows, self.n_out)}

    def init(self, views, rng):
        pass

    def out_lengths(self, lengths):
        return lengths.strided(self.k)

    def _shape(self, lengths):
        return (lengths.nb, lengths.steps, lengths.strided(self.k).steps, self.k, self.k, 1, 0)

    def forward(self, p, x, y, ops, progress=None, ws=None, lengths=None):
        ops.unfold(x, y, *self._shape(lengths))

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None, lengths=None):
        if dx is not None:
            saved = ws["dy"][:len(dy)]
            assign(saved, dy)
            ops.fold(saved, dx, *self._shape(lengths))
