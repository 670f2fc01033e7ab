"""The `hpcsgd` command: one entry point, one module per subcommand.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`, and for its
--help a USAGE text (else its docstring's first paragraph) and EXAMPLES; it is imported only
when chosen, so `hpcsgd inspect` does not pay for numba-compiling the trainer.
"""
import argparse
import importlib
import signal
import sys

from hpcsgd.errors import UserError

# name -> (module, one-line help). `bench` has its own subcommands (hpcsgd/bench/__init__.py).
SUBCOMMANDS = {
    "prep": ("data_prep.prep", "audio + alignments and/or transcripts -> sharded HDF5 archive"),
    "inspect": ("hpcsgd.data.inspect", "validate an archive and print a summary"),
    "train": ("hpcsgd.train", "train an acoustic model (run under mpiexec for K ranks)"),
    "eval": ("hpcsgd.evaluate", "cross-entropy and frame accuracy (CTC: loss and token errors)"),
    "infer": ("hpcsgd.infer", "write posteriors or scaled log-likelihoods for a decoder"),
    "mkgraph": ("hpcsgd.decode.mkgraph", "a decoding graph (HLG, or CTC's TLG) from a training archive"),
    "decode": ("hpcsgd.decode.decode", "recognize an archive (graph or CTC greedy): WER/PER/CER, RTF"),
    "align": ("hpcsgd.decode.align", "a CTC model's forced alignment of an archive's tokens, as a CTM"),
    "average": ("hpcsgd.average", "the mean of a run's last checkpoints' weights, as one model"),
    "export": ("hpcsgd.export", "a model's weights as int8/int4 codes for integer inference"),
    "bench": ("hpcsgd.bench", "benchmarks against this machine's limits"),
    "plot": ("hpcsgd.plot", "learning curves and throughput of a run directory to PNG"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown where there is one to show; description and examples kept as written."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def usage(module):
    """What --help says above the options: the module's USAGE, else its docstring's title and
    the indented command lines after it (the internals further down are for readers of the
    code)."""
    if getattr(module, "USAGE", None):
        return module.USAGE
    paragraphs = (module.__doc__ or "").split("\n\n")
    keep = paragraphs[:1]
    for paragraph in paragraphs[1:]:
        if not all(line.startswith("    ") for line in paragraph.strip("\n").splitlines()):
            break
        keep.append(paragraph)
    return "\n\n".join(keep)


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
    if name == "train" and not {"-h", "--help", "--help-config"} & set(argv[1:]):
        # before numpy and numba start their thread pools (hpcsgd/threads.py)
        from hpcsgd import threads
        threads.for_train(argv[1:])
    elif name in ("infer", "export") and not {"-h", "--help"} & set(argv[1:]):
        from hpcsgd import threads   # one process: its cores, the pools sleeping between ops
        threads.choose()
    elif name in ("eval", "decode") and not {"-h", "--help"} & set(argv[1:]):
        from mpi4py import MPI       # ranks take disjoint utterances: share the node's cores

        from hpcsgd import threads
        threads.choose(comm=MPI.COMM_WORLD)
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub_parser = argparse.ArgumentParser(prog=f"hpcsgd {name}", description=usage(module),
                                         epilog=getattr(module, "EXAMPLES", None),
                                         formatter_class=HelpFormatter)
    module.add_arguments(sub_parser)
    args = sub_parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except UserError as err:
        print(f"hpcsgd {name}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
