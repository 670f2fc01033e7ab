"""The PyTorch peer's Conformer (hpcsgd/bench/pytorch.py: CTCModel on "conv2d C D" and
"conformer D hH fF kK [ln|in]") computes what hpcsgd's does: an hpcsgd Conformer-CTC model's
initialised weights copied into the torch model, the same padded time-major batch through
both, then the log-posteriors, the summed CTC loss and every parameter's gradient compared.
A check run by hand (seconds; PyTorch is a benchmark peer: pip install torch==2.13.0):

    python experiments/pytorch_conformer_parity.py [--norm ln|in] [--dtype float32|float64] \
        [--input-dim 40]

hpcsgd's model: {"type": "ctc", "input_dim": 40, "encoder": ["conv2d 8 16",
"conformer 16 h2 f32 k5"], "num_tokens": 9} (`--norm in`: the block's instance norm),
initialised by hpcsgd (seed 0); 4 utterances of 37, 30, 22 and 9 frames, zero-padded,
time-major. In float64 both sides agree to float64 rounding (hpcsgd's CTC loss then taken
from its float64 reference, model/kernels_ctc.py: the kernel's recursions are float32).

Each comparison is printed as the largest absolute difference and that relative to the
largest value compared; the script exits 1 when one is above its tolerance (float32: 1e-4
absolute on the log-posteriors, 1e-4 relative on the loss and the gradients, a few float32
roundings of sums of a few hundred terms; float64: 1e-9).

hpcsgd's layouts, turned into PyTorch's by `torch_weights`: a linear map's W is (n_in, n_out),
used as x @ W (nn.Linear's weight is its transpose); the fused q, k, v projection is one
(D, 3D) matrix, columns q | k | v, head h at h*dk within each (the torch model splits its
nn.Linear(D, 3D) output the same way); the Conv2d front end's weights are unfolded patches,
row (i*3 + j)*Ci + c for time tap i, frequency tap j, input channel c (nn.Conv2d's
(Co, Ci, 3, 3)); its linear map reads rows of F' x C values frequency-major, where the torch
model flattens (C, F') channel-major (ESPnet's order), so out.w's rows are permuted; the
depthwise taps are (K, D) (nn.Conv1d(groups=D)'s (D, 1, K)); norms' gains and shifts (1, D).
"""
import sys

import numpy as np
import torch

from hpcsgd.bench.pytorch import CTCModel
from hpcsgd.data.utterances import Targets
from hpcsgd.model import build
from hpcsgd.model import kernels_ctc as KCTC


