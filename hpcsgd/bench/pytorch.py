"""What users would run instead: the same model trained by PyTorch, timed by `bench train
--pytorch` in the same rounds as hpcsgd's step (so both see the same neighbours).

The standard recipe: nn.Sequential of Linear + Sigmoid (or ReLU) layers (an LSTM model:
nn.LSTM on time-major input + Linear, SequenceModel), CrossEntropyLoss
(summed, as hpcsgd sums), torch.optim.SGD with momentum, zero_grad / forward / backward /
step; the threads of the process set with torch.set_num_threads (the same count hpcsgd's rank
gets). At K > 1 ranks: DistributedDataParallel over gloo (PyTorch's CPU backend), one process
per MPI rank, the process group found through a TCP port rank 0 picks and broadcasts; each
rank trains its share of the global minibatch, DDP allreduces the float32 gradients.

On GPU ranks (`bench train --device cuda --pytorch`) the same recipe runs on the rank's GPU
(the one hpcsgd.comm.gpu.bind_gpu chose), TF32 off as for hpcsgd's float32 GEMMs, DDP over
NCCL when every rank has a GPU of its own, else over gloo (NCCL refuses two ranks on one
device). Beside float32 eager, the variants users reach for, each its own replica and
optimizer, timed in the same rounds:
  pytorch_amp16     torch.autocast(float16) + GradScaler (beside hpcsgd's precision=mixed)
  pytorch_bf16      torch.autocast(bfloat16), no scaler (beside precision=bf16)
  pytorch_compiled  torch.compile(mode="reduce-overhead"): CUDA graphs of the step's
                    kernels, the stronger peer for small models (one rank: --pytorch-compile)
Each step ends with torch.cuda.synchronize() on a GPU, as hpcsgd's ends with its loss read.

PyTorch is not a dependency of hpcsgd (`pip install torch==2.13.0` beside it for this
comparison); --pytorch fails with a clear error without it.
"""
import contextlib
import socket
import time

import numpy as np

from hpcsgd.families import of_model


