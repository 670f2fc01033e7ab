"""Under mpiexec -n K: the overlapped allreduce (exchange.overlap, a bucket per layer) when
some ranks have no frames in a step (they post every bucket after the others have posted
theirs during the backward pass), against the same steps with one Allreduce of the whole
buffer: the same weights bit for bit, on every rank. Bit for bit because every sum is exact
whatever MPI's order: a step where one rank has frames sums g + 0 + ...; on 2 ranks a step
where both have sums a + b, which is b + a.

    mpiexec -n 3 python tests/mpi/overlap_ranks.py

Two trainers per rank over the same ranks (collectives in the same order on every rank):
A overlapped, B serial. Steps deal the frames to one rank at a time, [N, 0, ...], [0, N, 0,
...], ..., and on 2 ranks [N, N] before and after. Prints "overlap ok" per rank.
"""
import numpy as np
from mpi4py import MPI

from hpcsgd.comm.exchange import Allreduce
from hpcsgd.model.dnn import dnn
from hpcsgd.optim import Optimizer
from hpcsgd.step import Step, gradient_buffers

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
N, LR = 16, 0.05


def trainer(overlap):
    model = dnn(6, [5, 4], 3, max_batch=N)
    params = model.new_params()
    model.init(params, np.random.default_rng(0))
    ex = Allreduce(comm, params.size)
    ex.overlap, ex.bucket_bytes = overlap, 0
    opt = Optimizer(params.size, momentum_time_constant=50.0, post_size=ex.state_size)
    return Step(model, params, gradient_buffers(model, False), opt, ex, False, "none")


rng = np.random.default_rng(10 + rank)
x = rng.standard_normal((N, 6)).astype(np.float32)
y = rng.integers(0, 3, N).astype(np.int32)


def batch(n):
    return x[:n], y[:n]


a, b = trainer(True), trainer(False)
assert a.overlap and not b.overlap and len(a.ex.buckets) == 3
takes = list(np.eye(world, dtype=int) * N)
if world == 2:
    takes = [np.full(world, N)] + takes + [np.full(world, N)]
for take in takes:
    for step in (a, b):
        step.run(batch, take, rank, LR)
assert np.array_equal(a.params.flat, b.params.flat), "overlapped != serial bits"
assert not np.array_equal(a.params.flat, trainer(False).params.flat)   # it trained
mine = a.params.flat.copy()
every = np.empty((world, mine.size), mine.dtype)
comm.Allgather(mine, every)
assert all(np.array_equal(every[0], r) for r in every), "replicas differ"
print(f"overlap ok rank {rank}", flush=True)