def torch_weights(net, params, model):
    """{torch parameter name: (hpcsgd name, to_torch, to_hpcsgd)}: the linear maps between
    the two layouts (to_torch of an hpcsgd array gives the torch tensor's values; to_hpcsgd
    back). Every parameter of both models is named exactly once (checked)."""
    def lin(a):     # (n_in, n_out) <-> (n_out, n_in)
        return a.T

    def vec(a):     # (1, n) <-> (n,)
        return a.reshape(-1)

    out = {}
    ti = 0   # the torch model's layer index is the spec's
    for layer in net.layers[:-1]:
        n = layer.name
        t = f"layers.{ti}"
        ti += 1
        if type(layer).__name__ == "Conv2dSubsampling":
            c, f2, d = layer.channels, layer.f2, layer.n_out
            for conv, ci in (("conv1", 1), ("conv2", c)):
                out[f"{t}.{conv}.weight"] = (
                    f"{n}.{conv}.w",
                    lambda a, ci=ci: a.reshape(3, 3, ci, c).transpose(3, 2, 0, 1),
                    lambda a, ci=ci: a.transpose(2, 3, 1, 0).reshape(9 * ci, c))
                out[f"{t}.{conv}.bias"] = (f"{n}.{conv}.b", vec, vec)
            # hpcsgd row f*C + c <-> torch column c*F' + f
            out[f"{t}.out.weight"] = (
                f"{n}.out.w", lambda a: a.reshape(f2, c, d).transpose(2, 1, 0).reshape(d, c * f2),
                lambda a: a.reshape(d, c, f2).transpose(2, 1, 0).reshape(f2 * c, d))
            out[f"{t}.out.bias"] = (f"{n}.out.b", vec, vec)
            continue
        k, d = layer.kernel, layer.n_in
        pairs = {"ff1.ln": "ff1.ln", "ff1.w1": "ff1.w1", "ff1.w2": "ff1.w2",
                 "mhsa_ln": "mhsa.ln", "qkv": "mhsa.qkv", "att_out": "mhsa.out",
                 "conv_ln": "conv.ln", "pw1": "conv.w1", "dw": "conv.dw",
                 "conv_norm": "conv.norm", "pw2": "conv.w2",
                 "ff2.ln": "ff2.ln", "ff2.w1": "ff2.w1", "ff2.w2": "ff2.w2", "ln": "ln"}
        for tn, hn in pairs.items():
            if hn.endswith("ln") or hn == "conv.norm":   # gain, shift
                out[f"{t}.{tn}.weight"] = (f"{n}.{hn}.g", vec, vec)
                out[f"{t}.{tn}.bias"] = (f"{n}.{hn}.b", vec, vec)
            elif hn == "conv.dw":                        # (K, D) <-> (D, 1, K)
                out[f"{t}.{tn}.weight"] = (f"{n}.{hn}.w", lambda a: a.T[:, None, :],
                                           lambda a, k=k, d=d: a[:, 0, :].T.reshape(k, d))
                out[f"{t}.{tn}.bias"] = (f"{n}.{hn}.b", vec, vec)
            else:
                out[f"{t}.{tn}.weight"] = (f"{n}.{hn}.w", lin, lin)
                out[f"{t}.{tn}.bias"] = (f"{n}.{hn}.b", vec, vec)
    last = net.layers[-1]
    out["out.weight"] = (last.W, lin, lin)
    out["out.bias"] = (last.b, vec, vec)
    names = {name for name, _ in model.named_parameters()}
    hp = {s.name for layer in net.layers for s in layer.specs()}
    assert names == set(out), (sorted(names ^ set(out)))
    assert hp == {h for h, _, _ in out.values()}, sorted(hp ^ {h for h, _, _ in out.values()})
    return out


def ref_ctc_loss(z, b, targets, lengths, gb, scale=1.0):
    """CpuOps.ctc_loss's contract on kernels_ctc.ref_ctc (float64 throughout): z <- scale *
    dLoss/d(z + b), gb <- its column sums; (loss summed, tokens, utterances skipped)."""
    loss, grad, feasible = KCTC.ref_ctc(z, b, lengths.nb, lengths.lengths, targets.ids,
                                        targets.offsets)
    z[...] = scale * grad
    gb[...] = z.sum(0, keepdims=True)
    return float(loss.sum()), len(targets.ids), lengths.nb - int(feasible.sum())


def report(what, got, want, tol, relative):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    diff = float(np.max(np.abs(got - want))) if got.size else 0.0
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    rel = diff / scale if scale else diff
    ok = (rel if relative else diff) <= tol
    print(f"  {what:<34} max |diff| {diff:.3e}  relative {rel:.3e}  (max |value| {scale:.3e})"
          f"{'' if ok else '  <-- above ' + format(tol, 'g')}")
    return ok


