"""The sigmoid forward kernel on one 1024 x 2048 layer of the 46M model, with 1 or 2 threads
(the trainer's thread environment): best of 20 calls, three rounds. Its exp's reduced argument,
polynomial and divide are float64 (hpcsgd/model/kernels.py), so it is compute-bound.
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
z = z0.copy()
kernels.sigmoid_forward(z, b)
for rnd in range(3):
    best = 1e9
    for _ in range(20):
        z[:] = z0
        t = time.perf_counter()
        kernels.sigmoid_forward(z, b)
        best = min(best, time.perf_counter() - t)
    print(f"sigmoid_forward 1024 x 2048, {sys.argv[1]} thread(s): {best * 1e3:.3f} ms, "
          f"{best / z.size * 1e9 * int(sys.argv[1]):.3f} ns per value per thread")
