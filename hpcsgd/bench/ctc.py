"""`hpcsgd bench ctc`: the fused CTC loss kernel (hpcsgd.model.kernels_ctc.ctc_loss_grad: the
loss and the gradient of the logits) on the shapes users train, as ms per call, as GB/s of the
bytes that must move and as a fraction of the triad timed in alternation with it, and beside
PyTorch's CPU ctc_loss when PyTorch is importable.

    hpcsgd bench ctc [--small] [--json FILE] [--compare OLD] [--threads N] [--repeats N]
                     [--shapes so762,char,bpe,ds2] [--device cpu|cuda]

Shapes (B utterances, T frames, U targets, V labels): so762 phone CTC (16, 150, 25, 41),
character CTC (16, 300, 60, 29), BPE (16, 150, 30, 500), DeepSpeech2 on LibriSpeech
(32, 800, 200, 29). Utterance b has frames from T down to 0.7 T (sorted, the first T, the
rest padding) and round(U f_b / T) random targets, some repeated.

Bytes that must move: the logits read and the gradient written (2 * 4 * T*B*V) plus alpha
and beta written once (2 * 4 * sum of f_b (2 U_b + 1)); the kernel re-reads both, mostly
from cache. The call works in place, so each timed call runs on the previous call's
gradient (finite values of the same shape: the same work).

PyTorch (not a dependency; `pip install torch==2.13.0` beside hpcsgd for this column): the
same logits as a (T, B, V) float32 tensor, log_softmax + F.ctc_loss(reduction="sum",
zero_infinity=True) + backward to the logits, torch.set_num_threads(ours); `torch/ours` > 1
means hpcsgd's kernel is faster. Without PyTorch the column is skipped and the output says so.

--device cuda: the CUDA kernel (hpcsgd.model.kernels_ctc_cuda: one block per utterance) on the
device, each call timed to its end (a synchronize), its limit the device-to-device copy of
the same number of bytes measured in the same rounds, and PyTorch's CUDA ctc_loss (cuDNN's
or its own) beside it on the same card.
"""

import numpy as np

from hpcsgd.bench import membw
from hpcsgd.model import kernels_ctc as KC

SHAPES = {   # name: (B, T, U, V)
    "so762": (16, 150, 25, 41),
    "char": (16, 300, 60, 29),
    "bpe": (16, 150, 30, 500),
    "ds2": (32, 800, 200, 29),
}
SMALL = {"so762": (4, 30, 5, 41), "bpe": (4, 20, 4, 500)}


def add_arguments(parser):
    membw.add_loss_bench_arguments(parser, SHAPES)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: the CUDA kernel and PyTorch's CUDA ctc_loss, against the "
                             "device's copy bandwidth")


