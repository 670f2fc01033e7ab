"""The LSTM step kernels' first-call compile time (float32 and float64, both directions' kernels
and the one-direction ones) and their float32 run time, B = 64 sequences, 320 cells, 2 threads,
for one version of hpcsgd/model/kernels_lstm.py. Run each version on a fresh cache, in turn:
    git show 46a22be:hpcsgd/model/kernels_lstm.py > /tmp/kernels_lstm_old.py
    NUMBA_CACHE_DIR=$(mktemp -d) python experiments/lstm_steps_compile.py /tmp/kernels_lstm_old.py
    NUMBA_CACHE_DIR=$(mktemp -d) python experiments/lstm_steps_compile.py hpcsgd/model/kernels_lstm.py
"""
import sys
import time

import numba
import numpy as np
from old_module import load

K = load(sys.argv[1], "kernels_lstm_under_test")
numba.set_num_threads(2)
nb, hc = 64, 320


def arrays(dtype, seed):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((nb, 8 * hc)).astype(dtype)
    r = rng.standard_normal((nb, 4 * hc)).astype(dtype)
    cells = [rng.standard_normal((nb, 2 * hc)).astype(dtype) for _ in range(3)]
    return a, r, cells


def calls(dtype):
    """name -> a call of each kernel on fresh arrays of dtype."""
    a0, r0, (cp0, c0, h0) = arrays(dtype, 0)
    a1, r1, (cp1, c1, h1) = arrays(dtype, 1)
    b = np.random.default_rng(2).standard_normal((1, 8 * hc)).astype(dtype)
    dh = [np.random.default_rng(3 + i).standard_normal((nb, 2 * hc)).astype(dtype) for i in range(2)]
    dr = [np.zeros((nb, hc), dtype) for _ in range(2)]
    dc = [np.zeros((nb, hc), dtype) for _ in range(2)]
    return {
        "forward_step": lambda: K.lstm_forward_step(a0, r0, b, cp0, c0, h0, 0, 0, hc),
        "forward_step2": lambda: K.lstm_forward_step2(a0, r0, cp0, c0, h0, a1, r1, cp1, c1, h1,
                                                      b, hc),
        "backward_step": lambda: K.lstm_backward_step(a0, cp0, c0, dh[0], dr[0], dc[0], 0, 0,
                                                      hc),
        "backward_step2": lambda: K.lstm_backward_step2(a0, cp0, c0, dh[0], dr[0], dc[0], a1,
                                                        cp1, c1, dh[1], dr[1], dc[1], hc)}


total = 0.0
for dtype in (np.float32, np.float64):
    for name, call in calls(dtype).items():
        t = time.perf_counter()
        call()
        total += time.perf_counter() - t
        print(f"compile {name} {np.dtype(dtype).name}: {time.perf_counter() - t:.1f} s")
print(f"compile total {total:.1f} s")
for name, call in calls(np.float32).items():
    ts = []
    for _ in range(200):
        t = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t)
    print(f"run {name} float32: median {np.median(ts) * 1e6:.1f} us")
