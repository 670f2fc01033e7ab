"""`hpcsgd bench machine`: the limits the other benchmarks are judged against, measured here,
each beside the limit above it, all in this run.

    hpcsgd bench machine [--small] [--ranks 2,4] [--minibatch 1024] [--sizes 4096,...]
                         [--json FILE] [--compare OLD.json] [--emulate 1,10,25]

memory  fused copy and triad (hpcsgd/bench/membw.py), 1 thread and all cores, best of R,
        200 MB per array (the bytes counted are read + written, no write-allocate).
GEMM    float32 GFLOP/s of every distinct GEMM of one training step of the model (forward,
        dW, dX) at the minibatch, on all cores, each beside a 2048^3 product timed in
        alternation with it (the BLAS's best here), and a 4096^3 product on 1 thread and all
        cores. (A nominal peak from /proc/cpuinfo is no limit in this VM: its 'cpu MHz' is the
        base clock, and the GEMMs measured exceed 2 cores x 2.6 GHz x 32 FLOP/cycle.)
MPI     in-place Allreduce (float32 sum), Alltoall and in-place Allgather bus bandwidth over
        message sizes under mpiexec -n K (hpcsgd/bench/launch.py), beside the rate one core
        copies memory at (on one machine MPICH moves the bytes by memory copies, one core per
        rank) or, across the emulated cluster (--emulate), the link rate.

Bus bandwidth (nccl-tests' convention): bytes / time x the share that must cross a rank's
link -- allreduce 2(K-1)/K of the buffer, alltoall and allgather (K-1)/K of the whole send or
gathered buffer -- so it is comparable to one link's rate whatever K. Each point is the
median over repetitions of the slowest rank; small messages repeat the call to fill ~1 MB.
"""
import argparse
import statistics
import sys
import time

import numpy as np

from hpcsgd.bench import gemm, launch, membw, report
from hpcsgd.threads import blas_threads

USES_MPI = True
COLLECTIVES = {"allreduce": lambda k: 2 * (k - 1) / k, "alltoall": lambda k: (k - 1) / k,
               "allgather": lambda k: (k - 1) / k}
GRADIENT_BYTES = 45_145_176 * 4       # the 46M model's float32 gradient


def add_arguments(parser):
    parser.add_argument("--small", action="store_true", help="quick smoke test (CI, seconds)")
    parser.add_argument("--ranks", default=None, help="MPI ranks K, comma-separated (default 2,4)")
    parser.add_argument("--minibatch", type=int, default=None, help="frames in the GEMM shapes")
    parser.add_argument("--sizes", default=None,
                        help="MPI message sizes in bytes (default 4 KiB .. the 46M gradient)")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions per figure")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mpiexec run")


