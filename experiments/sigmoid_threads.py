"""The sigmoid layer kernels on one 1024 x 2048 layer of the 46M model, with 1 or 2 threads
(the trainer's thread environment), best of 20 calls, three rounds: the forward (its exp's
reduced argument, polynomial and divide are float64, hpcsgd/model/kernels.py, so it is
compute-bound) and the backward in place, as the step calls it (dz over h; it reads h and d
and writes dz: 24 MB, about 1 ms at 24 GB/s).
    python experiments/sigmoid_threads.py 2
    python experiments/sigmoid_threads.py 1
"""
import sys
import time
from hpcsgd import threads
threads.apply(int(sys.argv[1]))
import numpy as np
from hpcsgd.model import kernels
rng = np.random.default_rng(0)
z0 = rng.standard_normal((1024, 2048), dtype=np.float32)
b = rng.standard_normal((1, 2048), dtype=np.float32)
h0 = rng.random((1024, 2048), dtype=np.float32)
d = rng.standard_normal((1024, 2048), dtype=np.float32)
gb = np.zeros((1, 2048), np.float32)
partial = np.zeros((kernels.NCHUNK, 2048), np.float32)
z, h = z0.copy(), h0.copy()
kernels.sigmoid_forward(z, b)
kernels.sigmoid_backward(h, d, h, gb, partial)
for rnd in range(3):
    fwd = bwd = 1e9
    for _ in range(20):
        z[:] = z0
        t = time.perf_counter()
        kernels.sigmoid_forward(z, b)
        fwd = min(fwd, time.perf_counter() - t)
        h[:] = h0
        t = time.perf_counter()
        kernels.sigmoid_backward(h, d, h, gb, partial)
        bwd = min(bwd, time.perf_counter() - t)
    print(f"1024 x 2048, {sys.argv[1]} thread(s): forward {fwd * 1e3:.3f} ms "
          f"({fwd / z.size * 1e9 * int(sys.argv[1]):.3f} ns per value per thread), "
          f"backward in place {bwd * 1e3:.3f} ms")
