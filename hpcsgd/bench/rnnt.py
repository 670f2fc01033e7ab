"""`hpcsgd bench rnnt`: the fused RNN-T loss kernel (hpcsgd.model.kernels_rnnt.rnnt_loss_grad:
the loss and the gradient of the joint's logits, over packed lattices) on the shapes users
train, as ms per call, as GB/s of the bytes that must move and as a fraction of the triad
timed in alternation with it, and beside torchaudio's rnnt_loss (warp-transducer's CPU code)
on the same logits: the loss values, the time, the memory.

    hpcsgd bench rnnt [--small] [--shapes so762,char,bpe] [--threads N] [--repeats N]
                      [--torchaudio-python PYTHON] [--json FILE]

Shapes (B utterances, T encoder frames, U targets, V labels): so762 phone RNN-T
(8, 150, 25, 41), character (8, 300, 60, 29), BPE (8, 150, 30, 500). Utterance b has frames
from T down to 0.7 T and round(U f_b / T) random targets; its lattice f_b x (U_b + 1) rows,
packed (no padding).

Bytes that must move: the logits read twice and written twice (the in-place log-softmax, then
the gradient: 16 bytes per logit) plus alpha and beta written once (8 bytes per node).
Memory: ours is exact -- the packed logits (overwritten by the gradient) and alpha and beta;
the kernel allocates nothing else. torchaudio's: the logits padded to (B, T, Umax + 1, V) it
takes, plus what torch's allocator hands out during one call (the profiler's self CPU memory
of every op, summed: the gradient of the padded logits, its workspaces).

torchaudio is a benchmark peer, never a dependency: torchaudio 2.9 needs torch 2.9.1, so it
runs in its own interpreter (--torchaudio-python, a venv with `pip install torch==2.9.1
'torchaudio==2.9.*'`; hpcsgd/bench/rnnt_torchaudio.py imports no hpcsgd). Without it the
column is skipped and the output says so.
"""
import json
import os
import subprocess
import tempfile

import numpy as np

from hpcsgd.bench import membw
from hpcsgd.model import kernels_rnnt as KR

SHAPES = {   # name: (B, T, U, V)
    "so762": (8, 150, 25, 41),
    "char": (8, 300, 60, 29),
    "bpe": (8, 150, 30, 500),
}
SMALL = {"so762": (4, 30, 5, 41), "bpe": (2, 20, 4, 500)}
PEER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rnnt_torchaudio.py")


def add_arguments(parser):
    membw.add_loss_bench_arguments(parser, SHAPES)
    parser.add_argument("--torchaudio-python", default=None,
                        help="a Python that imports torchaudio (torch 2.9.1 + torchaudio 2.9): "
                             "its rnnt_loss beside ours")


def make_batch(shape, rng):
    """(z packed (N, V), frames, ids, tgt_offsets, row_offsets) of a shape."""
    nb, t, u, v = shape
    frames = np.sort(rng.integers(int(0.7 * t), t + 1, nb))[::-1].astype(np.int64)
    frames[0] = t
    lengths = np.maximum(1, np.rint(u * frames / t)).astype(np.int64)
    ids = rng.integers(1, v, int(lengths.sum())).astype(np.int32)
    tgt = np.zeros(nb + 1, np.int64)
    tgt[1:] = np.cumsum(lengths)
    rows = KR.lattice_offsets(frames, lengths)
    z = rng.standard_normal((int(rows[-1]), v)).astype(np.float32)
    return z, frames, ids, tgt, rows


def torchaudio_peer(python, batch, threads, repeats):
    """torchaudio's figures on the same batch (its own interpreter), or None."""
    if not python:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        path, out = os.path.join(tmp, "batch.npz"), os.path.join(tmp, "out.json")
        np.savez(path, **dict(zip(("z", "frames", "ids", "tgt_offsets", "row_offsets"), batch)))
        proc = subprocess.run([python, PEER, path, str(threads), str(repeats), out],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"hpcsgd bench rnnt: {python} {PEER} failed:\n{proc.stderr[-2000:]}")
        return json.load(open(out))