def run(args):
    from hpcsgd.bench.train import PAPER, SMALL
    small = args.small
    cores = launch.cores()
    repeats = args.repeats or (2 if small else 5)
    ranks = [int(k) for k in (args.ranks or ("2" if small else "2,4")).split(",")]
    sizes = [int(s) for s in (args.sizes or ("4096,65536,1048576" if small else
                                             f"4096,65536,1048576,16777216,{GRADIENT_BYTES}"))
             .split(",")]
    n = args.minibatch or (256 if small else 1024)
    shape = SMALL if small else PAPER
    nbytes = (8 << 20) if small else (200 << 20)
    gbps = launch.link_gbps()
    print(f"hpcsgd bench machine: {cores} cores, load average {report.load_average():.2f}"
          f"{f', emulated link {gbps:g} Gbit/s' if gbps else ''}")

    # 1. memory bandwidth, 1 thread and all cores
    threads0 = membw.set_threads(None)
    memory = {}
    for t in sorted({1, cores}):
        memory[t] = {"copy_GBps": membw.copy_bandwidth(nbytes, t, repeats),
                     "triad_GBps": membw.triad_bandwidth(nbytes, t, repeats)}
    membw.set_threads(threads0)
    print(f"\nmemory ({nbytes >> 20} MB arrays, best of {repeats}; GB/s = bytes read + written)")
    print(f"{'threads':>7s} {'copy GB/s':>10s} {'triad GB/s':>11s} {'copy/triad':>10s}")
    for t, m in memory.items():
        print(f"{t:>7d} {m['copy_GBps']:>10.1f} {m['triad_GBps']:>11.1f} "
              f"{m['copy_GBps'] / m['triad_GBps']:>10.2f}")

    # 2. GEMM: the model's shapes on all cores, each timed in alternation with a square
    # product (the BLAS's best here) so that shape and limit see the same neighbours
    blas0 = blas_threads()
    side = 1024 if small else 4096
    square = {}
    for t in sorted({1, cores}):
        blas_threads(t)
        run, flop = gemm.gemm_timer(side, side, side)
        square[t] = flop / membw.best_time(run, repeats) / 1e9
    blas_threads(cores)
    alt, alt_flop = gemm.gemm_timer(side // 2, side // 2, side // 2)
    dims = [shape["input_dim"], *shape["hidden"], shape["num_labels"]]
    shapes, beside = {}, {}
    for label, (m, k, o, ta, tb) in gemm.training_shapes(dims, n).items():
        run, flop = gemm.gemm_timer(m, k, o, ta, tb)
        t_shape = t_alt = float("inf")
        for _ in range(repeats):
            t_alt = min(t_alt, membw.best_time(alt, 1))
            t_shape = min(t_shape, membw.best_time(run, 1))
        shapes[label], beside[label] = flop / t_shape / 1e9, alt_flop / t_alt / 1e9
    blas_threads(blas0)
    print(f"\nfloat32 GEMM, OpenBLAS, best of {repeats}: {side}^3 product {square[1]:.1f} GFLOP/s "
          f"on 1 thread, {square[cores]:.1f} on {cores}; each training shape beside a "
          f"{side // 2}^3 product timed in alternation with it (the limit)")
    print(f"{'training shape (' + str(cores) + ' threads)':40s} {'GFLOP/s':>8s} "
          f"{str(side // 2) + '^3':>8s} {'of it':>6s}")
    for label, g in shapes.items():
        print(f"{label:40s} {g:>8.1f} {beside[label]:>8.1f} {g / beside[label]:>6.0%}")

    # 3. MPI collectives under mpiexec -n K
    copy1 = memory[1]["copy_GBps"] / 2          # bytes copied per second by one core
    limit = gbps / 8 if gbps else copy1
    limit_name = f"link {gbps:g} Gbit/s" if gbps else "1-core memcpy"
    mpi = []
    for k in ranks:
        res = launch.mpirun(k, "hpcsgd.bench.machine", ["--sizes", ",".join(map(str, sizes)),
                                                        "--repeats", repeats], args.timeout)
        mpi.append(res)
        print(f"\nMPI, K = {k} ranks ({res['threads_per_rank']} thread(s) each), median of "
              f"{repeats}, slowest rank; bus bandwidth GB/s beside the limit: {limit_name} "
              f"{limit:.2f} GB/s")
        print(f"{'bytes':>11s} " + " ".join(f"{c + ' us':>14s} {'busbw':>6s} {'of lim':>6s}"
                                            for c in COLLECTIVES))
        for row in res["rows"]:
            print(f"{row['bytes']:>11,d} " + " ".join(
                f"{1e6 * row[c]['time_s']:>14.1f} {row[c]['busbw_GBps']:>6.2f} "
                f"{row[c]['busbw_GBps'] / limit:>6.0%}" for c in COLLECTIVES))
    return {"small": small, "memory": {str(t): m for t, m in memory.items()},
            "gemm": {"threads": cores, "minibatch": n, "model": "small" if small else "paper-46M",
                     "square_side": side, "square_gflops": {str(t): g for t, g in square.items()},
                     "shapes": shapes, "square_beside_shapes": beside},
            "mpi": {"limit_GBps": limit, "limit": limit_name, "link_gbps": gbps, "runs": mpi}}


def figures(res):
    out = {}
    for t, m in res["memory"].items():
        out[f"copy GB/s {t} thread(s)"] = m["copy_GBps"]
        out[f"triad GB/s {t} thread(s)"] = m["triad_GBps"]
    g = res["gemm"]
    for t, x in g["square_gflops"].items():
        out[f"GEMM {g['square_side']}^3 GFLOP/s {t} thread(s)"] = x
    for label, x in g["shapes"].items():
        out[f"GEMM {label} GFLOP/s"] = x
        out[f"GEMM {label} of square"] = x / g["square_beside_shapes"][label]
    for run in res["mpi"]["runs"]:
        for row in run["rows"]:
            for c in COLLECTIVES:
                out[f"K={run['ranks']} {c} {row['bytes']} B busbw GB/s"] = row[c]["busbw_GBps"]
    return out


# ---- rank side (under mpiexec, started by run() through launch.mpirun) -----------------------
def worker(argv):
    from mpi4py import MPI
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    k = comm.Get_size()
    sizes = [int(s) for s in a.sizes.split(",")]
    top = max(sizes) + 4 * k
    # preallocated once at the largest size; zeros, so the repeated sums stay finite
    fbuf = np.zeros(top // 4, np.float32)
    send = np.zeros(top, np.uint8)
    recv = np.zeros(top, np.uint8)
    rows = []
    for nbytes in sizes:
        block = max(1, nbytes // k)              # alltoall / allgather: per-rank block
        whole = block * k
        calls = {
            "allreduce": lambda: comm.Allreduce(MPI.IN_PLACE, fbuf[:max(1, nbytes // 4)],
                                                op=MPI.SUM),
            "alltoall": lambda: comm.Alltoall([send[:whole], MPI.BYTE], [recv[:whole], MPI.BYTE]),
            "allgather": lambda: comm.Allgather(MPI.IN_PLACE, [recv[:whole], MPI.BYTE]),
        }
        moved = {"allreduce": 4 * max(1, nbytes // 4), "alltoall": whole, "allgather": whole}
        inner = max(1, min(256, (1 << 20) // max(nbytes, 1)))   # fill ~1 MB per sample
        row = {"bytes": nbytes}
        for name, fn in calls.items():
            samples = []
            for _ in range(a.repeats + 1):       # the first warms up (connections, pages)
                comm.Barrier()
                t = time.perf_counter()
                for _ in range(inner):
                    fn()
                samples.append(comm.allreduce((time.perf_counter() - t) / inner, op=MPI.MAX))
            dt = statistics.median(samples[1:])
            alg = moved[name] / dt / 1e9
            row[name] = {"time_s": dt, "algbw_GBps": alg,
                         "busbw_GBps": alg * COLLECTIVES[name](k)}
        rows.append(row)
    launch.write_result(comm, {"ranks": k, "repeats": a.repeats, "rows": rows}, a.json)
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
