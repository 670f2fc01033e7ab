"""Fully connected DNN acoustic model (the paper's CD-DNN-HMM frame classifier): forward and
backward with BLAS GEMMs into preallocated views and fused kernels for all element-wise work:
NumPy's BLAS and the Numba CPU kernels of hpcsgd.model.kernels on CPU ranks; cuBLAS
(hpcsgd.device.matmul) and the CUDA kernels of hpcsgd.model.kernels_cuda on GPU ranks
(device="cuda": every buffer on the GPU; batches come from the host and are copied in).

Shape key: N = frames in the minibatch (<= max_batch), D = input dim (spliced features,
e.g. 11*40 = 440), H_l = units of hidden layer l, V = num_labels (senones), L = hidden layers.

Layout (see hpcsgd.model.flat): "W0", "b0", ..., "W{L}", "b{L}"; W_l is (n_in, n_out) and
y = x @ W_l + b_l, b_l is (1, n_out). A codec column is a row W_l[j, :] (the fan-out of input
unit j), contiguous in memory; a bias is one codec column.

Conventions: the cross-entropy and the gradients are SUMMED over the minibatch, never averaged;
learning rates are per sample (hpcsgd.optim). Costs per frame: 2 * sum(n_in * n_out) FLOP
forward, the same for dW, and the same less the first layer for dX (~276 MFLOP for 46M).
"""
import numpy as np

from hpcsgd.device import assign, is_device, matmul, zeros
from hpcsgd.model import kernels as K
from hpcsgd.model import kernels_cuda as KC   # compiled on first launch, by GPU models only
from hpcsgd.model.flat import FlatParams


def layout(input_dim, hidden, num_labels):
    """[(name, shape), ...] of the DNN's parameters, in flat-buffer order."""
    dims = [int(input_dim), *[int(h) for h in hidden], int(num_labels)]
    out = []
    for l, (n_in, n_out) in enumerate(zip(dims[:-1], dims[1:])):
        out += [(f"W{l}", (n_in, n_out)), (f"b{l}", (1, n_out))]
    return out


def gemm_flop_per_frame(input_dim, hidden, num_labels):
    """FLOP of the GEMMs of one training frame: forward, dW and dX (no dX for the input)."""
    dims = [input_dim, *hidden, num_labels]
    macs = [a * b for a, b in zip(dims[:-1], dims[1:])]
    return 2 * (3 * sum(macs) - macs[0])


