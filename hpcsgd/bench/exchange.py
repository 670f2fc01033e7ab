"""`hpcsgd bench exchange`: time per exchange of the paper's 46M-parameter gradient
(440-7x2048-9304 + biases) with allreduce and with striped + each codec, per phase, and
bytes on the wire per rank per step, every figure beside the float32 in-place MPI Allreduce
time measured in the same run.

    hpcsgd bench exchange [--small] [--json FILE] [--ranks 2,4] [--codecs onebit,kbit4]
                          [--repeats R]

Launches itself: for each K it runs `mpiexec -n K python -m hpcsgd.bench.exchange_worker`
(the mpiexec beside this Python, i.e. the venv's MPICH) and collects the JSON. Numba threads
per rank = max(1, cores // K); with more ranks than cores MPIR_CVAR_ENABLE_HEAVY_YIELD=1 so
waiting ranks yield their core. On one machine the "network" is shared memory, so this
measures the codec passes against a memory copy, not a cluster link (docs/exchange.md).
"""
import json
import os
import subprocess
import sys
import tempfile

PHASES = ("encode", "alltoallv", "decode_sum", "post_process", "reencode", "allgatherv",
          "decode_apply", "allreduce", "decode", "apply")


def add_arguments(parser):
    parser.add_argument("--small", action="store_true", help="a tiny model, for a CI smoke test")
    parser.add_argument("--json", metavar="FILE", help="write all results as JSON")
    parser.add_argument("--ranks", default="2,4", help="comma-separated K values (default 2,4)")
    parser.add_argument("--codecs", default="onebit,kbit4,float16,float32,dettmers",
                        help="striped codecs: onebit,kbit2,kbit4,kbit8,dettmers,float16,float32")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per figure (median)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per mpiexec run")


def run(args):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cores = os.cpu_count() or 1
    repeats = args.repeats or (3 if args.small else 5)
    with open("/proc/loadavg") as f:
        load = f.read().split()[0]
    print(f"hpcsgd bench exchange: {cores} cores, load average {load} (other processes skew "
          f"the figures; re-run when the load is low)")
    report = {"cores": cores, "load_average_start": float(load), "runs": []}
    for K in [int(k) for k in args.ranks.split(",")]:
        env = dict(os.environ, NUMBA_NUM_THREADS=str(max(1, cores // K)),
                   OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if K > cores:
            env["MPIR_CVAR_ENABLE_HEAVY_YIELD"] = "1"
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "result.json")
            cmd = [mpiexec, "-n", str(K), sys.executable, "-m", "hpcsgd.bench.exchange_worker",
                   "--json", out, "--repeats", str(repeats), "--codecs", args.codecs]
            if args.small:
                cmd.append("--small")
            proc = subprocess.run(cmd, env=env, timeout=args.timeout)
            if proc.returncode != 0:
                print(f"hpcsgd bench exchange: mpiexec -n {K} failed (exit {proc.returncode})",
                      file=sys.stderr)
                return 1
            with open(out) as f:
                result = json.load(f)
        result["numba_threads_per_rank"] = int(env["NUMBA_NUM_THREADS"])
        report["runs"].append(result)
        print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


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
