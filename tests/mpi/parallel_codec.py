"""Under mpiexec -n M: the model group's coded activation traffic, bit for bit.

    mpiexec -n M python tests/mpi/parallel_codec.py CODEC

allgather_columns: every rank's gathered (n, N) equals, block by block, decode(encode(block))
of each rank's block with the same codec run locally (the sender decodes its own block too).
reduce_scatter_columns: rank j's sum equals, in rank order, its own exact block plus the
decoded coded blocks of the others. The bytes counted equal the codec's packed sizes.
Prints "OK CODEC M=..." on rank 0.
"""
import sys

import numpy as np
from mpi4py import MPI

from hpcsgd.model.parallel import ModelGroup, split_columns

comm = MPI.COMM_WORLD
M, me = comm.Get_size(), comm.Get_rank()
name = sys.argv[1]
group = ModelGroup(comm, name)
n, N = 33, 41
bounds = split_columns(N, M)
lo, hi = int(bounds[me]), int(bounds[me + 1])
rng = np.random.default_rng(me)

# --- Allgather of activations
local = np.ascontiguousarray(rng.normal(0, 2, (n, hi - lo)).astype(np.float32))
out = np.empty((n, N), np.float32)
recv = np.empty(n * N, np.float32)
group.allgather_columns(local, out, bounds, recv)
blocks = comm.allgather(local)             # lowercase: the test's own view of every block
for j, block in enumerate(blocks):
    c = block.shape[1]
    codec = group.codec(c)
    packed = np.zeros(codec.packed_nbytes(n, c), np.uint8)
    codec.encode(block, None, packed)
    want = np.empty_like(block)
    codec.decode(packed, want)
    assert np.array_equal(out[:, bounds[j]:bounds[j + 1]], want), j
    assert not np.array_equal(want, block)   # the codec did round something
sizes = [group.codec(int(c)).packed_nbytes(n, int(c)) for c in np.diff(bounds)]
assert group.traffic()["allgather"] == (sizes[me] * (M - 1), sum(sizes) - sizes[me])

# --- Reduce_scatter of input gradients
send = rng.normal(0, 1, n * N).astype(np.float32)
total = np.empty(n * (hi - lo), np.float32)
group.reduce_scatter_columns(send, total, bounds, n)
every = comm.allgather(send)
want = None
codec = group.codec(hi - lo)
for r in range(M):
    block = every[r][n * lo:n * hi].reshape(n, hi - lo)
    if r != me:
        packed = np.zeros(codec.packed_nbytes(n, hi - lo), np.uint8)
        codec.encode(np.ascontiguousarray(block), None, packed)
        block = np.empty((n, hi - lo), np.float32)
        codec.decode(packed, block)
    want = block.copy() if want is None else want + block
assert np.array_equal(total.reshape(n, hi - lo), want)
assert group.traffic()["reduce_scatter"] == (sum(sizes) - sizes[me], sizes[me] * (M - 1))
comm.Barrier()
if me == 0:
    print(f"OK {name} M={M}")
