"""One rank's update: post_exchange + apply (two passes, the allreduce path before it fused at
K = 1) against Optimizer.fused_update (one pass), alternated in one process, momentum as
so762.yaml's, on the paper model's 46M parameters (or argv[1]), this machine's threads:
    python experiments/update_fused_ab.py [n]
Both give the same bits (tests/test_step.py); this times them."""
import sys
import time

import numpy as np

from hpcsgd.optim import Optimizer

n = int(sys.argv[1]) if len(sys.argv) > 1 else 46_000_000
rng = np.random.default_rng(0)
g0, w = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
g = g0.copy()
opt = Optimizer(n, momentum_time_constant=9719.0)
opt.begin_step(1024, 1024)


def two_passes():
    g[:] = g0
    t = time.perf_counter()
    opt.post_exchange(g, w)
    opt.apply(w, g, 1e-9)
    return time.perf_counter() - t


def fused():
    g[:] = g0
    t = time.perf_counter()
    opt.fused_update(w, g, 1e-9)
    return time.perf_counter() - t


two_passes(), fused()   # compile, touch every page
a, b = zip(*[(two_passes(), fused()) for _ in range(8)])
print(f"{n} parameters, median of 8 alternated: post_exchange + apply "
      f"{np.median(a) * 1e3:.1f} ms, fused_update {np.median(b) * 1e3:.1f} ms")
