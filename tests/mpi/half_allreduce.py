"""Under mpiexec -n K: the float16 Allreduce (reduce-scatter of float16 pieces, float32 sum,
Allgatherv) gives every rank, bit for bit, what its definition computes in NumPy from every
rank's gradient (hpcsgd/comm/exchange.py: Allreduce). Prints "half ok" per rank.

    mpiexec -n K python tests/mpi/half_allreduce.py SIZE LOSS_SCALE(0 = none) BLOCKING(0|1)
"""
import sys

import numpy as np
from mpi4py import MPI

from hpcsgd.comm.exchange import Allreduce

comm = MPI.COMM_WORLD
rank, k = comm.Get_rank(), comm.Get_size()
size, scale, blocking = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"


def gradient(r):
    g = (np.random.default_rng(100 + r).standard_normal(size) * 30).astype(np.float32)
    if scale:   # a mixed-precision gradient: float16 values (of g * scale) divided by scale
        g = (g * np.float32(scale)).astype(np.float16).astype(np.float32) / np.float32(scale)
    return g


a = scale if scale else 1.0 / k
c = 1.0 / k
halves = [(gradient(r) * np.float32(a)).astype(np.float16) for r in range(k)]
if scale:   # sent exactly: the float16 values of the backward pass
    assert all(np.array_equal(h.astype(np.float32), gradient(r) * np.float32(scale))
               for r, h in enumerate(halves))
acc = halves[0].astype(np.float32)
for h in halves[1:]:
    acc += h.astype(np.float32)
want = (acc * np.float32(c)).astype(np.float16).astype(np.float32) * np.float32(1.0 / (a * c))

ex = Allreduce(comm, size, "float16")
ex.loss_scale = scale or None
grad = gradient(rank)
ex.encode(grad)
ex.send(blocking)
ex.wait()
got, _ = ex.reduce(None)
np.testing.assert_array_equal(got, want)
print(f"rank {rank}: half ok", flush=True)
