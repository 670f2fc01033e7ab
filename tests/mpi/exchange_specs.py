"""Parameters exchanged as their specs say, under mpiexec -n K: "codec" through the codec,
"float" summed exactly in float32 (never quantized), "none" never touched.

    mpiexec -n K python tests/mpi/exchange_specs.py allreduce|onebit|kbit

Every rank's gradient is small integers (exact in float32 whatever the summation order), the
optimizer plain SGD (no momentum, decay or AdaGrad) and lr a power of two, so the float
parameter's update is exact: W_after = W_before - lr * sum over ranks. Prints OK.
"""
import sys
import zlib

import numpy as np
from mpi4py import MPI

from hpcsgd import config
from hpcsgd.comm.exchange import make_exchange
from hpcsgd.model.flat import FlatParams, ParamSpec
from hpcsgd.optim import Optimizer
from hpcsgd.step import Phases, exchange_update

mode = sys.argv[1]
comm = MPI.COMM_WORLD
rank, K = comm.Get_rank(), comm.Get_size()
over = ["exchange.aggregation=allreduce"] if mode == "allreduce" else [
    "exchange.aggregation=striped", f"exchange.codec={mode}"]
cfg = config.load(None, ["data.train=unused", *over])
specs = [ParamSpec("W0", (5, 6)), ParamSpec("b0", (1, 6), "bias"),
         ParamSpec("clip", (1, 2), "clip", "float"), ParamSpec("frozen", (2, 3), "weight", "none")]
params, grad = FlatParams(specs), FlatParams(specs)
params.flat[:] = np.arange(params.size, dtype=np.float32) / 8
before = params.flat.copy()
ex = make_exchange(cfg, comm, params.matrices)
opt = Optimizer(params.size, post_size=ex.state_size)
lr = 0.25
sums = np.zeros(params.size, np.float32)
for step in range(3):
    g = np.random.default_rng([step, rank]).integers(-4, 5, params.size).astype(np.float32)
    total = np.empty_like(g)
    comm.Allreduce(g, total)           # what the float parameter's update must be
    sums += total
    grad.flat[:] = g
    opt.begin_step(64 * K, 64)
    exchange_update(ex, opt, params.flat, grad.flat, lr, Phases())
clip, frozen = params.views["clip"].reshape(-1), params.views["frozen"].reshape(-1)
m = {mm.name: mm for mm in params.matrices}
want = before[m["clip"].offset:m["clip"].offset + 2] - lr * sums[m["clip"].offset:m["clip"].offset + 2]
assert np.array_equal(clip, want), (clip, want)
assert np.array_equal(frozen, before[m["frozen"].offset:m["frozen"].offset + 6]), frozen
codec_part = slice(0, params.codec_size)
assert not np.array_equal(params.flat[codec_part], before[codec_part])
crcs = comm.allgather(zlib.crc32(params.flat.tobytes()))
assert len(set(crcs)) == 1, crcs
if mode != "allreduce" and ex.fuses_owner:
    raise AssertionError("a float piece must turn the fused owner pass off")
if rank == 0:
    print(f"OK {mode} K={K}")
