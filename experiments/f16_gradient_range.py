"""Where so762's weight gradients sit in float16's range (issue 21: why loss scaling changes
nothing here). From a checkpoint, the float32 gradient of N-frame minibatches (summed over
the frames, as the trainer sums them; 128 = one of 2 ranks' share of 256), and the shares of
its values that float16 flushes to zero (|g| < 2^-25), stores as subnormal (< 2^-14), and the
max |g| against float16's 65504, at loss scale 1 and at the scales the scalers chose.
    python experiments/f16_gradient_range.py CHECKPOINT_OR_RUN ARCHIVE [N] [BATCHES]"""
import sys

import numpy as np

from hpcsgd.data.loader import FrameLoader
from hpcsgd.evaluate import load_model


def main():
    path, arch = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 128
    batches = int(sys.argv[4]) if len(sys.argv) > 4 else 20
    model, params, meta = load_model(path, max_batch=n)
    cfg = meta["config"]
    loader = FrameLoader(arch, 0, 1, context=cfg["data.context"], cmvn=cfg["data.cmvn"],
                         seed=1, max_batch=n, prefetch=False)
    loader.start_epoch(0)
    grads = model.new_params()
    g = []
    for _ in range(batches):
        x, y = loader.next_batch(n)
        model.forward_backward(params, grads, x, y, len(y))
        g.append(np.abs(grads.flat.copy()))
    a = np.concatenate(g)
    print(f"{path}: {batches} minibatches of {n} frames, {a.size:,} gradient values")
    for scale in (1.0, 256.0, 2048.0):
        s = a * scale
        print(f"  scale {scale:>6g}: zero {np.mean(s == 0):.4%}, flushed to 0 by float16 "
              f"{np.mean((s > 0) & (s < 2.0 ** -25)):.4%}, subnormal "
              f"{np.mean((s >= 2.0 ** -25) & (s < 2.0 ** -14)):.4%}, max {s.max():.4g} "
              f"(float16 max 65504)")
    loader.close()


if __name__ == "__main__":
    main()