def SequenceModel(torch, shape, act):
    """A (B)LSTM as PyTorch users write it: one nn.LSTM over the layers (nn.LSTM modules
    stacked where the layers' sizes differ), the bottleneck Linear layers, a Linear output;
    (T, B, D) in, (T*B, labels) logits out."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cells, bi = shape["cells"], shape["bidirectional"]
            groups, n_in = [], shape["input_dim"]
            for c in cells:   # runs of equal sizes: one multi-layer nn.LSTM each
                if groups and groups[-1][0] == c:
                    groups[-1][1] += 1
                else:
                    groups.append([c, 1])
            self.lstms = torch.nn.ModuleList()
            for c, layers in groups:
                self.lstms.append(torch.nn.LSTM(n_in, c, num_layers=layers, bidirectional=bi))
                n_in = c * (2 if bi else 1)
            head = []
            for width in shape["bottleneck"]:
                head += [torch.nn.Linear(n_in, width), act()]
                n_in = width
            head.append(torch.nn.Linear(n_in, shape["num_labels"]))
            self.head = torch.nn.Sequential(*head)

        def forward(self, x):
            for lstm in self.lstms:
                x, _ = lstm(x)
            return self.head(x.reshape(-1, x.shape[-1]))
    return Net()


def CTCModel(torch, shape, act, out=None):
    """A CTC encoder as PyTorch users write it, layer for layer the spec's
    (hpcsgd/model/encoder.py): frame stacking as a reshape, nn.Conv1d with centred padding
    (on (B, C, T), the padding past each utterance zeroed; "ln": nn.LayerNorm over the
    channels before the activation, "in": each channel normalized over the utterance's valid
    steps (masked means: nn.InstanceNorm1d would count the padding), either with the
    convolution without bias), nn.LSTM on packed sequences
    (bidirectional for blstm), nn.Linear; a Linear to the tokens. forward(x (T, B, D)
    time-major, lengths (B,) longest first) -> ((T', B, V) log-probabilities for nn.CTCLoss,
    the output lengths). Also experiments/pytorch_ctc.py's model. With `out` = the joint's
    width: a transducer's encoder, (T', B, out) of its joint projection (no log-softmax).
    shape["batch_norm"] (experiments/pytorch_ctc.py --batch-norm, hpcsgd has none): every
    "in" becomes batch norm, over the batch's valid steps, running statistics in eval().
    shape["dropout"] (model.dropout): nn.Dropout on each layer's output but stacking's, in
    train() mode (its own generator's masks; hpcsgd's are hashed per utterance); a Conformer
    block drops each module's output before its residual add instead (not the block's).

    The Conformer's specs (hpcsgd/model/conformer.py), as ESPnet / NeMo / torchaudio write
    them: "conv2d C D" is nn.Conv2d(1, C, 3, stride 2, padding 1) over (B, 1, T, F), ReLU, the
    padding past each utterance zeroed, nn.Conv2d(C, C, ...), ReLU, the (B, C, T', F') map
    flattened channel-major (ESPnet's x.transpose(1, 2).view(b, t, c * f); hpcsgd's rows are
    frequency-major: experiments/pytorch_conformer_parity.py permutes the weight), nn.Linear
    to D; ceil(L/4) output steps. "conformer D hH fF kK [ln|in]": ConformerBlock below (macaron
    nn.Linear + SiLU feed-forwards at 1/2, nn.LayerNorm before each module, a fused nn.Linear
    for q, k and v, the rotary embedding on q and k (hpcsgd's convention: pairs (i, i + dk/2),
    angle t * 10000^(-2i/dk)), F.scaled_dot_product_attention with a key-padding mask from the
    lengths, nn.Linear + GLU, the padding zeroed, nn.Conv1d(groups=D) depthwise, nn.LayerNorm
    or the masked instance norm (batch norm with shape["batch_norm"]), SiLU, nn.Linear, a final
    nn.LayerNorm). The same parameter count as hpcsgd's layers."""
    from hpcsgd.model.encoder import parse_spec
    from hpcsgd.model.kernels_conformer import ROPE_BASE
    from hpcsgd.model.kernels_norm import EPS
    F = torch.nn.functional

    def valid_steps(x, lengths):
        """(T, B) bool: step t of sequence b is within its length."""
        return torch.arange(x.shape[0], device=x.device)[:, None] < lengths.to(x.device)[None, :]

    class InstanceNorm(torch.nn.Module):
        """x (T, B, C): each (sequence, channel) over the sequence's valid steps."""
        def __init__(self, width):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(width))
            self.bias = torch.nn.Parameter(torch.zeros(width))

        def forward(self, x, lengths):
            valid = valid_steps(x, lengths).to(x.dtype)[..., None]
            count = valid.sum(0, keepdim=True).clamp(min=1)
            mean = (x * valid).sum(0, keepdim=True) / count
            var = ((x - mean) ** 2 * valid).sum(0, keepdim=True) / count
            return (x - mean) / torch.sqrt(var + EPS) * self.weight + self.bias

    class BatchNorm(torch.nn.Module):
        """x (T, B, C): each channel over the batch's valid steps (all its utterances), as
        DeepSpeech2 and Wave2Letter+ normalize (one process: no cross-rank statistics);
        eval() uses running averages (momentum 0.1, as nn.BatchNorm1d)."""
        def __init__(self, width):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(width))
            self.bias = torch.nn.Parameter(torch.zeros(width))
            self.register_buffer("mean", torch.zeros(width))
            self.register_buffer("var", torch.ones(width))

        def forward(self, x, lengths):
            if self.training:
                valid = valid_steps(x, lengths).to(x.dtype)[..., None]
                count = valid.sum().clamp(min=1)
                mean = (x * valid).sum((0, 1)) / count
                var = ((x - mean) ** 2 * valid).sum((0, 1)) / count
                with torch.no_grad():
                    self.mean.mul_(0.9).add_(0.1 * mean)
                    self.var.mul_(0.9).add_(0.1 * var)
            else:
                mean, var = self.mean, self.var
            return (x - mean) / torch.sqrt(var + EPS) * self.weight + self.bias

    def norm_of(kind, width):
        return torch.nn.LayerNorm(width, eps=EPS) if kind == "ln" else \
            BatchNorm(width) if shape.get("batch_norm") else InstanceNorm(width)

    class Conv2dSubsampling(torch.nn.Module):
        """x (T, B, F) -> (ceil(T/4), B, D): two 3x3 stride-2 nn.Conv2d with ReLU over
        (time, frequency), a Linear of the C x ceil(F/4) values of each output step."""
        def __init__(self, n_in, channels, width):
            super().__init__()
            f1 = -(-n_in // 2)
            f2 = -(-f1 // 2)   # ceil(F/4) frequencies after the two strides
            self.conv1 = torch.nn.Conv2d(1, channels, 3, stride=2, padding=1)
            self.conv2 = torch.nn.Conv2d(channels, channels, 3, stride=2, padding=1)
            self.out = torch.nn.Linear(channels * f2, width)

        def forward(self, x, lengths):
            x = x * valid_steps(x, lengths)[..., None]
            x = torch.relu(self.conv1(x.permute(1, 0, 2)[:, None]))     # (B, C, T1, F1)
            lengths = (lengths + 1) // 2                # the second one reads zeros past them
            valid = torch.arange(x.shape[2], device=x.device)[None, :] \
                < lengths.to(x.device)[:, None]                         # (B, T1)
            x = x * valid[:, None, :, None]
            x = torch.relu(self.conv2(x))                                # (B, C, T2, F2)
            b, c, t, f = x.shape
            x = self.out(x.permute(2, 0, 1, 3).reshape(t, b, c * f))     # channel-major
            return x, (lengths + 1) // 2

    tables = {}   # (steps, dk, dtype, device) -> the rotary (cos, sin), made once

    def rope_tables(steps, dk, dtype, device):
        """cos, sin (steps, dk/2) of the angles t * ROPE_BASE^(-2i/dk), computed in float64
        and rounded once (as hpcsgd's); cached, not buffers (DDP would broadcast those)."""
        key = (steps, dk, dtype, device)
        if key not in tables:
            inv = ROPE_BASE ** (-torch.arange(dk // 2, dtype=torch.float64) * 2.0 / dk)
            angle = torch.arange(steps, dtype=torch.float64)[:, None] * inv[None, :]
            tables[key] = (angle.cos().to(dtype).to(device), angle.sin().to(dtype).to(device))
        return tables[key]

    def rope(x, cos, sin):
        """The rotary embedding of x (B, H, T, dk): pair (i, i + dk/2) of step t turned by
        cos, sin (T, dk/2) of t * ROPE_BASE^(-2i/dk)."""
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)

    class FeedForward(torch.nn.Module):
        def __init__(self, width, ff, p):
            super().__init__()
            self.ln = torch.nn.LayerNorm(width, eps=EPS)
            self.w1, self.w2 = torch.nn.Linear(width, ff), torch.nn.Linear(ff, width)
            self.drop = torch.nn.Dropout(p)

        def forward(self, x):
            return self.drop(self.w2(F.silu(self.w1(self.ln(x)))))

    class ConformerBlock(torch.nn.Module):
        """One Conformer block over x (T, B, D) (hpcsgd/model/conformer.py's algebra):
        x1 = x + FF1/2, x2 = x1 + MHSA, x3 = x2 + Conv, x4 = x3 + FF2/2, LN(x4); dropout on
        each module's output before its residual add."""
        def __init__(self, spec, p):
            super().__init__()
            d, self.heads = spec["units"], spec["heads"]
            self.dk, k = d // self.heads, spec["kernel"]
            self.ff1, self.ff2 = FeedForward(d, spec["ff"], p), FeedForward(d, spec["ff"], p)
            self.mhsa_ln = torch.nn.LayerNorm(d, eps=EPS)
            self.qkv, self.att_out = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
            self.conv_ln = torch.nn.LayerNorm(d, eps=EPS)
            self.pw1 = torch.nn.Linear(d, 2 * d)
            self.dw = torch.nn.Conv1d(d, d, k, padding=(k - 1) // 2, groups=d)
            self.norm_kind = spec["norm"]
            self.conv_norm = norm_of(spec["norm"], d)
            self.pw2 = torch.nn.Linear(d, d)
            self.ln = torch.nn.LayerNorm(d, eps=EPS)
            self.drop = torch.nn.Dropout(p)

        def mhsa(self, x, valid):
            t, b, d = x.shape
            qkv = self.qkv(self.mhsa_ln(x)).view(t, b, 3, self.heads, self.dk)
            q, k, v = qkv.permute(2, 1, 3, 0, 4)               # each (B, H, T, dk)
            cos, sin = rope_tables(t, self.dk, q.dtype, q.device)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            mask = valid.t()[:, None, None, :]                 # (B, 1, 1, T): the keys
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)   # 1/sqrt(dk)
            return self.drop(self.att_out(o.permute(2, 0, 1, 3).reshape(t, b, d)))

        def conv(self, x, valid, lengths):
            u = F.glu(self.pw1(self.conv_ln(x)), dim=-1)      # (T, B, D)
            u = u * valid[..., None]                            # the utterance's steps only
            c = self.dw(u.permute(1, 2, 0)).permute(2, 0, 1)
            c = self.conv_norm(c) if self.norm_kind == "ln" else self.conv_norm(c, lengths)
            return self.drop(self.pw2(F.silu(c)))

        def forward(self, x, lengths):
            valid = valid_steps(x, lengths)
            x = x + 0.5 * self.ff1(x)
            x = x + self.mhsa(x, valid)
            x = x + self.conv(x, valid, lengths)
            x = x + 0.5 * self.ff2(x)
            return self.ln(x)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.specs = [parse_spec(text) for text in shape["encoder"]]
            self.layers = torch.nn.ModuleList()
            n_in = shape["input_dim"]
            for spec in self.specs:
                kind, width = spec["kind"], spec["units"]
                if kind == "stack":
                    layer, width = torch.nn.Identity(), width * n_in
                elif kind == "conv":
                    k, d = spec["kernel"], spec["dilation"]
                    layer = torch.nn.Conv1d(n_in, width, k, stride=spec["stride"],
                                            dilation=d, padding=(k - 1) * d // 2,
                                            bias=not spec["norm"])
                    if spec["ahead"]:
                        raise ValueError("the PyTorch peer has no lookahead convolution "
                                         "(conv ... ahead)")
                    if spec["norm"]:
                        layer = torch.nn.ModuleDict({"conv": layer,
                                                     "norm": norm_of(spec["norm"], width)})
                elif spec.get("chunk"):
                    raise ValueError("the PyTorch peer has no chunked BLSTM (blstm H cC)")
                elif kind in ("blstm", "lstm"):
                    layer = torch.nn.LSTM(n_in, width, bidirectional=kind == "blstm")
                    width *= 2 if kind == "blstm" else 1
                elif kind == "conv2d":
                    layer = Conv2dSubsampling(n_in, spec["channels"], width)
                elif kind == "conformer":
                    layer = ConformerBlock(spec, shape.get("dropout", 0.0))
                else:
                    layer = torch.nn.Linear(n_in, width)
                self.layers.append(layer)
                n_in = width
            self.act = act()
            self.drop = torch.nn.Dropout(shape.get("dropout", 0.0))
            self.logits = out is None
            self.out = torch.nn.Linear(n_in, shape["num_tokens"] if out is None else out)

        def forward(self, x, lengths):
            for spec, layer in zip(self.specs, self.layers):
                kind = spec["kind"]
                if kind == "stack":
                    k, (t, b, d) = spec["units"], x.shape
                    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, -t % k))
                    x = x.view(-1, k, b, d).permute(0, 2, 1, 3).reshape(-1, b, k * d)
                    lengths = (lengths + k - 1) // k
                elif kind == "conv":
                    lengths = (lengths + spec["stride"] - 1) // spec["stride"]
                    if spec["norm"] == "ln":
                        x = layer["conv"](x.permute(1, 2, 0)).permute(2, 0, 1)
                        x = self.act(layer["norm"](x))
                    elif spec["norm"] == "in":
                        x = layer["conv"](x.permute(1, 2, 0)).permute(2, 0, 1)
                        x = self.act(layer["norm"](x, lengths))
                    else:
                        x = self.act(layer(x.permute(1, 2, 0))).permute(2, 0, 1)
                    x = x * valid_steps(x, lengths)[..., None]
                elif kind in ("blstm", "lstm"):
                    packed = torch.nn.utils.rnn.pack_padded_sequence(x, lengths.cpu())
                    x, _ = torch.nn.utils.rnn.pad_packed_sequence(layer(packed)[0],
                                                                  total_length=x.shape[0])
                elif kind == "conv2d":
                    x, lengths = layer(x, lengths)
                    x = x * valid_steps(x, lengths)[..., None]
                elif kind == "conformer":
                    x = layer(x, lengths) * valid_steps(x, lengths)[..., None]
                else:
                    x = self.act(layer(x))
                if kind not in ("stack", "conformer"):   # a block drops inside it
                    x = self.drop(x)
            x = self.out(x)
            return (torch.nn.functional.log_softmax(x, dim=-1) if self.logits else x), lengths
    return Net()


def TransducerModel(torch, shape, act):
    """An RNN-T as torchaudio's recipes write it (torchaudio.models.RNNT: transcriber,
    predictor, joiner), layer for layer hpcsgd's (model/transducer.py): CTCModel's encoder
    ending in the joint projection; nn.Embedding over the tokens (the blank, id 0, as the start
    symbol), nn.LSTM layers, a Linear to the joint; tanh(enc + pred) (or enc * pred) over the
    padded (B, T', U+1, J) lattice and a Linear to the tokens: the (B, T', U+1, V) logits
    torchaudio.functional.rnnt_loss takes. forward(x, lengths, targets (B, U) padded with 0)
    -> (logits, output lengths)."""
    from hpcsgd.model.encoder import parse_spec

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            j, v = shape["joint"], shape["num_tokens"]
            self.encoder = CTCModel(torch, shape, act, out=j)
            self.embed = torch.nn.Embedding(v, shape["embed"])
            self.lstms, n_in = torch.nn.ModuleList(), shape["embed"]
            for text in shape["predictor"]:
                width = parse_spec(text)["units"]
                self.lstms.append(torch.nn.LSTM(n_in, width))
                n_in = width
            self.pred_out = torch.nn.Linear(n_in, j)
            self.joint_out = torch.nn.Linear(j, v)
            self.mul = shape["joint_mode"] == "mul"

        def forward(self, x, lengths, targets):
            enc, lengths = self.encoder(x, lengths)            # (T', B, J)
            y = torch.nn.functional.pad(targets, (1, 0)).t()   # (U+1, B): blank first
            p = self.embed(y)
            for lstm in self.lstms:
                p, _ = lstm(p)
            p = self.pred_out(p)                               # (U+1, B, J)
            e, p = enc.permute(1, 0, 2)[:, :, None], p.permute(1, 0, 2)[:, None]
            h = torch.tanh(e * p if self.mul else e + p)       # (B, T', U+1, J)
            return self.joint_out(h), lengths
    return Net()


# variant -> (the hpcsgd precision it stands beside, autocast dtype name or None, compiled)
VARIANTS = {"pytorch": ("float32", None, False), "pytorch_amp16": ("mixed", "float16", False),
            "pytorch_bf16": ("bf16", "bfloat16", False),
            "pytorch_compiled": ("float32", None, True)}


def variants_for(precisions, device, compiled, world):
    """The PyTorch variants a bench run times: float32 eager always; AMP beside each hpcsgd
    precision that has one (float16 AMP on a GPU only: CPU autocast is bfloat16's);
    torch.compile on request, on one rank (a compiled DDP module is another comparison)."""
    out = ["pytorch"]
    if "mixed" in precisions and device == "cuda":
        out.append("pytorch_amp16")
    if "bf16" in precisions:
        out.append("pytorch_bf16")
    if compiled and world == 1:
        out.append("pytorch_compiled")
    return out


class TorchRank:
    def __init__(self, comm, shape, activation, max_local, threads, lr=1e-6, momentum=0.9,
                 device="cpu", variants=("pytorch",), targets=None):
        try:
            import torch
        except ImportError:
            raise SystemExit("bench train --pytorch: PyTorch is not installed "
                             "(pip install torch==2.13.0)") from None
        self.torch, self.comm = torch, comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        torch.set_num_threads(threads)
        self.dev = torch.device("cpu")
        backend = "gloo"
        if device == "cuda":
            from hpcsgd.comm.gpu import BOUND, shared_gpus
            index = BOUND[0] if BOUND is not None else 0
            torch.cuda.set_device(index)
            self.dev = torch.device("cuda", index)
            torch.backends.cuda.matmul.allow_tf32 = False   # float32 GEMMs, as hpcsgd's
            torch.backends.cudnn.allow_tf32 = False
            backend = "nccl" if self.world > 1 and not shared_gpus(comm) else "gloo"
        self.cuda = self.dev.type == "cuda"
        act = torch.nn.Sigmoid if activation == "sigmoid" else torch.nn.ReLU
        fam = of_model(shape)
        self.shape, self.rnnt = shape, fam.CRITERION == "rnnt"   # torchaudio's loss
        self.ctc = fam.UTTERANCES   # utterances with token targets
        self.steps = shape["steps"] if fam.SEQUENCES else None
        if self.rnnt:
            try:
                import warnings

                import torchaudio.functional
                warnings.filterwarnings("ignore", message=".*_rnnt_loss has been deprecated")
            except ImportError:
                raise SystemExit("bench train --pytorch: the transducer peer needs torchaudio's "
                                 "rnnt_loss (torch 2.9.1 + torchaudio 2.9 in the Python that "
                                 "runs hpcsgd: docs/benchmarks.md)") from None
            self.rnnt_loss = torchaudio.functional.rnnt_loss
        if self.world > 1:
            import torch.distributed as dist
            port = None
            if self.rank == 0:
                with socket.socket() as s:   # a free port on this host
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
            port = comm.bcast(port, root=0)   # lowercase: one int, once
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}",
                                    rank=self.rank, world_size=self.world)
        self.runs = {}   # variant -> (model, optimizer, autocast dtype, GradScaler)
        for name in variants:
            _, amp, compiled = VARIANTS[name]
            torch.manual_seed(0)   # replicas start equal, as hpcsgd's do
            model = self._model(torch, shape, act).to(self.dev)
            if self.world > 1:
                model = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=[self.dev.index] if self.cuda else None)
            if compiled:
                model = torch.compile(model, mode="reduce-overhead")
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            scaler = torch.amp.GradScaler(self.dev.type) if amp == "float16" else None
            self.runs[name] = (model, opt, getattr(torch, amp) if amp else None, scaler)
        self.loss = torch.nn.CrossEntropyLoss(reduction="sum")
        rng = np.random.default_rng(1 + self.rank)
        self.x = torch.from_numpy(rng.standard_normal((max_local, shape["input_dim"]),
                                                      dtype=np.float32)).to(self.dev)
        if self.ctc:   # summed over the utterances, as hpcsgd's; hpcsgd's targets of n frames
            self.loss = torch.nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)
            self.targets = targets
        else:
            self.y = torch.from_numpy(rng.integers(0, shape["num_labels"],
                                                   max_local)).to(self.dev)

    def _model(self, torch, shape, act):
        if self.rnnt:
            return TransducerModel(torch, shape, act)
        if self.ctc:
            return CTCModel(torch, shape, act)
        if self.steps:   # nn.LSTM on time-major (T, B, D) input, the usual recipe
            return SequenceModel(torch, shape, act)
        dims = [shape["input_dim"], *shape["hidden"]]
        layers = []
        for n_in, n_out in zip(dims[:-1], dims[1:]):
            layers += [torch.nn.Linear(n_in, n_out), act()]
        layers.append(torch.nn.Linear(dims[-1], shape["num_labels"]))
        return torch.nn.Sequential(*layers)

    def _sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def loop(self, take, steps, warmup, variant="pytorch"):
        """`steps` timed training steps after `warmup`, take[rank] frames each: (this rank's
        step times, seconds per step by category, {}) as hpcsgd's loop reports them -- all of
        it "compute": DDP runs its allreduce inside the backward pass, not apart."""
        torch = self.torch
        model, opt, amp, scaler = self.runs[variant]
        n = int(take[self.rank])
        x = self.x[:n] if not self.steps else self.x[:n].view(self.steps, -1, self.x.shape[1])
        loss_of = ((lambda out: self.loss(out, y)) if not self.ctc else
                   self._rnnt_loss(n) if self.rnnt else self._ctc_loss(n))
        inputs = (x,) if not self.ctc else (x, torch.full((x.shape[1],), x.shape[0],
                                                          dtype=torch.long))
        if self.rnnt:   # the predictor reads the targets
            inputs += (self._targets(n)[0],)
        y = self.y[:n] if not self.ctc else None
        marks = []
        self._sync()
        self.comm.Barrier()
        for s in range(warmup + steps):
            marks.append(time.perf_counter())
            opt.zero_grad(set_to_none=False)
            with (torch.autocast(self.dev.type, dtype=amp) if amp is not None
                  else contextlib.nullcontext()):
                loss = loss_of(model(*inputs))
            if scaler is not None:
                scaler.scale(loss).backward()   # DDP: the allreduce overlaps the backward
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
            self._sync()
        marks.append(time.perf_counter())
        times = np.diff(marks)[warmup:]
        if not np.isfinite(float(loss.detach())):
            raise FloatingPointError(f"rank {self.rank}: PyTorch ({variant}) loss "
                                     f"{float(loss.detach())}")
        return times, {"compute": float(times.mean()), "encode": 0.0, "communicate": 0.0,
                       "update": 0.0}, {}

    def _targets(self, n):
        """The targets hpcsgd's step of n frames has (hpcsgd/bench/train.py,
        utterance_targets; all of one length): ((B, U) int64 tensor, (B,) lengths)."""
        torch = self.torch
        t = self.targets(n)
        per = int(t.offsets[1]) if len(t.frames) else 0
        targets = torch.from_numpy(t.ids.astype(np.int64)).view(len(t.frames), per).to(self.dev)
        return targets, torch.full((len(t.frames),), per, dtype=torch.long)

    def _ctc_loss(self, n):
        """nn.CTCLoss of n frames' utterances, the output lengths after the strides."""
        targets, target_lengths = self._targets(n)
        return lambda out: self.loss(out[0].float(), targets, out[1], target_lengths)

    def _rnnt_loss(self, n):
        """torchaudio's RNN-T loss (its fused log-softmax), summed over the utterances as
        hpcsgd's."""
        targets, target_lengths = self._targets(n)
        targets, target_lengths = targets.int(), target_lengths.int().to(self.dev)
        return lambda out: self.rnnt_loss(out[0].float(), targets, out[1].int().to(self.dev),
                                          target_lengths, blank=0, reduction="sum")

    def bytes_on_wire(self, size):
        """A ring allreduce of the float32 gradient: 2 (K-1)/K of it per rank."""
        return int(2 * (self.world - 1) * size * 4 / self.world)

    def close(self):
        if self.world > 1:
            self.torch.distributed.destroy_process_group()
