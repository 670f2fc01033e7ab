"""`hpcsgd eval`: cross-entropy, frame accuracy, per-class accuracy and confusions of a model.

    hpcsgd eval RUN_DIR|CHECKPOINT --data ARCHIVE [--json FILE] [--graph GRAPH_DIR]
                [--device cpu|cuda]
    mpiexec -n 2 python -m mpi4py -m hpcsgd.cli eval RUN_DIR --data ARCHIVE --device cuda

With --graph, the archive is also recognized through that decoding graph (hpcsgd mkgraph) and
the phone or word error rate is reported beside the frame accuracy (hpcsgd/decode/).

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
from hpcsgd.data import BLOCK_FRAMES
from hpcsgd.data.loader import FrameLoader
from hpcsgd.data.sequences import SequenceLoader
from hpcsgd.decode import recognize
from hpcsgd.model_io import add_device_argument, check_archive, load_model, sequence_steps


def evaluate(model, params, archive_dir, context, cmvn, rank=0, world=1, comm=None,
             heartbeat=None, sequences=None):
    """Sums over the whole archive (reduced over ranks): ce, correct, frames, confusion (V, V).
    `heartbeat()`, when given, is called per batch (the trainer's watchdog). A sequence model
    (sequences = the checkpoint's data meta with chunk, left/right context) is evaluated on
    the chunks it was trained on: every labelled frame once, context frames outside."""
    V = model.num_labels
    # blocks small enough that every rank gets one: a CV set may be smaller than K blocks of
    # the default size (the frames are only summed, so block size does not change the result)
    total = archive.read_index(archive_dir)["total_frames"]
    block_frames = min(BLOCK_FRAMES, max(1, total // world))
    if sequences:
        steps = sequence_steps(sequences)
        chunk = sequences["chunk"]
        loader = SequenceLoader(archive_dir, rank, world, chunk=chunk,
                                left_context=sequences["left_context"],
                                right_context=sequences["right_context"], cmvn=cmvn, seed=0,
                                max_batch=model.max_batch, block_frames=block_frames)
        take = model.max_batch // steps * chunk    # frame slots of whole chunks
    else:
        loader = FrameLoader(archive_dir, rank, world, context=context, cmvn=cmvn, seed=0,
                             max_batch=model.max_batch, block_frames=block_frames)
        take = model.max_batch
    loader.start_epoch(0)
    ce, confusion = 0.0, np.zeros(V * V, np.int64)
    while loader.remaining:
        if heartbeat is not None:
            heartbeat()
        x, y = loader.next_batch(take)
        n = len(y)
        # a GPU model copies x to its device buffer and its (n, V) log-posteriors back: CE and
        # the confusion counts are summed here on the host, one code for CPU ranks, GPU ranks
        # and the trainer's CV, with NumPy's argmax (first maximum) on both, so that a frame's
        # decision differs between them only where its outputs differ, never by a tie rule
        logp = model.forward(params, x, n)
        keep = np.flatnonzero(y >= 0)     # sequences: not the context and padding
        ce -= float(logp[keep, y[keep]].sum(dtype=np.float64))
        confusion += np.bincount(y[keep].astype(np.int64) * V + logp[keep].argmax(axis=1),
                                 minlength=V * V)
    loader.close()
    sums = np.concatenate([[ce], confusion.astype(np.float64)])
    if comm is not None and world > 1:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)   # cross-rank sync point
    confusion = sums[1:].astype(np.int64).reshape(V, V)
    frames = int(confusion.sum())
    return {"ce": sums[0] / max(frames, 1), "frame_accuracy": np.trace(confusion) / max(frames, 1),
            "frames": frames, "confusion": confusion}


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
    result = evaluate(model, params, args.data, meta["data"]["context"], meta["data"]["cmvn"],
                      rank=rank, world=world, comm=comm,
                      sequences=meta["data"] if "chunk" in meta["data"] else None)
    decoded = None
    if args.graph:
        decoded = recognize.recognize_archive(model, params, meta, args.data, args.graph, args,
                                              comm=comm)
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
