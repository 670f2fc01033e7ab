"""Under mpiexec -n K: an Inf injected into rank 1's gradient makes every rank skip that step
with every state untouched (bitwise), and the backoff scale halves, then doubles after its
window of clean steps.

    mpiexec -n 3 python tests/mpi/overflow_skip.py DOUBLE_BUFFERING(0|1)

Two identical trainers per rank, A and B, over the same ranks (collectives in the same order
on every rank): both train 3 steps; A then takes a step whose gradient rank 1 poisons, B only
completes its exchange in flight (double buffering: the skipped step still applies the
previous half's update, as it must). A's weights, optimizer state and both residuals must
equal B's bit for bit. Prints "skip ok" per rank.
"""
import sys

import numpy as np
from mpi4py import MPI

from hpcsgd import loss_scale
from hpcsgd.codecs import make_codec
from hpcsgd.comm.exchange import Striped
from hpcsgd.model.dnn import dnn
from hpcsgd.optim import Optimizer
from hpcsgd.step import Step, gradient_buffers

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
db = sys.argv[1] == "1"
N, LR, SCALE, WINDOW = 16, 0.05, 2.0 ** 10, 2


def trainer():
    model = dnn(6, [5, 4], 3, max_batch=N, precision="mixed")
    params = model.new_params()
    model.init(params, np.random.default_rng(0))
    ex = Striped(comm, params.matrices, make_codec("onebit", "cpu"))
    opt = Optimizer(params.size, momentum_time_constant=50.0, adagrad="aggregate",
                    post_size=ex.state_size)
    scaler = loss_scale.Backoff(init=SCALE, lo=1.0, hi=2.0 ** 24, window=WINDOW)
    return Step(model, params, gradient_buffers(model, db), opt, ex, db, "none", scaler=scaler)


rng = np.random.default_rng(10 + rank)
x = rng.standard_normal((N, 6)).astype(np.float32)
y = rng.integers(0, 3, N).astype(np.int32)


def batch(n):
    return x[:n], y[:n]


take = np.full(comm.Get_size(), N)
a, b = trainer(), trainer()
for step in (a, b):
    for _ in range(3):
        step.run(batch, take, rank, LR)

before = a.scaler.scale
assert before == b.scaler.scale
if rank == 1:   # this rank's next gradient holds an Inf
    clean = a.model.unscale

    def poisoned(grads, scale):
        grads.flat[7] = np.inf
        return clean(grads, scale)
    a.model.unscale = poisoned
a.run(batch, take, rank, LR)
if rank == 1:
    a.model.unscale = clean
b.drain()

halves = 1 + db   # double buffering: both halves of the step carry the Inf, both skip
assert a.pending is None and a.scaler.skipped == halves == len(a.skips), a.skips
assert a.scaler.scale == before / 2 ** halves and b.scaler.scale == before, (a.scaler.scale,
                                                                           b.scaler.scale)
np.testing.assert_array_equal(a.params.flat, b.params.flat)
for key, value in b.opt.state_dict().items():
    np.testing.assert_array_equal(np.asarray(a.opt.state_dict()[key]), np.asarray(value),
                                  err_msg=key)
for key, value in b.ex.state_dict().items():
    np.testing.assert_array_equal(a.ex.state_dict()[key], value, err_msg=key)
assert np.count_nonzero(b.ex.state_dict()["residual1"]) > 0   # the residuals were in play

# the window: every WINDOW clean updates the scale doubles (WINDOW steps of `halves` updates)
for _ in range(WINDOW):
    a.run(batch, take, rank, LR)
assert a.scaler.scale == before, (a.scaler.scale, a.scaler.state_dict())
print(f"rank {rank}: skip ok", flush=True)
