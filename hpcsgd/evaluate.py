"""`hpcsgd eval`: cross-entropy, frame accuracy, per-class accuracy and confusions of a model.

    hpcsgd eval RUN_DIR|CHECKPOINT --data ARCHIVE [--json FILE] [--graph GRAPH_DIR]
                [--device cpu|cuda]
    mpiexec -n 2 python -m mpi4py -m hpcsgd.cli eval RUN_DIR --data ARCHIVE --device cuda

With --graph, the archive is also recognized through that decoding graph (hpcsgd mkgraph) and
the phone or word error rate is reported beside the frame accuracy (hpcsgd/decode/). A CTC
model (or an RNN-T) reports its loss per token and the greedy token error rate against the
archive's transcripts instead. The sums are the model family's (hpcsgd/families/: `evaluate`,
what the trainer's cross-validation runs too); this module reports them.

The model shape, splicing context and CMVN mode come from the checkpoint; the archive's label
inventory must be the one the model was trained on. Under mpiexec every rank evaluates a
disjoint share and the sums are reduced; rank 0 prints and writes the JSON (the trainer's
cross-validation uses the same code). --device cuda runs the network on each rank's GPU (one
per local rank; ranks may share one), the CPU path's outputs to float32 tolerance.
"""
import json
import os

import numpy as np

from hpcsgd.data import archive
from hpcsgd.decode import recognize
from hpcsgd.families import of_model
from hpcsgd.model_io import add_device_argument, check_archive, load_model


def recognize_if_asked(args, model, params, meta, comm):
    """--graph: the archive recognized through that graph (every rank takes part), else None."""
    if not args.graph:
        return None
    return recognize.recognize_archive(model, params, meta, args.data, args.graph, args,
                                       comm=comm)


def run_tokens(args, comm, model, params, meta):
    """`hpcsgd eval` of a model over tokens (CTC, RNN-T): its loss per token and greedy token
    error rate on the archive's transcripts (rank 0 prints; --json writes them), and with
    --graph the error rate through that graph."""
    rank, world = comm.Get_rank(), comm.Get_size()
    kind = meta["tokens"]["kind"]
    result = of_model(meta["model"]).evaluate(model, params, args.data,
                                              {**meta["data"], "tokens": kind}, rank, world,
                                              comm)
    decoded = recognize_if_asked(args, model, params, meta, comm)
    if rank != 0:
        return 0
    errors = result["ins"] + result["del"] + result["sub"]
    print(f"{meta['path']} on {args.data}: {result['utterances']} utterances, "
          f"{result['frames']} frames, {result['tokens']} {kind} tokens")
    print(f"{meta['model']['type'].upper()} loss {result['per_token']:.4f} nats/token "
          f"({result['per_frame']:.4f} per frame)"
          + (f"; {result['skipped']} utterances have no alignment after the subsampling "
             f"(no loss)" if result["skipped"] else ""))
    print(f"greedy token error rate {100 * result['token_error_rate']:.2f}% [ {errors} / "
          f"{result['tokens']}, {result['ins']} ins, {result['del']} del, {result['sub']} sub ]"
          f" (hpcsgd decode --greedy scores words too)")
    if decoded is not None:
        print(f"through {args.graph} ({decoded['kind']}; acoustic scale "
              f"{decoded['acoustic_scale']:g}):")
        print(decoded.pop("lines"))
    if args.json:
        payload = {"checkpoint": meta["path"], "archive": args.data, "tokens": kind, **result,
                   "decode": decoded}
        archive.atomic_write_text(args.json, json.dumps(payload) + "\n")
    return 0


def add_arguments(parser):
    parser.add_argument("model", help="run directory (latest checkpoint) or checkpoint file")
    parser.add_argument("--data", required=True, help="archive to evaluate (hpcsgd prep OUT)")
    parser.add_argument("--json", help="write CE, accuracy, per-class accuracy and confusions here")
    parser.add_argument("--top", type=int, default=10, help="confusions to list")
    parser.add_argument("--graph", help="also recognize through this graph (hpcsgd mkgraph) "
                                        "and report the phone or word error rate")
    recognize.add_search_arguments(parser)
    add_device_argument(parser)


def run(args):
    from mpi4py import MPI   # under mpiexec: a share per rank, the sums reduced
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    # every rank checks the same inputs before the first collective: a bad one stops them all
    model, params, meta = load_model(args.model, device=args.device, comm=comm)
    check_archive(args.data, meta)
    fam = of_model(meta["model"])
    if fam.UTTERANCES:   # its outputs are tokens: a loss per token and token errors
        return run_tokens(args, comm, model, params, meta)
    result = fam.evaluate(model, params, args.data, meta["data"], rank=rank, world=world,
                          comm=comm)
    decoded = recognize_if_asked(args, model, params, meta, comm)
    if rank != 0:
        return 0
    symbols = archive.read_inventory(os.path.join(args.data, archive.LABELS_NAME))
    conf = result["confusion"]
    per_class = conf.diagonal() / np.maximum(conf.sum(axis=1), 1)
    counts = conf.sum(axis=1)
    majority = counts.max() / max(result["frames"], 1)
    print(f"{meta['path']} on {args.data}: {result['frames']} frames")
    print(f"cross-entropy {result['ce']:.4f} nats/frame, frame accuracy "
          f"{100 * result['frame_accuracy']:.2f}% (majority class "
          f"{symbols[int(counts.argmax())]}: {100 * majority:.2f}%)")
    print("per-class accuracy (frames):")
    for i in np.argsort(-counts):
        if counts[i]:
            print(f"  {symbols[i]:8s} {100 * per_class[i]:6.2f}%  ({counts[i]})")
    off = conf.copy()
    np.fill_diagonal(off, 0)
    top = np.argsort(-off, axis=None)[:args.top]
    print(f"top {args.top} confusions (reference -> hypothesis, frames):")
    for flat in top:
        ref, hyp = divmod(int(flat), conf.shape[0])
        if off[ref, hyp]:
            print(f"  {symbols[ref]:8s} -> {symbols[hyp]:8s} {off[ref, hyp]}")
    if decoded is not None:
        print(f"through {args.graph} ({decoded['kind']}; acoustic scale "
              f"{decoded['acoustic_scale']:g}, prior scale {decoded['prior_scale']:g}):")
        print(decoded.pop("lines"))
    if args.json:
        payload = {"checkpoint": meta["path"], "archive": args.data, "frames": result["frames"],
                   "ce": result["ce"], "frame_accuracy": result["frame_accuracy"],
                   "majority_baseline": majority,
                   "per_class_accuracy": {symbols[i]: float(per_class[i]) for i in range(len(symbols))},
                   "confusion": conf.tolist(), "labels": symbols, "decode": decoded}
        archive.atomic_write_text(args.json, json.dumps(payload) + "\n")
    return 0
