"""Single-process reference for double buffering: the delayed-update equations of
docs/exchange.md ("Double buffering") written out plainly, on the SAME global half-minibatches
that `hpcsgd train exchange.double_buffering=true` sees with K ranks.

    python tests/mpi/double_buffering_reference.py OUT.npz K [--float64] key=value ...

K loaders in one process, built as the K ranks build theirs. Per step every rank's share is
split in halves ((take + 1) // 2, then the rest); half h's global minibatch is the ranks' half
batches concatenated in rank order. With U(G) the optimizer's post-processing (decay,
AdaGrad, momentum at n = the half's global frames) and lr the step's per-sample rate:
    G_h     = sum of the per-frame gradients of half h, at W_h
    W_{h+1} = W_h - lr_{h-1} * U_{h-1}(G_{h-1})      (W_1 = W_0: nothing to apply yet)
and at an epoch end the last half's update is applied before the next epoch's first gradient.
No quantization (float32). Writes params to OUT.npz.
"""
import sys

import numpy as np

from hpcsgd import config

from reference_setup import build, float64_flag, global_batch, global_steps

dtype = float64_flag(sys.argv)
out_path, K = sys.argv[1], int(sys.argv[2])
cfg = config.load(None, sys.argv[3:])
batch_of, loaders, model, params, opt = build(cfg, K, dtype)
grads = [model.new_params(), model.new_params()]   # G_h in flight, G_{h+1} being computed


def apply_delayed(pending):
    """W -= lr * U(G) for the half in flight (opt's per-step scalars are still its own)."""
    g, lr = pending
    opt.post_exchange(g.flat, params.flat)
    opt.apply(params.flat, g.flat, lr)


frames, pending, slot = 0, None, 0
for lr, take, ends_epoch in global_steps(cfg, loaders, batch_of):
    for part in [ld.halves(take) for ld in loaders][0]:   # every loader told (utterances)
        if not part.sum():
            continue
        x, y = global_batch(loaders, part, dtype)
        slot ^= 1
        model.forward_backward(params, grads[slot], x, y, len(x))   # G_h at W_h
        if pending:
            apply_delayed(pending)                                 # W_{h+1}
        opt.begin_step(int(part.sum()), model.frames_in_loss(y, len(x)))
        pending = (grads[slot], lr)
    frames += int(take.sum())
    if ends_epoch:   # epoch end: drain before the next epoch
        apply_delayed(pending)
        pending = None
np.savez(out_path, params=params.flat, frames=frames)
print(f"OK double-buffering reference K={K} frames={frames}")
