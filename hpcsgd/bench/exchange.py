"""`hpcsgd bench exchange`: time per exchange of the paper's 46M-parameter gradient
(440-7x2048-9304 + biases; --parameters M: a 440-2048-n one of about M) with allreduce and
with striped + each codec, per phase, and bytes on the wire per rank per step, every figure
beside the float32 in-place MPI Allreduce time measured in the same run.

    hpcsgd bench exchange [--small] [--json FILE] [--compare OLD] [--ranks 2,4]
                          [--codecs onebit,kbit4] [--repeats R] [--emulate 1,10,25]
                          [--device cuda [--mpi-cuda-aware auto|true|false]]

For each K it runs `mpiexec -n K python -m hpcsgd.bench.exchange_worker` through
hpcsgd/bench/launch.py (threads per rank = cores // K, heavy yield when ranks outnumber
cores; across the emulated cluster with --emulate). On one machine the "network" is shared
memory, so this measures the codec passes against a memory copy, not a cluster link
(docs/exchange.md).
"""
from hpcsgd.bench import launch, report

PHASES = ("encode", "alltoallv", "decode_sum", "post_process", "reencode", "owner",
          "allgatherv", "decode_apply", "allreduce", "decode", "apply")
USES_MPI = True   # bench --emulate runs it across the emulated cluster


def add_arguments(parser):
    parser.add_argument("--small", action="store_true", help="a tiny model, for a CI smoke test")
    parser.add_argument("--parameters", type=int, default=None,
                        help="a gradient of about this many values instead of the paper's 46M "
                             "(a 440-2048-n DNN's; e.g. another model's, its `params` in `bench "
                             "train --config`'s JSON), for `bench plan --exchange-json`")
    parser.add_argument("--ranks", default="2,4", help="comma-separated K values (default 2,4)")
    parser.add_argument("--codecs", default="onebit,kbit4,float16,float32,dettmers",
                        help="striped codecs: onebit,kbit2,kbit4,kbit8,dettmers,float16,float32; "
                             "onebit_unfused: the owner's 3 passes instead of the fused one")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (median)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per mpiexec run")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: GPU ranks, every buffer on the device (one GPU per local rank)")
    parser.add_argument("--mpi-cuda-aware", default="auto", choices=("auto", "true", "false"),
                        help="--device cuda: hand device buffers to MPI (auto = ask the library)")


def run(args):
    repeats = args.repeats or (3 if args.small else 5)
    print(f"hpcsgd bench exchange: {launch.cores()} cores, load average "
          f"{report.load_average():.2f} (other processes skew the figures; re-run when the load "
          f"is low)")
    out = {"runs": []}
    for K in [int(k) for k in args.ranks.split(",")]:
        worker = ["--repeats", repeats, "--codecs", args.codecs, "--device", args.device,
                  "--mpi-cuda-aware", args.mpi_cuda_aware]
        worker += ["--small"] if args.small else []
        worker += ["--parameters", args.parameters] if args.parameters else []
        result = launch.mpirun(K, "hpcsgd.bench.exchange_worker", worker, args.timeout)
        result["numba_threads_per_rank"] = result["threads_per_rank"]
        out["runs"].append(result)
        print_table(result)
    return out


def figures(res):
    """ms per exchange and the ratio to the float32 in-place Allreduce, per K and method."""
    out = {}
    for run in res["runs"]:
        r = run["results"]
        base = r["allreduce_f32_inplace"]["total"]
        for name, x in r.items():
            out[f"K={run['ranks']} {name} ms"] = 1e3 * x["total"]
            if name != "allreduce_f32_inplace":
                out[f"K={run['ranks']} {name} / allreduce"] = x["total"] / base
    return out


def print_table(result):
    res = result["results"]
    base = res["allreduce_f32_inplace"]["total"]
    print(f"\nK = {result['ranks']}, {result['parameters']:,} parameters, median of "
          f"{result['repeats']}, slowest rank; ms per exchange (x = / float32 in-place Allreduce "
          f"{1e3 * base:.1f} ms)")
    cols = [p for p in PHASES if any(p in r for r in res.values())]
    print(f"{'method':24s} {'total':>9s} {'x':>6s} {'MB/rank':>8s} " +
          " ".join(f"{c[:11]:>11s}" for c in cols))
    for name, r in res.items():
        print(f"{name:24s} {1e3 * r['total']:9.2f} {r['total'] / base:6.2f} "
              f"{r['bytes_per_rank'] / 1e6:8.2f} " +
              " ".join(f"{1e3 * r[c]:11.2f}" if c in r else f"{'':11s}" for c in cols))
