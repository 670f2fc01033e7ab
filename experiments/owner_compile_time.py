"""First-call time of each compiled variant of the fused 1-bit owner pass, in a fresh Numba
cache (so every call compiles), one thread, in the order the optimizers are listed:
    NUMBA_CACHE_DIR=$(mktemp -d) NUMBA_NUM_THREADS=1 python experiments/owner_compile_time.py
The first variant also compiles the shared column kernels (hpcsgd/codecs/onebit_columns.py)."""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from test_owner import OPTIMIZERS, make_opt, setup  # noqa: E402  the test's inputs

for name, options in OPTIMIZERS.items():
    codec, recv, slot, pieces, params, r2, gather, stripe = setup(2, np.random.default_rng(1))
    opt = make_opt(stripe, options, np.random.default_rng(7))
    t0 = time.perf_counter()
    codec.owner_pass(recv, 2, slot, pieces, params, opt, r2, gather)
    print(f"{name:26s} first call {time.perf_counter() - t0:5.2f} s")