def bench_shape(name, shape, repeats, rng, triad, threads, peer_python):
    nb, t, u, v = shape
    batch = make_batch(shape, rng)
    z, frames, ids, tgt, rows = batch
    n = int(rows[-1])
    alpha, beta = np.empty(n, np.float32), np.empty(n, np.float32)
    loss, feasible = np.empty(nb), np.empty(nb, np.uint8)
    g = z.copy()

    def ours():
        KR.rnnt_loss_grad(g, frames, ids, tgt, rows, 1.0, alpha, beta, loss, feasible)

    ours()   # compile (cached) and first touch
    assert feasible.all() and np.isfinite(loss).all()
    first = loss.copy()
    t_ours = t_tri = float("inf")
    for _ in range(repeats):   # each call runs on the last one's gradient: the same work
        t_tri = min(t_tri, membw.best_time(triad[0], 1))
        t_ours = min(t_ours, membw.best_time(ours, 1))
    moved = 16 * n * v + 8 * n
    ours_bytes = z.nbytes + alpha.nbytes + beta.nbytes
    theirs = torchaudio_peer(peer_python, batch, threads, repeats)
    row = {"shape": name, "B": nb, "T": t, "U": u, "V": v, "nodes": n,
           "loss": float(first.sum()), "ms": 1e3 * t_ours, "bytes": moved,
           "GBps": moved / t_ours / 1e9, "triad_GBps": triad[1] / t_tri / 1e9,
           "memory_bytes": ours_bytes, "torchaudio_ms": None, "vs_torchaudio": None,
           "torchaudio_memory_bytes": None, "max_rel_loss_diff": None}
    if theirs:
        other = np.asarray(theirs["loss"])
        row.update(torchaudio_ms=1e3 * theirs["seconds"],
                   vs_torchaudio=theirs["seconds"] / t_ours,
                   torchaudio_memory_bytes=theirs["padded_bytes"] + theirs["allocated_bytes"],
                   torchaudio_padded_bytes=theirs["padded_bytes"],
                   max_rel_loss_diff=float(np.max(np.abs(other - first) / np.abs(first))),
                   torchaudio_version=theirs["torchaudio"], torch_version=theirs["torch"])
    return row


def run(args):
    threads, repeats, table = membw.loss_bench_settings(args, SHAPES, SMALL, "rnnt")
    small, names = args.small, list(table)
    print(f"hpcsgd bench rnnt: cpu, {threads} threads, {'small' if small else 'training'} "
          f"shapes, best of {repeats}, in alternation with the triad"
          + (f"; torchaudio by {args.torchaudio_python}" if args.torchaudio_python else ""))
    if not args.torchaudio_python:
        print("no --torchaudio-python: torchaudio's columns are skipped")
    triad = membw.triad_timer((8 << 20) if small else (200 << 20))
    rng = np.random.default_rng(0)
    rows = [bench_shape(name, table[name], repeats, rng, triad, threads,
                        args.torchaudio_python) for name in names]
    print(f"{'shape':6} {'B':>3} {'T':>4} {'U':>3} {'V':>4} {'ms':>8} {'GB/s':>6} "
          f"{'of triad':>8} {'MiB':>7} | {'ta ms':>8} {'ta/ours':>7} {'ta MiB':>7} "
          f"{'loss rel diff':>13}")
    for r in rows:
        r["frac_triad"] = r["GBps"] / r["triad_GBps"]
        ta = (f"{r['torchaudio_ms']:8.2f} {r['vs_torchaudio']:7.2f} "
              f"{r['torchaudio_memory_bytes'] / 2**20:7.1f} {r['max_rel_loss_diff']:13.2e}"
              if r["torchaudio_ms"] is not None else f"{'-':>8} {'-':>7} {'-':>7} {'-':>13}")
        print(f"{r['shape']:6} {r['B']:3d} {r['T']:4d} {r['U']:3d} {r['V']:4d} {r['ms']:8.2f} "
              f"{r['GBps']:6.2f} {r['frac_triad']:8.1%} {r['memory_bytes'] / 2**20:7.1f} | "
              f"{ta}")
    print("Bytes: the logits read and written twice + alpha and beta. MiB: ours exact (packed "
          "logits + alpha + beta), torchaudio's the padded logits + what its call allocates "
          "(gradient, workspace). ta/ours > 1: ours is faster. Loss rel diff: the largest "
          "per-utterance |ours - torchaudio| / loss.")
    return {"threads": threads, "small": small, "repeats": repeats,
            "torchaudio_python": args.torchaudio_python, "rows": rows}


def figures(res):
    out = {}
    for r in res["rows"]:
        out[f"{r['shape']} ms"] = r["ms"]
        out[f"{r['shape']} of triad"] = r["frac_triad"]
        if r["vs_torchaudio"] is not None:
            out[f"{r['shape']} torchaudio/ours"] = r["vs_torchaudio"]
    return out
