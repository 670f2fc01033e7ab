"""Benchmarks, each figure beside the machine limit it is measured against in the same run.

`hpcsgd bench NAME [--small] [--json FILE] [--compare OLD.json] [--emulate 1,10,25]`;
NAME -> module with add_arguments(parser) and run(args) -> result dict (optionally
figures(result) -> {label: number}, the headline figures --compare shows; USES_MPI = True where
the rank side runs under mpiexec through launch.py, which makes --emulate available).
--json and --compare are one implementation for all (report.py); --emulate repeats the whole
benchmark across an emulated cluster per link rate (emucluster.py, root only).
"""
import argparse
import importlib
import sys

USAGE = """Benchmarks: each figure beside the machine limit it is measured against in the same run
(memory bandwidth, GEMM rate, float32 Allreduce, the link), with the exact command recorded.

benchmarks (hpcsgd bench NAME --help for each one's options):
  ctc       CTC loss + gradient kernel ms and GB/s vs memory bandwidth and PyTorch
  cuda      every CUDA kernel compiled for sm_80/sm_90 (no GPU needed): registers, spills
  decode    beam search real-time factor per core beside the acoustic model's
  exchange  exchange time per phase vs float32 in-place Allreduce
  int4      an INT4 model's LSTM products, float32 beside int8 (VNNI) GEMMs, vs the GEMM rates
  kernels   codec encode/decode-accumulate GB/s vs memory bandwidth
  loader    spliced+CMVN frames/s vs raw HDF5 read rate
  machine   memory, GEMM and MPI collective limits of this machine
  plan      Eq. 4: K-hat, predicted speed-ups, check against bench train
  rnnt      RNN-T loss + gradient kernel ms, GB/s and memory vs bandwidth and torchaudio
  train     frames/s at K ranks vs the GEMM roofline and no exchange"""
EXAMPLES = """examples:
  hpcsgd bench train --config jobs/configs/so762.yaml --ranks 1,2     the model users train
  hpcsgd bench exchange --ranks 2 --json ex.json --compare docs/bench/exchange.json
  hpcsgd bench kernels --small                                         seconds
Results and the commands behind them: docs/benchmarks.md."""

BENCHES = {
    "ctc": ("hpcsgd.bench.ctc", "CTC loss + gradient kernel ms and GB/s vs memory bandwidth and PyTorch"),
    "cuda": ("hpcsgd.bench.cuda", "every CUDA kernel compiled for sm_80/sm_90: registers, spills"),
    "decode": ("hpcsgd.bench.decode", "beam search real-time factor per core vs the acoustic model's"),
    "exchange": ("hpcsgd.bench.exchange", "exchange time per phase vs float32 in-place Allreduce"),
    "int4": ("hpcsgd.bench.int4", "an INT4 model's LSTM products, float32 beside int8 (VNNI) GEMMs, vs the GEMM rates"),
    "kernels": ("hpcsgd.bench.kernels", "codec encode/decode-accumulate GB/s vs memory bandwidth"),
    "loader": ("hpcsgd.bench.loader", "spliced+CMVN frames/s vs raw HDF5 read rate"),
    "machine": ("hpcsgd.bench.machine", "memory, GEMM and MPI collective limits of this machine"),
    "plan": ("hpcsgd.bench.plan", "Eq. 4: K-hat, predicted speed-ups, check against bench train"),
    "rnnt": ("hpcsgd.bench.rnnt", "RNN-T loss + gradient kernel ms, GB/s and memory vs bandwidth and torchaudio"),
    "train": ("hpcsgd.bench.train", "frames/s at K ranks vs the GEMM roofline and no exchange"),
}


def add_arguments(parser):
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")


def run(args):
    from hpcsgd.bench import emucluster, launch, report
    module = importlib.import_module(BENCHES[args.name][0])
    from hpcsgd.cli import HelpFormatter, usage
    parser = argparse.ArgumentParser(prog=f"hpcsgd bench {args.name}", description=usage(module),
                                     epilog=getattr(module, "EXAMPLES", None),
                                     formatter_class=HelpFormatter)
    module.add_arguments(parser)
    report.add_arguments(parser)
    mpi = getattr(module, "USES_MPI", False)
    if mpi:
        emucluster.add_bench_arguments(parser)
    opts = parser.parse_args(args.rest)
    head = report.header(args.name, args.rest)
    try:
        if mpi and opts.emulate:
            result = emucluster.bench(lambda: module.run(opts), opts)
        else:
            result = module.run(opts)
    except (launch.LaunchError, emucluster.NeedsRoot, emucluster.Busy) as err:
        print(f"hpcsgd bench {args.name}: {err}", file=sys.stderr)
        return {emucluster.NeedsRoot: 2, emucluster.Busy: emucluster.EXIT_BUSY}.get(type(err), 1)
    except emucluster.Interrupted as err:
        print(f"hpcsgd bench {args.name}: interrupted ({err}); emulated cluster torn down",
              file=sys.stderr)
        return 130
    if isinstance(result, int):   # the benchmark's own failure code
        return result
    return report.finish(head, module, result, opts)
