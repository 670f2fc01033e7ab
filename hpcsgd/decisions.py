"""Decisions taken between steps, in one place: the automatic minibatch size now; the gradient
bit width and the loss scale are the next ones. Each is taken identically on every rank (from
quantities every rank agrees on: collective sums, or a value rank 0 broadcasts), and its
current value is part of the training state (TrainState.decisions), so a resumed run
continues with it.

Automatic minibatch-size selection (Seide et al. 2014, Sec. 4; CNTK's auto-adjust),
train.probe_every_frames: at the start and every that many frames, train candidate sizes from
a snapshot of the whole state, keep the largest within train.probe_margin of the best
criterion, restore the snapshot and continue with it.
"""
import math
import time

import numpy as np

from hpcsgd.step import Step


def probe_candidates(current, cap):
    """round64(current / 2), then x sqrt(2) (multiples of 64) up to min(cap, 2 * current)."""
    cap = min(cap, 2 * current)
    sizes = [max(64, 64 * round(current / 2 / 64))]
    while True:
        nxt = max(64 * round(sizes[-1] * math.sqrt(2) / 64), sizes[-1] + 64)
        if nxt > cap:
            break
        sizes.append(nxt)
    return [c for c in sizes if c <= cap] or [current]


def probe_due(cfg, state):
    every = cfg["train.probe_every_frames"]
    return bool(every) and state.progress["frames"] >= state.decisions["next_probe"]


def probe_minibatch(cfg, state, step, loader, rank_frames, lr, reduce, beat):
    """The probe: every candidate trains on the next train.probe_frames frames (fewer at an
    epoch's end) from the same snapshot -- weights, optimizer state, exchange residuals,
    loader position -- without double buffering, at the current per-sample lr; its criterion
    is the mean training cross-entropy over those frames (all data ranks: `reduce` sums over
    them). The largest candidate within train.probe_margin of the best (CE <= best * (1 +
    margin)) is chosen; the snapshot is restored, so the run continues as if started with the
    chosen size here. Collective; no exchange may be in flight. Sets the decision; returns the
    record for the metrics."""
    t0 = time.perf_counter()
    current, rank = state.decisions["minibatch"], state.grid.data_rank
    sizes = probe_candidates(current, cfg["train.probe_max_minibatch"])
    snap = state.snapshot()
    offsets = np.array(state.progress["offsets"], np.int64)
    epoch = state.progress["epoch"]
    # the same model, buffers, optimizer and exchange; no double buffering, no timeline
    trial = Step(step.model, state.params, step.grads[:1], state.opt, state.ex,
                 device=step.device, check_finite=False, scaler=step.scaler, unit=step.unit)
    criteria = {}
    for size in sizes:
        offs = offsets.copy()
        loader.resume(epoch, offs, state.progress["deal"])
        sums, done = np.zeros(3), 0
        while done < cfg["train.probe_frames"] and (rank_frames - offs).sum() > 0:
            beat(f"minibatch-size probe ({size})")
            take = loader.take(size, offs, rank_frames)
            sums += trial.run(loader.next_batch, take, rank, lr, f"minibatch-size probe ({size})")
            offs += take
            done += int(take.sum())
        totals = reduce(sums)
        criteria[size] = totals[0] / max(totals[2], 1)
        state.restore(snap)
    loader.resume(epoch, offsets, state.progress["deal"])
    best = min(criteria.values())
    ok = [c for c in sizes
          if np.isfinite(criteria[c]) and criteria[c] <= best * (1 + cfg["train.probe_margin"])]
    chosen = max(ok) if ok else current
    state.decisions.update(minibatch=chosen,
                           next_probe=state.progress["frames"] + cfg["train.probe_every_frames"])
    return {"candidates": sizes, "criteria": {str(c): float(criteria[c]) for c in sizes},
            "chosen": chosen, "previous": current, "seconds": time.perf_counter() - t0}
