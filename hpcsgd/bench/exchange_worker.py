"""The rank side of `hpcsgd bench exchange` (run under mpiexec by hpcsgd/bench/exchange.py).

    mpiexec -n K python -m hpcsgd.bench.exchange_worker --json OUT [--small] [--repeats R]
        [--codecs onebit,kbit4,...] [--device cuda] [--mpi-cuda-aware auto|true|false]

Every rank builds the model's flat gradient (random normal, scaled like a summed gradient,
different per rank), a momentum optimizer, and runs the real exchange objects of the trainer
(hpcsgd/comm/exchange.py, driven by hpcsgd/step.py's exchange_update) R times each: the float32 in-place Allreduce alone (the baseline
every other figure is divided by, measured in this same run), allreduce + post-processing,
and striped with each codec. Per repetition every rank starts together (a barrier) and the
phases are timed per rank; a repetition's time is the slowest rank's (the step waits for
it), and the median over repetitions is reported. Rank 0 writes the JSON.

--device cuda: GPU ranks (one GPU per local rank). Gradient, parameters, codec buffers and
optimizer state live on the device; the baseline is the float32 in-place Allreduce of the
device buffer as the trainer would do it without NCCL (CUDA-aware MPI, or staged through
pinned host memory), and "allreduce_nccl" is NCCL's when CuPy's binding loads. Phase times
include a device sync at each phase's end.
"""
import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from hpcsgd import optim
from hpcsgd.bench import launch
from hpcsgd.codecs import make_codec
from hpcsgd.comm.exchange import Allreduce, Striped
from hpcsgd.comm.gpu import (ENV_CUDA_AWARE, Nccl, Staging, bind_gpu, mpi_cuda_aware,
                             nccl_available, shared_gpus)
from hpcsgd.comm.grid import Grid
from hpcsgd.device import assign, is_device, synchronize
from hpcsgd.model.dnn import layout
from hpcsgd.model.flat import FlatParams
from hpcsgd.step import Phases, exchange_update

PAPER = (440, [2048] * 7, 9304)    # the paper's 46M model: 440-7x2048-9304
SMALL = (44, [256] * 3, 930)
CODECS = {"onebit": ("onebit", {}), "kbit2": ("kbit", {"bits": 2}), "kbit4": ("kbit", {"bits": 4}),
          "kbit8": ("kbit", {"bits": 8}), "dettmers": ("dettmers", {}),
          "float16": ("float16", {}), "float32": ("float32", {})}


def timed(comm, ex, grad, params, opt, source, repeats):
    """Median over repetitions of the slowest rank's per-phase seconds (and their total):
    the trainer's exchange and update (hpcsgd/step.py: exchange_update)."""
    rows = []
    device = "cuda" if is_device(grad) else "cpu"
    phases = Phases(device)
    for _ in range(repeats + 1):          # the first repetition warms up (JIT, page faults)
        assign(grad, source)
        synchronize(device)
        opt.begin_step(1024 * comm.Get_size(), 1024)
        comm.Barrier()                    # everyone starts together
        t = time.perf_counter()
        exchange_update(ex, opt, params, grad, 1e-6, phases)
        total = time.perf_counter() - t
        times = phases.pop()
        times["total"] = total
        worst = {k: comm.allreduce(v, op=MPI.MAX) for k, v in times.items()}
        rows.append(worst)
    rows = rows[1:]
    return {k: float(np.median([r[k] for r in rows])) for k in rows[0]}


def device_copy_gbps(grad, repeats):
    """GB/s of a device-to-device copy of the gradient (bytes read + written), the best of
    repeats + 1, each timed between two syncs: the memory-bound pass a codec's is held to."""
    from hpcsgd.device import zeros
    dst = zeros(grad.size, grad.dtype, "cuda")
    best = float("inf")
    for _ in range(repeats + 1):
        synchronize("cuda")
        t = time.perf_counter()
        dst.copy_to_device(grad)
        synchronize("cuda")
        best = min(best, time.perf_counter() - t)
    return 2 * grad.nbytes / best / 1e9


