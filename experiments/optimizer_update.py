"""Time Optimizer.post_exchange (the update computed from the summed gradient) on the so762
DNN's 3.6M parameters, per optimizer, best of 12 steps, this machine's threads:
    python experiments/optimizer_update.py
Each kind is one Numba loop; a loop whose flags are constants vectorises (optim.py)."""
import time

import numpy as np

from hpcsgd.optim import Optimizer

N = 3_600_000
g0 = np.random.default_rng(0).standard_normal(N).astype(np.float32)
for name, kw in [("momentum", dict(momentum_time_constant=1024.0)),
                 ("AdaGrad aggregate + momentum", dict(adagrad="aggregate",
                                                       momentum_time_constant=1024.0)),
                 ("Adam", dict(kind="adam", momentum_time_constant=0.0)),
                 ("AdaGrad after momentum", dict(adagrad="after_momentum",
                                                 momentum_time_constant=1024.0))]:
    opt, w, best = Optimizer(N, **kw), np.zeros(N, np.float32), float("inf")
    for _ in range(12):
        g = g0.copy()
        opt.begin_step(256, 256)
        t0 = time.perf_counter()
        opt.post_exchange(g, w)
        best = min(best, time.perf_counter() - t0)
        opt.apply(w, g, 1e-3)
    print(f"{name:30s} {best * 1e3:6.2f} ms")
