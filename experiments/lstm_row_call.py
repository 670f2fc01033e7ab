"""The BLSTM forward step with its row body inlined (the package's) against a variant where
`_forward_row` and `_backward_row` are called functions: first-call compile time and the
step's median run time, B = 64 sequences, 320 cells, float32, 2 threads. Run each on a fresh
cache, in separate processes:
    NUMBA_CACHE_DIR=$(mktemp -d) python experiments/lstm_row_call.py inlined
    NUMBA_CACHE_DIR=$(mktemp -d) python experiments/lstm_row_call.py called
"""
import sys
import tempfile
import time

import numpy as np
from old_module import load

import hpcsgd.model.kernels_lstm as package

if sys.argv[1] == "inlined":
    K = package
else:   # the same source, the two row bodies no longer inlined
    src = open(package.__file__).read()
    for name in ("_forward_row", "_backward_row"):
        src = src.replace(f'@njit(inline="always")\ndef {name}(', f"@njit\ndef {name}(", 1)
    path = tempfile.mkdtemp() + "/kernels_lstm_called.py"
    open(path, "w").write(src)
    K = load(path, "kernels_lstm_called")
B, hc = 64, 320
rng = np.random.default_rng(0)


def f(*shape):
    return rng.standard_normal(shape).astype(np.float32)


args = (f(B, 8 * hc), f(B, 4 * hc), f(B, 2 * hc), f(B, 2 * hc), f(B, 2 * hc),
        f(B, 8 * hc), f(B, 4 * hc), f(B, 2 * hc), f(B, 2 * hc), f(B, 2 * hc), f(1, 8 * hc), hc)
t = time.perf_counter()
K.lstm_forward_step2(*args)
compile_s = time.perf_counter() - t
times = []
for _ in range(200):
    t = time.perf_counter()
    K.lstm_forward_step2(*args)
    times.append(time.perf_counter() - t)
print(f"{sys.argv[1]}: compile lstm_forward_step2 {compile_s:.1f} s, "
      f"run median {np.median(times) * 1e6:.1f} us")
