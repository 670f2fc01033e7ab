"""What error feedback does to 1-bit SGD's gradients on so762, measured (issue 18: why is the
run without feedback not worse in accuracy?). From a checkpoint, S consecutive minibatch
gradients (N frames each, summed over the frames as the trainer sums them) at the checkpoint's
weights, quantized by the 1-bit codec (per-column, the paper's) with and without error
feedback, as one rank's first encode would:
  step error   |Q_t - g_t| / |g_t| per step (the quantizer's own error)
  drift        |sum_t Q_t - sum_t g_t| / |sum_t g_t| (what the weights would accumulate)
  cosine       of sum_t Q_t with sum_t g_t
With feedback the drift is the last residual, bounded; without, it is the sum of S step errors.
    python experiments/ef_drift.py CHECKPOINT_OR_RUN ARCHIVE [N] [S]"""
import sys

import numpy as np

from hpcsgd.codecs import make_codec
from hpcsgd.data.loader import FrameLoader
from hpcsgd.evaluate import load_model


def main():
    path, arch = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    steps = int(sys.argv[4]) if len(sys.argv) > 4 else 50
    model, params, meta = load_model(path, max_batch=n)
    cfg = meta["config"]
    loader = FrameLoader(arch, 0, 1, context=cfg["data.context"], cmvn=cfg["data.cmvn"],
                         seed=3, max_batch=n, prefetch=False)
    loader.start_epoch(0)
    grads = model.new_params()
    codec = make_codec("onebit", "cpu")
    mats = [m for m in params.matrices if m.exchange == "codec"]
    bufs = {m.name: np.zeros(codec.packed_nbytes(m.n_cols, m.n_rows), np.uint8) for m in mats}
    size = sum(m.size for m in mats)
    res = {ef: np.zeros(size, np.float32) for ef in (True, False)}
    sum_g = np.zeros(size, np.float64)
    sum_q = {ef: np.zeros(size, np.float64) for ef in (True, False)}
    err = {True: [], False: []}
    for _ in range(steps):
        x, y = loader.next_batch(n)
        model.forward_backward(params, grads, x, y, len(y))
        g = grads.flat[:size].copy()
        sum_g += g
        for ef in (True, False):
            q = np.empty(size, np.float32)
            r = res[ef] if ef else np.zeros(size, np.float32)
            for m in mats:
                sl = slice(m.offset, m.offset + m.size)
                gm = g[sl].reshape(m.n_cols, m.n_rows)
                codec.encode(gm, r[sl].reshape(gm.shape), bufs[m.name])
                codec.decode(bufs[m.name], q[sl].reshape(gm.shape))
            sum_q[ef] += q
            err[ef].append(np.linalg.norm(q - g) / np.linalg.norm(g))
    norm = np.linalg.norm(sum_g)
    print(f"{path}: {steps} minibatches of {n} frames, {size:,} quantized values")
    for ef in (True, False):
        d = np.linalg.norm(sum_q[ef] - sum_g) / norm
        cos = sum_q[ef] @ sum_g / (np.linalg.norm(sum_q[ef]) * norm)
        print(f"  error feedback {'on ' if ef else 'off'}: step error {np.mean(err[ef]):.3f} "
              f"(first {err[ef][0]:.3f}, last {err[ef][-1]:.3f}); drift after {steps} steps "
              f"{d:.3f}; cosine {cos:.4f}")
    loader.close()


if __name__ == "__main__":
    main()
