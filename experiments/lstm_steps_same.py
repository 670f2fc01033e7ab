"""The LSTM step kernels of an older kernels_lstm.py and the package's on the same inputs
(both directions' and one direction's, forward and backward, float32 and float64): prints
whether every output byte is the same.
    git show 46a22be:hpcsgd/model/kernels_lstm.py > /tmp/kernels_lstm_old.py
    NUMBA_CACHE_DIR=$(mktemp -d) python experiments/lstm_steps_same.py /tmp/kernels_lstm_old.py
(a fresh cache: a cached kernel of the old file names the module it was loaded as)
"""
import sys

import numpy as np
from old_module import load

import hpcsgd.model.kernels_lstm as new

old = load(sys.argv[1], "kernels_lstm_old")
nb, hc = 37, 45
for dtype in (np.float32, np.float64):
    outs = {}
    for name, K in (("old", old), ("new", new)):
        rng = np.random.default_rng(0)
        A = [rng.standard_normal((nb, 8 * hc)).astype(dtype) for _ in range(2)]
        R = [rng.standard_normal((nb, 4 * hc)).astype(dtype) for _ in range(2)]
        C = [[rng.standard_normal((nb, 2 * hc)).astype(dtype) for _ in range(3)] for _ in range(2)]
        b = rng.standard_normal((1, 8 * hc)).astype(dtype)
        K.lstm_forward_step2(A[0], R[0], *C[0], A[1], R[1], *C[1], b, hc)
        K.lstm_forward_step(A[0], R[0], b, *C[0], 4 * hc, hc, hc)
        DH = [rng.standard_normal((nb, 2 * hc)).astype(dtype) for _ in range(2)]
        DR = [rng.standard_normal((nb, hc)).astype(dtype) for _ in range(2)]
        DC = [rng.standard_normal((nb, hc)).astype(dtype) for _ in range(2)]
        K.lstm_backward_step2(A[0], C[0][0], C[0][1], DH[0], DR[0], DC[0], A[1], C[1][0],
                              C[1][1], DH[1], DR[1], DC[1], hc)
        K.lstm_backward_step(A[1], C[1][0], C[1][1], DH[1], DR[1], DC[1], 4 * hc, hc, hc)
        outs[name] = b"".join(x.tobytes() for x in A + [c for cs in C for c in cs] + DC)
    print(np.dtype(dtype).name, "same bytes:", outs["old"] == outs["new"])
