"""The torchaudio side of `hpcsgd bench rnnt`, run by the interpreter that has torchaudio
(--torchaudio-python: torchaudio 2.9 needs torch 2.9.1, not the torch beside hpcsgd), so it
imports numpy, torch and torchaudio only, never hpcsgd.

    python rnnt_torchaudio.py BATCH.npz THREADS REPEATS OUT.json

BATCH.npz: z (N, V) packed logits, frames, ids, tgt_offsets, row_offsets (kernels_rnnt's
layout). The logits are padded to (B, T, Umax + 1, V) as torchaudio wants them,
torchaudio.functional.rnnt_loss(reduction="none", fused_log_softmax=True, blank=0) + backward
to the logits, torch.set_num_threads(THREADS). Writes the per-utterance losses, the best of
REPEATS call times, and the bytes torch's allocator handed out during one call (the profiler's
self CPU memory of every op, positive ones summed: the gradient, the workspaces).
"""
import json
import sys
import time

import numpy as np
import torch
import torchaudio
from torch.profiler import ProfilerActivity, profile


def main(batch, threads, repeats, out):
    torch.set_num_threads(int(threads))
    d = np.load(batch)
    z, frames, ids, tgt, rows = (d[k] for k in ("z", "frames", "ids", "tgt_offsets",
                                                "row_offsets"))
    nb, v = len(frames), z.shape[1]
    lens = np.diff(tgt)
    t_max, u1_max = int(frames.max()), int(lens.max()) + 1
    padded = np.zeros((nb, t_max, u1_max, v), np.float32)
    targets = np.zeros((nb, u1_max - 1), np.int32)
    for b in range(nb):
        f, u1 = int(frames[b]), int(lens[b]) + 1
        padded[b, :f, :u1] = z[rows[b]:rows[b + 1]].reshape(f, u1, v)
        targets[b, :lens[b]] = ids[tgt[b]:tgt[b + 1]]
    x = torch.from_numpy(padded).requires_grad_()
    y = torch.from_numpy(targets)
    fl = torch.from_numpy(frames.astype(np.int32))
    tl = torch.from_numpy(lens.astype(np.int32))

    def call():
        loss = torchaudio.functional.rnnt_loss(x, y, fl, tl, blank=0, reduction="none",
                                               fused_log_softmax=True)
        loss.sum().backward()
        x.grad = None
        return loss

    losses = call().detach().numpy().astype(np.float64)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    allocated = sum(e.self_cpu_memory_usage for e in prof.key_averages()
                    if e.self_cpu_memory_usage > 0)
    best = float("inf")
    for _ in range(int(repeats)):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    with open(out, "w") as f:
        json.dump({"loss": losses.tolist(), "seconds": best, "allocated_bytes": allocated,
                   "padded_bytes": padded.nbytes, "torch": torch.__version__,
                   "torchaudio": torchaudio.__version__}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
