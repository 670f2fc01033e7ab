"""kbit2's encode compute per value per thread from cache, with one thread (64 columns of 2048
rows) and with two (128 columns): the same per-thread time means the two threads run on
separate cores (no shared SMT core, whatever the VM shows), so a compute-bound kernel gains 2x.
    python experiments/kbit_two_threads.py
"""
import time, numba, numpy as np
import hpcsgd.codecs.kbit as K
rng = np.random.default_rng(0)
def setup(cols):
    g = (rng.standard_normal((cols, 2048)) * 1e-3).astype(np.float32)
    r = (rng.standard_normal(g.shape) * 1e-5).astype(np.float32)
    c = K.KBit(bits=2); out = np.zeros(c.packed_nbytes(*g.shape), np.uint8)
    c.encode(g, r, out); return c, g, r, out
one, two = setup(64), setup(128)
for rnd in range(6):
    res = []
    for threads, (c, g, r, out) in ((1, one), (2, two)):
        numba.set_num_threads(threads)
        best = 1e9
        for _ in range(20):
            t = time.perf_counter()
            for _ in range(20): c.encode(g, r, out)
            best = min(best, (time.perf_counter() - t) / 20)
        res.append(best / (g.size / threads) * 1e9)
    print(f"round {rnd}: ns/value/thread 1 thread {res[0]:.3f}, 2 threads {res[1]:.3f} (ratio {res[1]/res[0]:.2f})")