def make_batch(shape, rng):
    """(z, bias, frames, ids, tgt_offsets) of a shape: frames T down to 0.7 T, sorted;
    targets in 1..V-1, a fifth of them repeating the one before (every shape here leaves
    U + repeats well below the frames: all feasible, which bench_shape checks)."""
    nb, t, u, v = shape
    frames = np.sort(rng.integers(int(0.7 * t), t + 1, nb))[::-1].astype(np.int64)
    frames[0] = t
    lengths = np.maximum(1, np.rint(u * frames / t)).astype(np.int64)
    ids = rng.integers(1, v, int(lengths.sum())).astype(np.int32)
    repeat = rng.random(ids.size) < 0.2
    offsets = np.zeros(nb + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    repeat[offsets[:-1]] = False                       # a target's first label repeats nothing
    for i in np.flatnonzero(repeat):
        ids[i] = ids[i - 1]
    z = rng.standard_normal((t * nb, v)).astype(np.float32)
    bias = (0.1 * rng.standard_normal((1, v))).astype(np.float32)
    return z, bias, frames, ids, offsets


def torch_timer(z, frames, ids, offsets, nb, threads, device="cpu"):
    """A call of PyTorch's CTC loss and its gradient on the same batch (on the GPU: to its
    end); None without torch."""
    try:
        import torch
    except ImportError:
        return None
    if device == "cuda" and not torch.cuda.is_available():   # a CPU build, or the simulator
        return None
    torch.set_num_threads(threads)
    dev = torch.device("cuda" if device == "cuda" else "cpu")
    t = z.shape[0] // nb
    x = torch.from_numpy(z.reshape(t, nb, z.shape[1]).copy()).to(dev).requires_grad_()
    targets = torch.from_numpy(ids.astype(np.int64)).to(dev)
    in_len = torch.from_numpy(frames.copy())
    tgt_len = torch.from_numpy(np.diff(offsets))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    def call():
        lp = torch.nn.functional.log_softmax(x, dim=2)
        loss = torch.nn.functional.ctc_loss(lp, targets, in_len, tgt_len, blank=0,
                                            reduction="sum", zero_infinity=True)
        loss.backward()
        x.grad = None
        sync()
    return call


def cuda_timers(z, bias, frames, ids, offsets, ws, nb, moved):
    """(ours, copy): the CUDA kernel on device copies of the batch, and a device-to-device
    copy of `moved` bytes, each timed to its end."""
    from hpcsgd.lazy_cuda import cuda
    from hpcsgd.model import kernels_ctc_cuda as KCC
    dev = [cuda.to_device(a) for a in (z, bias, frames, ids, offsets, ws)]
    g, d_bias, d_frames, d_ids, d_off, d_ws = dev
    alpha = cuda.device_array(max(int(ws[-1]), 1), np.float32)
    beta = cuda.device_array(max(int(ws[-1]), 1), np.float32)
    loss, feasible = cuda.device_array(nb, np.float64), cuda.device_array(nb, np.uint8)
    src = cuda.device_array(max(moved // 4, 1), np.float32)
    dst = cuda.device_array(max(moved // 4, 1), np.float32)

    def ours():
        KCC.ctc_loss_grad(g, d_bias, nb, d_frames, d_ids, d_off, 1.0, d_ws, alpha, beta, loss,
                          feasible)
        cuda.synchronize()

    def copy():
        dst.copy_to_device(src)
        cuda.synchronize()
    return ours, copy, (loss, feasible)


def bench_shape(name, shape, repeats, rng, triad, threads, device="cpu"):
    """Best-of-`repeats` times of ours, PyTorch's and the triad (the device copy on a GPU),
    timed in alternation (each round one of each), so all three see the same neighbours on
    a shared machine."""
    nb, t, u, v = shape
    z, bias, frames, ids, offsets = make_batch(shape, rng)
    ws = KC.workspace_offsets(frames, offsets)
    if device == "cuda":
        ours, copy, (d_loss, d_feasible) = cuda_timers(
            z, bias, frames, ids, offsets, ws, nb, 2 * 4 * t * nb * v + 2 * 4 * int(ws[-1]))
        ours()   # compile and first touch
        loss, feasible = d_loss.copy_to_host(), d_feasible.copy_to_host()
        triad = (copy, 2 * (2 * 4 * t * nb * v + 2 * 4 * int(ws[-1])))   # read + write
    else:
        alpha, beta = np.empty(ws[-1], np.float32), np.empty(ws[-1], np.float32)
        loss, feasible = np.empty(nb), np.empty(nb, np.uint8)
        g = z.copy()

        def ours():
            KC.ctc_loss_grad(g, bias, nb, frames, ids, offsets, 1.0, ws, alpha, beta, loss,
                             feasible)

        ours()   # compile (cached) and first touch
    assert feasible.all() and np.isfinite(loss).all()
    first_loss = float(loss.sum())
    theirs = torch_timer(z, frames, ids, offsets, nb, threads, device)
    if theirs:
        theirs()
    t_ours = t_torch = t_tri = float("inf")
    for _ in range(repeats):
        t_tri = min(t_tri, membw.best_time(triad[0], 1))
        t_ours = min(t_ours, membw.best_time(ours, 1))
        if theirs:
            t_torch = min(t_torch, membw.best_time(theirs, 1))
    workspace = 2 * 4 * int(ws[-1])
    moved = 2 * 4 * t * nb * v + workspace
    return {"shape": name, "B": nb, "T": t, "U": u, "V": v, "frames": int(frames.sum()),
            "loss": first_loss, "ms": 1e3 * t_ours, "bytes": moved, "workspace_bytes": workspace,
            "GBps": moved / t_ours / 1e9, "triad_GBps": triad[1] / t_tri / 1e9,
            "torch_ms": 1e3 * t_torch if theirs else None,
            "vs_torch": t_torch / t_ours if theirs else None}


def run(args):
    threads, repeats, table = membw.loss_bench_settings(args, SHAPES, SMALL, "ctc")
    small, names = args.small, list(table)
    try:
        import torch
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    print(f"hpcsgd bench ctc: {args.device}, {threads} threads, "
          f"{'small' if small else 'training'} shapes, "
          f"best of {repeats}, in alternation with the triad"
          + (f" and PyTorch {torch_version}" if torch_version else ""))
    if not torch_version:
        print("PyTorch is not installed: its column is skipped "
              "(pip install torch==2.13.0 beside hpcsgd for the comparison)")
    triad = membw.triad_timer((8 << 20) if small else (200 << 20))
    rng = np.random.default_rng(0)
    rows = []
    for name in names:
        rows.append(bench_shape(name, table[name], repeats, rng, triad, threads, args.device))
    best_triad = max(r["triad_GBps"] for r in rows)
    print(f"{'shape':8} {'B':>3} {'T':>4} {'U':>4} {'V':>4} {'ms':>8} {'GB/s':>7} "
          f"{'of triad':>8} {'torch ms':>9} {'torch/ours':>10}")
    for r in rows:
        r["frac_triad"] = r["GBps"] / r["triad_GBps"]
        torch_cols = (f"{r['torch_ms']:9.2f} {r['vs_torch']:10.2f}" if r["torch_ms"] is not None
                      else f"{'-':>9} {'-':>10}")
        print(f"{r['shape']:8} {r['B']:3d} {r['T']:4d} {r['U']:4d} {r['V']:4d} {r['ms']:8.2f} "
              f"{r['GBps']:7.2f} {r['frac_triad']:8.1%} {torch_cols}")
    limit = "device copy" if args.device == "cuda" else "triad"
    print(f"{limit} {min(r['triad_GBps'] for r in rows):.1f}..{best_triad:.1f} GB/s (timed in "
          f"alternation with each shape; each row is judged against its own; the column "
          f"'of triad' is of this). Bytes: logits read + gradient written + alpha and beta "
          f"written.")
    return {"threads": threads, "small": small, "repeats": repeats, "torch": torch_version,
            "device": args.device, "triad_GBps": best_triad, "rows": rows}


def figures(res):
    out = {"triad GB/s": res["triad_GBps"]}
    for r in res["rows"]:
        out[f"{r['shape']} ms"] = r["ms"]
        out[f"{r['shape']} GB/s"] = r["GBps"]
        out[f"{r['shape']} of triad"] = r["frac_triad"]
        if r["vs_torch"] is not None:
            out[f"{r['shape']} torch/ours"] = r["vs_torch"]
    return out