def pass_bytes(ex):
    """Bytes each GPU pass of a striped exchange must move at least, by phase: encode reads
    the gradient and residual 1 and writes residual 1 and the packed gradient; decode_sum
    reads K packed contributions to the stripe and writes its float32 sum; reencode reads
    the stripe's update and residual 2, writes residual 2 and the packed stripe; decode_apply
    reads every packed stripe and the weights, writes the weights."""
    n, mine, K = ex.size, ex.state_size, ex.world
    packed_all, packed_mine = int(ex.counts.sum()), int(ex.counts[ex.rank])
    return {"encode": 12 * n + packed_all, "decode_sum": K * packed_mine + 4 * mine,
            "reencode": 12 * mine + packed_mine, "decode_apply": packed_all + 8 * n}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--json", required=True)
    p.add_argument("--small", action="store_true")
    p.add_argument("--parameters", type=int, default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--codecs", default="onebit,kbit4,float16,float32,dettmers")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--mpi-cuda-aware", default="auto", choices=("auto", "true", "false"))
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, K = comm.Get_rank(), comm.Get_size()
    dev = args.device
    aware, how = False, "host buffers"
    if dev == "cuda":
        bind_gpu(Grid(comm).node_rank)
        aware, how = mpi_cuda_aware(args.mpi_cuda_aware, os.environ.get(ENV_CUDA_AWARE, ""))
    shape = SMALL if args.small else PAPER
    if args.parameters:   # 440-2048-n, n the nearest to the asked size (>= 1)
        first = 441 * 2048
        shape = (440, [2048], max(1, round((args.parameters - first) / 2049)))
    params = FlatParams(layout(*shape), device=dev)
    grad = FlatParams(params.layout, device=dev).flat
    rng = np.random.default_rng(rank)
    source = (rng.standard_normal(params.size) * 0.05).astype(np.float32)
    start = rng.standard_normal(params.size).astype(np.float32) * 0.01
    comm.Bcast(start, root=0)             # replicas start equal, as in training
    assign(params.flat, start)
    out = {"ranks": K, "parameters": params.size, "repeats": args.repeats, "device": dev,
           "mpi_cuda_aware": aware, "mpi_cuda_aware_how": how, "results": {}}

    def run(name, ex, post_size):
        opt = optim.Optimizer(params.size, momentum_time_constant=10000.0, post_size=post_size,
                              device=dev)
        res = timed(comm, ex, grad, params.flat, opt, source, args.repeats)
        res["bytes_per_rank"] = wire(ex)
        out["results"][name] = res
        if rank == 0:
            print(f"  K={K} {name:22s} {1e3 * res['total']:9.2f} ms", flush=True)

    def wire(ex):   # the largest of any rank (striped: stripes differ by a column)
        return comm.allreduce(ex.bytes_on_wire(), op=MPI.MAX)

    # baseline: the Allreduce alone (GPU ranks: of the device buffer, staged or CUDA-aware),
    # then with the post-processing every rank does after it
    base = Allreduce(comm, params.size, "float32", device=dev, cuda_aware=aware)
    stage = Staging((params.size,), np.float32, dev, aware)
    res = {"total": []}
    for _ in range(args.repeats + 1):
        assign(grad, source)
        synchronize(dev)
        comm.Barrier()
        t = time.perf_counter()
        buf = stage.to_mpi(grad)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)   # cross-rank sync point
        stage.from_mpi(grad)
        synchronize(dev)
        res["total"].append(comm.allreduce(time.perf_counter() - t, op=MPI.MAX))
    out["results"]["allreduce_f32_inplace"] = {"total": float(np.median(res["total"][1:])),
                                               "bytes_per_rank": wire(base)}
    if rank == 0:
        print(f"  K={K} {'allreduce_f32_inplace':22s} "
              f"{1e3 * out['results']['allreduce_f32_inplace']['total']:9.2f} ms", flush=True)
    run("allreduce_f32+post+apply", base, params.size)
    run("allreduce_f16+post+apply", Allreduce(comm, params.size, "float16", device=dev,
                                              cuda_aware=aware), params.size)
    del base
    shared = shared_gpus(comm) if dev == "cuda" and K > 1 else ""
    if shared and rank == 0:   # NCCL refuses two ranks on one device: not measured
        print(f"  K={K} NCCL rows skipped: {shared}", flush=True)
    if dev == "cuda" and K > 1 and not shared and nccl_available()[0]:
        nccl = Nccl(comm)
        run("allreduce_nccl+post+apply", Allreduce(comm, params.size, "float32", device=dev,
                                                   nccl=nccl), params.size)
        run("allreduce_nccl16+post+apply", Allreduce(comm, params.size, "float16", device=dev,
                                                     nccl=nccl), params.size)
    if dev == "cuda":   # the limit a codec's passes are held to: this GPU's copy rate
        out["device_copy_GBps"] = device_copy_gbps(grad, args.repeats)
        if rank == 0:
            print(f"  device-to-device copy of the gradient: {out['device_copy_GBps']:.0f} GB/s "
                  f"(read + write)", flush=True)
    for name in args.codecs.split(","):
        # NAME_unfused: the owner's three passes instead of the fused one (an A/B in one run)
        codec_name, opts = CODECS[name.removesuffix("_unfused")]
        ex = Striped(comm, params.matrices, make_codec(codec_name, dev, **opts), device=dev,
                     cuda_aware=aware, fuse_owner=not name.endswith("_unfused"))
        run(f"striped_{name}", ex, ex.state_size)
        if dev == "cuda":
            res = out["results"][f"striped_{name}"]
            res["phase_GBps"] = {p: b / res[p] / 1e9 for p, b in pass_bytes(ex).items()
                                 if res.get(p)}
            res["phase_of_copy"] = {p: v / out["device_copy_GBps"]
                                    for p, v in res["phase_GBps"].items()}
            if rank == 0:
                print("    " + ", ".join(f"{p} {v:.0f} GB/s = {res['phase_of_copy'][p]:.0%}"
                                         for p, v in res["phase_GBps"].items())
                      + " of the copy", flush=True)
        del ex
    launch.write_result(comm, out, args.json)


if __name__ == "__main__":
    main()
