"""Parameters exchanged as their specs say, under mpiexec -n K: "codec" through the codec,
"float" summed exactly in float32 (never quantized), "none" never touched.

    mpiexec -n K python tests/mpi/exchange_specs.py allreduce|onebit|kbit

Every rank's gradient is small integers (exact in float32 whatever the summation order), the
optimizer plain SGD (no momentum, decay or AdaGrad) and lr a power of two, so the float
parameter's update is exact: W_after = W_before - lr * sum over ranks. With 1-bit SGD the
fused owner and apply passes (the float piece beside them unfused) give the bits of the
unfused steps, momentum on. Prints OK.
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
specs = [ParamSpec("W0", (5, 6)), ParamSpec("b0", (1, 6), "bias"),
         ParamSpec("clip", (1, 2), "clip", "float"), ParamSpec("frozen", (2, 3), "weight", "none")]
lr = 0.25


def train(*extra):
    """3 steps of exchange + update; (params, their start, the summed gradients, exchange)."""
    cfg = config.load(None, ["data.train=unused", *over, *extra])
    params, grad = FlatParams(specs), FlatParams(specs)
    params.flat[:] = np.arange(params.size, dtype=np.float32) / 8
    before = params.flat.copy()
    ex = make_exchange(cfg, comm, params.matrices)
    opt = Optimizer(params.size, momentum_time_constant=100.0, post_size=ex.state_size) \
        if extra else Optimizer(params.size, post_size=ex.state_size)
    sums = np.zeros(params.size, np.float32)
    for step in range(3):
        g = np.random.default_rng([step, rank]).integers(-4, 5, params.size).astype(np.float32)
        total = np.empty_like(g)
        comm.Allreduce(g, total)           # what the float parameter's update must be
        sums += total
        grad.flat[:] = g
        opt.begin_step(64 * K, 64)
        exchange_update(ex, opt, params.flat, grad.flat, lr, Phases())
    return params, before, sums, ex


params, before, sums, ex = train()
clip, frozen = params.views["clip"].reshape(-1), params.views["frozen"].reshape(-1)
m = {mm.name: mm for mm in params.matrices}
want = before[m["clip"].offset:m["clip"].offset + 2] - lr * sums[m["clip"].offset:m["clip"].offset + 2]
assert np.array_equal(clip, want), (clip, want)
assert np.array_equal(frozen, before[m["frozen"].offset:m["frozen"].offset + 6]), frozen
codec_part = slice(0, params.codec_size)
assert not np.array_equal(params.flat[codec_part], before[codec_part])
crcs = comm.allgather(zlib.crc32(params.flat.tobytes()))
assert len(set(crcs)) == 1, crcs
if mode == "onebit":   # the float piece beside the fused codec passes: their bits, unfused
    assert ex.fuses_owner and ex.fuses_apply
    fused = train("optim.momentum_tc=100")[0].flat
    unfused, _, _, plain = train("optim.momentum_tc=100", "exchange.fuse_owner=false")
    assert not plain.fuses_owner
    assert np.array_equal(fused, unfused.flat), (fused, unfused.flat)
if rank == 0:
    print(f"OK {mode} K={K}")
