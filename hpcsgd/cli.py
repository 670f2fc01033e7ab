"""The `hpcsgd` command: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`; it is imported
only when chosen, so `hpcsgd inspect` does not pay for numba-compiling the trainer.
"""
import argparse
import importlib
import signal
import sys

from hpcsgd.errors import UserError

# name -> (module, one-line help). `bench` has its own subcommands (hpcsgd/bench/__init__.py).
SUBCOMMANDS = {
    "prep": ("data_prep.prep", "audio + alignments -> sharded HDF5 feature archive"),
    "inspect": ("hpcsgd.data.inspect", "validate an archive and print a summary"),
    "train": ("hpcsgd.train", "train an acoustic model (run under mpiexec for K ranks)"),
    "eval": ("hpcsgd.evaluate", "cross-entropy, frame accuracy and confusions of a checkpoint"),
    "infer": ("hpcsgd.infer", "write posteriors or scaled log-likelihoods for a decoder"),
    "bench": ("hpcsgd.bench", "benchmarks against this machine's limits"),
    "plot": ("hpcsgd.plot", "learning curves and throughput of a run directory to PNG"),
}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hpcsgd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    # `hpcsgd eval ... | head` should stop quietly, as Unix tools do, not raise BrokenPipeError
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.print_help()
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"hpcsgd {name}", description=module.__doc__)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"hpcsgd {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
