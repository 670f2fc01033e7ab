"""Benchmarks, each figure beside the machine limit it is measured against in the same run.

`hpcsgd bench NAME [--small] [--json FILE]`; NAME -> module with add_arguments/run.
"""
import argparse
import importlib

BENCHES = {
    "exchange": ("hpcsgd.bench.exchange", "exchange time per phase vs float32 in-place Allreduce"),
    "kernels": ("hpcsgd.bench.kernels", "codec encode/decode-accumulate GB/s vs memory bandwidth"),
    "loader": ("hpcsgd.bench.loader", "spliced+CMVN frames/s vs raw HDF5 read rate"),
    "plan": ("hpcsgd.bench.plan", "Eq. 4: optimal node count K-hat and predicted speed-up per codec"),
    "train": ("hpcsgd.bench.train", "training frames/s vs the GEMM-only roofline"),
}


def add_arguments(parser):
    parser.add_argument("name", choices=sorted(BENCHES), help="which benchmark")
    parser.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark")


def run(args):
    module = importlib.import_module(BENCHES[args.name][0])
    parser = argparse.ArgumentParser(prog=f"hpcsgd bench {args.name}", description=module.__doc__)
    module.add_arguments(parser)
    return module.run(parser.parse_args(args.rest))
