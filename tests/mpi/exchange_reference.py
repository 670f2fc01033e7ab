"""Single-process reference for the exchange tests: train on the SAME global minibatches that
`hpcsgd train` sees with K ranks, without MPI.

    python tests/mpi/exchange_reference.py OUT.npz K MODE [--float64] [--per-rank] key=value ...

The config overrides are the trainer's (same keys, same defaults). K loaders are built in this
one process exactly as the K ranks build theirs (rank r of K, the rank's local minibatch); each
step takes every rank's batch, concatenates them in rank order and computes the gradient
summed over all of them in one forward/backward (what a 1-rank trainer would do if its
minibatch were the union), then:
  MODE float   post-process + apply on the whole sum (no quantization);
  MODE onebit  (K = 1 only) the paper's path written out plainly with the NumPy reference
               codec: encode with residual 1, decode, post-process, encode with residual 2,
               decode, apply -- every gradient quantized twice.
--per-rank: each rank's gradient computed on its own batch, then added in rank order in
float32 (at K = 2 the Allreduce's sum bit for bit: one addition, commutative); for a model
whose forward depends on the batch (quantization-aware training: a learned clip's gradient is
the same either way, but the sum's rounding is not), and for an optimizer with a second
moment per rank (AdaGrad "local", optim.adam_variance=local: one optimizer per rank
normalises its rank's gradient before the sum; rank 0's also post-processes the sum).
Writes params (and the residuals for onebit) to OUT.npz.
"""
import sys

import numpy as np

from hpcsgd import config
from hpcsgd.codecs import make_codec

from reference_setup import build, float64_flag, global_batch, global_steps, optimizer

dtype = float64_flag(sys.argv)
per_rank = "--per-rank" in sys.argv
if per_rank:
    sys.argv.remove("--per-rank")
out_path, K, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
cfg = config.load(None, sys.argv[4:])
assert mode in ("float", "onebit") and (mode == "float" or K == 1)
batch_of, loaders, model, params, opt = build(cfg, K, dtype, local=per_rank)
rank_opts = [opt] + [optimizer(cfg, params.size, dtype) for _ in range(1, K)]
assert mode == "float" or dtype == np.float32
grads = model.new_params()
codec = make_codec("onebit", "reference")
res1, res2 = np.zeros(params.size, np.float32), np.zeros(params.size, np.float32)
packed = {m.name: np.zeros(codec.packed_nbytes(m.n_cols, m.n_rows), np.uint8)
          for m in params.matrices}


def quantize(flat, residual):
    """flat <- decode(encode(flat + residual)), residual <- the error, matrix by matrix."""
    if not cfg["exchange.error_feedback"]:
        residual[:] = 0
    for m in params.matrices:
        g = flat[m.offset:m.offset + m.size].reshape(m.n_cols, m.n_rows)
        codec.encode(g, residual[m.offset:m.offset + m.size].reshape(g.shape), packed[m.name])
        codec.decode(packed[m.name], g)


frames = 0
rank_grads = model.new_params()


def per_rank_gradient(take):
    """grads <- the sum over ranks (in rank order) of each rank's gradient of its batch,
    normalised first by its own optimizer where that keeps a local second moment (every
    rank's optimizer begins the step with the rank's own frames)."""
    grads.flat[:] = 0
    for r, loader in enumerate(loaders):
        x, y = global_batch([loader], take[r:r + 1], dtype)
        counted = model.frames_in_loss(y, len(x)) if len(x) else 0
        rank_grads.flat[:] = 0   # a rank without frames in this step sends zeros
        if len(x):
            model.forward_backward(params, rank_grads, x, y, len(x))
        rank_opts[r].begin_step(int(take.sum()), counted)
        rank_opts[r].pre_exchange(rank_grads.flat)
        grads.flat[:] += rank_grads.flat


for lr, take, _ in global_steps(cfg, loaders, batch_of):
    if per_rank:
        assert cfg["train.loss_scale"] == "none"
        per_rank_gradient(take)
        opt.post_exchange(grads.flat, params.flat)
        opt.apply(params.flat, grads.flat, lr)
        frames += int(take.sum())
        continue
    x, y = global_batch(loaders, take, dtype)
    n = len(x)
    # a static loss scale (the trainer's rules for the others are tested on their own): the
    # scaled gradient, float16 where mixed precision stores it, unscaled in float32
    scale = cfg["train.loss_scale_init"] if cfg["train.loss_scale"] == "static" else 1.0
    assert cfg["train.loss_scale"] in ("none", "static")
    model.forward_backward(params, grads, x, y, n, loss_scale=scale)
    if scale != 1.0 or getattr(model, "half", False):
        bad, _ = model.unscale(grads, scale)
        assert bad == 0, "an overflow: the reference does not skip steps"
    # the minibatch's frames (a sequence model's frame slots: whole chunks) and those in the
    # loss, as the trainer's step counts them
    opt.begin_step(int(take.sum()), model.frames_in_loss(y, n))
    if mode == "onebit":
        quantize(grads.flat, res1)
    opt.post_exchange(grads.flat, params.flat)
    if mode == "onebit":
        quantize(grads.flat, res2)
    opt.apply(params.flat, grads.flat, lr)
    frames += int(take.sum())
np.savez(out_path, params=params.flat, residual1=res1, residual2=res2, frames=frames)
print(f"OK reference K={K} mode={mode} frames={frames}")