class DNN:
    """The model's shapes and its preallocated workspaces (activations, deltas, partial sums).

    Parameters and gradients are FlatParams of `self.layout` (the caller owns them, so that the
    optimizer, codecs and checkpoints see the same flat buffers). Any n <= max_batch works on
    views of the workspaces; nothing is allocated per call except small result scalars.
    """

    def __init__(self, input_dim, hidden, num_labels, activation="sigmoid", max_batch=1024,
                 dtype=np.float32, device="cpu"):
        if activation not in K.ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(K.ACTIVATIONS)}")
        self.dims = [int(input_dim), *[int(h) for h in hidden], int(num_labels)]
        self.hidden = self.dims[1:-1]
        self.activation = activation
        self.kind = K.ACTIVATIONS[activation]
        self.max_batch = int(max_batch)
        self.dtype = np.dtype(dtype)
        self.device = device
        self.layout = layout(input_dim, hidden, num_labels)
        self.n_layers = len(self.dims) - 1          # weight matrices, L + 1
        # acts[l] (max_batch, dims[l+1]): output of layer l (h_l, or the logits for the last);
        # backward overwrites it with dZ_l, the gradient w.r.t. the layer's pre-activation.
        self.acts = [zeros((self.max_batch, d), self.dtype, device) for d in self.dims[1:]]
        # dH_l = dZ_{l+1} @ W_{l+1}.T before the activation derivative; one buffer, viewed
        # (n, H_l) C-contiguous.
        self.delta = zeros(self.max_batch * max(self.hidden, default=1), self.dtype, device)
        if device == "cuda":
            self._cuda_workspaces()
        else:
            self.partial = np.empty((K.NCHUNK, max(self.dims[1:])), self.dtype)
            self.lanes = np.empty((max(self.max_batch, K.NCHUNK), K.LANES), self.dtype)
            self.ce_part = np.empty(K.NCHUNK, np.float64)
            self.correct_part = np.empty(K.NCHUNK, np.int64)

    def _cuda_workspaces(self):
        """GPU ranks: the batch is copied into device buffers (x_in, y_in), the per-row CE and
        hits come back through small device buffers; forward() copies its result to the host."""
        self.x_in = zeros((self.max_batch, self.dims[0]), self.dtype, "cuda")
        self.y_in = zeros(self.max_batch, np.int32, "cuda")
        self.ce_rows = zeros(self.max_batch, np.float64, "cuda")
        self.correct_rows = zeros(self.max_batch, np.int32, "cuda")
        self.out_host = np.empty((self.max_batch, self.dims[-1]), self.dtype)

    def new_params(self):
        """A zeroed FlatParams of this model's layout and dtype (params, grads, state), on the
        model's device."""
        return FlatParams(self.layout, self.dtype, self.device)

    def init(self, params, rng):
        """Uniform Glorot init, seeded by the numpy Generator `rng`; biases zero.
        W ~ U(-a, a), a = sqrt(6 / (n_in + n_out)), times 4 for sigmoid hidden layers (Glorot
        & Bengio 2010) and sqrt(2) for ReLU (He); the softmax layer gets plain Glorot. On a GPU:
        drawn on the host, then copied (the same weights as a CPU run with the same seed)."""
        host = params if self.device == "cpu" else FlatParams(self.layout, self.dtype)
        for l, (n_in, n_out) in enumerate(zip(self.dims[:-1], self.dims[1:])):
            a = np.sqrt(6.0 / (n_in + n_out))
            if l < self.n_layers - 1:
                a *= 4.0 if self.kind == K.SIGMOID else np.sqrt(2.0)
            W = host.views[f"W{l}"]
            W[...] = rng.uniform(-a, a, size=W.shape).astype(self.dtype)
            host.views[f"b{l}"][...] = 0
        if host is not params:
            assign(params.flat, host.flat)

    def _check(self, x, n):
        if not 0 < n <= self.max_batch:
            raise ValueError(f"minibatch of {n} frames: expected 1..{self.max_batch} (max_batch)")
        if x.dtype != self.dtype or x.ndim != 2 or x.shape[1] != self.dims[0] \
                or x.shape[0] < n or not (is_device(x) or x.flags.c_contiguous):
            raise ValueError(f"input {x.dtype}{x.shape}: expected C-contiguous {self.dtype} "
                             f"(>= {n}, {self.dims[0]})")

    def _to_device(self, x, y, n):
        """GPU ranks: host frames (and labels) -> the device input buffers; device arrays pass
        through. Host-to-device copies, queued on the default stream."""
        if self.device == "cpu" or is_device(x):
            return x, y
        self.x_in[:n].copy_to_device(x[:n])
        if y is None:
            return self.x_in, None
        self.y_in[:n].copy_to_device(np.ascontiguousarray(y[:n], np.int32))
        return self.x_in, self.y_in

    def _act_forward(self, z, b):
        if self.device == "cuda":
            KC.bias_act_forward(z, b, self.kind)
        else:
            K.FORWARD[self.kind](z, b)

    def _act_backward(self, h, d, dz, gb):
        if self.device == "cuda":
            KC.act_backward(h, d, dz, gb, self.kind)
        else:
            K.BACKWARD[self.kind](h, d, dz, gb, self.partial)

    def _softmax_xent(self, z, b, y, gb):
        """-> (CE summed over the rows, frames whose argmax is the label); z becomes dZ."""
        if self.device == "cuda":
            return KC.softmax_xent_backward(z, b, y, gb, self.ce_rows, self.correct_rows)
        K.softmax_xent_backward(z, b, y, gb, self.partial, self.lanes, self.ce_part,
                                self.correct_part)
        return float(self.ce_part.sum()), int(self.correct_part.sum())

    def _forward(self, params, x, n, progress=None):
        """Hidden layers: acts[l][:n] = f(a @ W_l + b_l); the last gets only the GEMM."""
        a = x[:n]
        for l in range(self.n_layers):
            out = self.acts[l][:n]
            matmul(a, params.views[f"W{l}"], out)                   # 2 n n_in n_out FLOP
            if progress is not None:
                progress()
            if l < self.n_layers - 1:
                self._act_forward(out, params.views[f"b{l}"])
            a = out

    def forward_backward(self, params, grads, x, y, n, progress=None):
        """One minibatch: x[:n] (n, D) frames, y[:n] (n,) integer labels in [0, V) (host
        arrays; a GPU model copies them to the device). Overwrites every view of `grads` with
        the gradient of the cross-entropy SUMMED over the n frames. Returns (ce_sum: float,
        nats summed over the frames; n_correct: int, frames whose argmax posterior equals
        the label). `progress`, if given, is called after every GEMM (3L+2 calls for L hidden
        layers): double buffering drives the exchange in flight with it (MPI_Test), since
        MPI progresses a nonblocking collective only inside MPI calls."""
        self._check(x, n)
        lab = y[:n]
        if not is_device(lab) and (lab.shape != (n,) or lab.min() < 0
                                   or lab.max() >= self.dims[-1]):
            raise ValueError(f"labels: expected {n} integers in [0, {self.dims[-1]}), got "
                             f"shape {lab.shape}, range [{lab.min()}, {lab.max()}]")
        x, y = self._to_device(x, y, n)
        self._forward(params, x, n, progress)
        top = self.n_layers - 1
        ce, correct = self._softmax_xent(self.acts[top][:n], params.views[f"b{top}"], y[:n],
                                         grads.views[f"b{top}"])
        for l in range(top, -1, -1):
            dz = self.acts[l][:n]                                   # dZ_l (n, n_out)
            a = self.acts[l - 1][:n] if l > 0 else x[:n]           # input of layer l
            matmul(a, dz, grads.views[f"W{l}"], trans_a=True)       # dW_l = a.T @ dZ_l
            if progress is not None:
                progress()
            if l > 0:
                h = self.acts[l - 1][:n]
                dh = self.delta[:n * h.shape[1]].reshape(n, h.shape[1])
                matmul(dz, params.views[f"W{l}"], dh, trans_b=True)  # dH = dZ_l @ W_l.T
                if progress is not None:
                    progress()
                # dZ_{l-1} = dH * f'(.) written over h_{l-1}, which is not needed any more
                self._act_backward(h, dh, h, grads.views[f"b{l - 1}"])
        return ce, correct

    def forward(self, params, x, n, out=None, log=True):
        """Log-posteriors (log=True) or posteriors of x[:n], shape (n, V). Written into `out`
        (a C-contiguous (>= n, V) host array of the model's dtype) if given, else returned as a
        view of the model's workspace (a GPU model's host copy), valid until the next call."""
        self._check(x, n)
        x, _ = self._to_device(x, None, n)
        self._forward(params, x, n)
        top = self.n_layers - 1
        z = self.acts[top][:n]
        if self.device == "cuda":
            KC.log_softmax_forward(z, params.views[f"b{top}"])
            if not log:
                KC.exp_inplace(z)
            host = out[:n] if out is not None else self.out_host[:n]
            z.copy_to_host(host)   # a device -> host copy: sync point
            return host
        K.log_softmax_forward(z, params.views[f"b{top}"], self.lanes)
        if not log:
            K.exp_inplace(z)
        if out is None:
            return z
        out[:n] = z
        return out[:n]