def main(argv):
    norm = argv[argv.index("--norm") + 1] if "--norm" in argv else "ln"
    dtype = np.dtype(argv[argv.index("--dtype") + 1] if "--dtype" in argv else "float32")
    tdtype = {np.float32: torch.float32, np.float64: torch.float64}[dtype.type]
    dim = int(argv[argv.index("--input-dim") + 1]) if "--input-dim" in argv else 40
    tol = 1e-4 if dtype == np.float32 else 1e-9
    encoder = ["conv2d 8 16", "conformer 16 h2 f32 k5" + (" in" if norm == "in" else "")]
    describe = {"type": "ctc", "input_dim": dim, "encoder": encoder, "num_tokens": 9,
                "activation": "relu"}
    frames = [37, 30, 22, 9]             # time-major, longest first: 10, 8, 6, 3 output steps
    nb, steps = len(frames), frames[0]
    net = build(describe, max_batch=steps * nb, dtype=dtype)
    params, grads = net.new_params(), net.new_params()
    net.init(params, np.random.default_rng(0))

    torch.manual_seed(0)
    model = CTCModel(torch, {"input_dim": dim, "encoder": encoder, "num_tokens": 9},
                     torch.nn.ReLU).to(tdtype)
    table = torch_weights(net, params, model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            h, to_torch, _ = table[name]
            p.copy_(torch.from_numpy(np.ascontiguousarray(to_torch(params[h]))))
    n_torch = sum(p.numel() for p in model.parameters())
    print(f"{describe['encoder']} -> CTC {describe['num_tokens']}, {dtype.name}, utterances "
          f"{frames}: parameters hpcsgd {net.size}, torch {n_torch}")
    ok = net.size == n_torch

    rng = np.random.default_rng(1)
    x = np.zeros((steps, nb, dim), dtype)
    for b, f in enumerate(frames):
        x[:f, b] = rng.standard_normal((f, dim))
    x = x.reshape(steps * nb, dim)
    tokens = [4, 3, 2, 1]
    ids = rng.integers(1, 9, sum(tokens)).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
    targets = Targets(np.array(frames, np.int64), ids, offsets)

    if dtype == np.float64:
        # hpcsgd's CTC kernel runs its recursions in float32 whatever the model's dtype
        # (model/kernels_ctc.py): a float64 check of the encoder's gradients takes the loss
        # from the kernel's float64 reference instead
        net.ops.ctc_loss = ref_ctc_loss

    # hpcsgd: log-posteriors (time-major at the output's lengths), loss and gradients
    logp = net.forward(params, x, len(x), lengths=frames).copy()
    out = net.out_lengths(len(x), frames)
    loss, _ = net.forward_backward(params, grads, x, targets, len(x))

    # torch: the same batch, nn.CTCLoss summed over the utterances
    model.eval()   # no dropout (none configured; eval() all the same)
    xs = torch.from_numpy(x).view(steps, nb, dim)
    tlogp, tlen = model(xs, torch.tensor(frames))
    tloss = torch.nn.CTCLoss(blank=0, reduction="sum")(
        tlogp, torch.from_numpy(ids.astype(np.int64)), tlen, torch.tensor(tokens))
    tloss.backward()
    print(f"  output lengths hpcsgd {out.lengths.tolist()}, torch {tlen.tolist()}")
    ok &= out.lengths.tolist() == tlen.tolist()
    valid = (np.arange(out.steps)[:, None] < out.lengths[None, :]).reshape(-1)
    tl = tlogp.detach().numpy().reshape(-1, 9)
    ok &= report("log-posteriors (valid rows)", logp[valid], tl[valid], tol, False)
    ok &= report("CTC loss", [loss], [tloss.item()], tol, True)
    print(f"  CTC loss hpcsgd {loss:.8f}, torch {tloss.item():.8f}")
    rows = []   # (relative, hpcsgd name, max |diff|, max |torch gradient|)
    biggest = max(float(p.grad.abs().max()) for p in model.parameters())
    for name, p in model.named_parameters():
        h, _, to_hpcsgd = table[name]
        g = to_hpcsgd(p.grad.numpy())
        diff, scale = float(np.max(np.abs(grads[h] - g))), float(np.max(np.abs(g)))
        if norm == "in" and h.endswith("conv.dw.b"):
            # 0 in exact arithmetic: the instance norm after the depthwise convolution takes
            # each channel's mean over the utterance, so a per-channel shift has no effect;
            # both sides' values are rounding noise, measured against the largest gradient
            print(f"  gradient {h:<26} 0 in exact arithmetic (the instance norm removes it): "
                  f"hpcsgd {float(np.max(np.abs(grads[h]))):.3e}, torch {scale:.3e}")
            scale = biggest
        rows.append((diff / scale if scale else diff, h, diff, scale))
    shown = ("enc.0.conv1.w", "enc.0.out.w", "enc.1.ff1.w1.w", "enc.1.mhsa.qkv.w",
             "enc.1.conv.dw.w", "enc.1.conv.norm.g", "enc.1.ln.g", "W2")
    for rel, h, diff, scale in rows:
        if h in shown:
            print(f"  gradient {h:<26} max |diff| {diff:.3e}  relative {rel:.3e}  "
                  f"(max |value| {scale:.3e})")
    rel, h, diff, scale = max(rows)
    ok &= rel <= tol
    print(f"  every gradient ({len(rows)} tensors): worst relative difference {rel:.3e} ({h}: "
          f"max |diff| {diff:.3e} of {scale:.3e}){'' if rel <= tol else '  <-- above tolerance'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
