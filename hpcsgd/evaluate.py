"""`hpcsgd eval`: cross-entropy, frame accuracy, per-class accuracy and confusions of a model.

    hpcsgd eval RUN_DIR|CHECKPOINT --data ARCHIVE [--json FILE] [--graph GRAPH_DIR]
                [--device cpu|cuda]
    mpiexec -n 2 python -m mpi4py -m hpcsgd.cli eval RUN_DIR --data ARCHIVE --device cuda

With --graph, the archive is also recognized through that decoding graph (hpcsgd mkgraph) and
the phone or word error rate is reported beside the frame accuracy (hpcsgd/decode/). A CTC
model reports its CTC loss per token and the greedy token error rate against the archive's
transcripts instead (evaluate_ctc: the trainer's cross-validation of CTC models).

The model shape, splicing context and CMVN mode come from the checkpoint; the archive's label
inventory must be the one the model was trained on. Under mpiexec every rank evaluates a
disjoint share and the sums are reduced; rank 0 prints and writes the JSON (the trainer's
cross-validation uses the same code). --device cuda runs the network on each rank's GPU (one
per local rank; ranks may share one), the CPU path's outputs to float32 tolerance.
"""
import json
import os

import numpy as np

from hpcsgd.config import UTTERANCE_MODELS
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


def evaluate_ctc(model, params, archive_dir, data, rank=0, world=1, comm=None,
                 heartbeat=None):
    """A CTC or RNN-T model on an archive: its loss (CTC: from the log-posteriors,
    model.kernels_ctc; RNN-T: the transducer's loss) and the greedy token error rate
    (hpcsgd.decode.ctc / decode.rnnt greedy_search, edit distance to the archive's tokens),
    summed over the ranks' disjoint utterances. data: the checkpoint's data meta (tokens,
    cmvn). -> {"per_token", "per_frame" (and for CTC "ctc_per_token", "ctc_per_frame"),
    "token_error_rate", "tokens", "frames", "utterances", "ins", "del", "sub", "skipped"}."""
    from hpcsgd.data.utterances import UtteranceLoader
    from hpcsgd.decode.score import counts
    loader = UtteranceLoader(archive_dir, rank, world, tokens=data["tokens"],
                             cmvn=data["cmvn"], minibatch=model.max_batch, prefetch=False)
    rnnt = model.describe.get("type") == "rnnt"
    batch_loss = _rnnt_batch(model, params) if rnnt else _ctc_batch
    sums = np.zeros(9)   # loss, tokens, frames, utterances, ins, del, sub, skipped, ref
    for utts, x, targets in loader.eval_batches(model.max_batch, model.max_sequences):
        if heartbeat is not None:
            heartbeat()
        lengths = model.out_lengths(len(x), targets.frames)
        out = model.forward(params, x, len(x), lengths=targets.frames)
        loss, skipped, hyps = batch_loss(out, lengths, targets)
        sums[0] += loss
        sums[1] += len(targets.ids)
        sums[2] += targets.frames.sum()
        sums[3] += lengths.nb
        sums[7] += skipped
        for b, hyp in enumerate(hyps):
            ref = targets.ids[targets.offsets[b]:targets.offsets[b + 1]].tolist()
            sums[4:7] += counts(ref, hyp.tolist())[:3]
    loader.close()
    if comm is not None and world > 1:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)   # cross-rank sync point
    tokens = max(sums[1], 1)
    result = {"per_token": sums[0] / tokens, "per_frame": sums[0] / max(sums[2], 1),
              "token_error_rate": sums[4:7].sum() / tokens, "tokens": int(sums[1]),
              "frames": int(sums[2]), "utterances": int(sums[3]), "ins": int(sums[4]),
              "del": int(sums[5]), "sub": int(sums[6]), "skipped": int(sums[7])}
    if not rnnt:   # the names CTC's records and scripts have always read
        result.update(ctc_per_token=result["per_token"], ctc_per_frame=result["per_frame"])
    return result


def _ctc_batch(logp, lengths, targets):
    """A CTC batch's (loss sum, utterances without an alignment, greedy hypotheses)."""
    from hpcsgd.decode.ctc import greedy_search
    from hpcsgd.model import kernels_ctc as KCTC
    nb, frames = lengths.nb, lengths.lengths
    ws = KCTC.workspace_offsets(frames, targets.offsets)
    alpha = np.empty(int(ws[-1]), np.float32)
    loss, feasible = np.empty(nb), np.empty(nb, np.uint8)
    KCTC.ctc_loss_logprobs(logp, nb, frames, targets.ids, targets.offsets, ws, alpha, loss,
                           feasible)
    hyps = [greedy_search(logp[np.arange(frames[b]) * nb + b]) for b in range(nb)]
    return float(loss.sum()), nb - int(feasible.sum()), hyps


def _rnnt_batch(model, params):
    """An RNN-T batch's (loss sum, utterances skipped, greedy hypotheses): the transducer's
    loss on the encoder's projection (its gradients go to a scratch buffer, unread)."""
    from hpcsgd.decode.rnnt import greedy_search
    from hpcsgd.model.flat import FlatParams
    from hpcsgd.model.transducer import on_host
    layer, weights, ops = on_host(model, params)   # GPU ranks: on the host, weights copied
    scratch = FlatParams(model.specs, model.dtype)

    def batch(enc, lengths, targets):
        enc = np.array(enc)   # the loss overwrites it with its gradient
        hyps = greedy_search(layer, weights, enc, lengths)
        before = layer.skipped
        loss, _ = layer.loss(weights, scratch, enc, targets, ops, 1.0, lengths)
        skipped, layer.skipped = layer.skipped - before, before
        return loss, skipped, hyps
    return batch


def recognize_if_asked(args, model, params, meta, comm):
    """--graph: the archive recognized through that graph (every rank takes part), else None."""
    if not args.graph:
        return None
    return recognize.recognize_archive(model, params, meta, args.data, args.graph, args,
                                       comm=comm)


def run_ctc(args, comm, model, params, meta):
    """`hpcsgd eval` of a CTC (or RNN-T) model: its loss per token and greedy token error rate on the
    archive's transcripts (rank 0 prints; --json writes them), and with --graph the error
    rate through that graph."""
    rank, world = comm.Get_rank(), comm.Get_size()
    kind = meta["tokens"]["kind"]
    result = evaluate_ctc(model, params, args.data, {**meta["data"], "tokens": kind}, rank,
                          world, comm)
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
    if meta["model"].get("type") in UTTERANCE_MODELS:
        return run_ctc(args, comm, model, params, meta)
    result = evaluate(model, params, args.data, meta["data"]["context"], meta["data"]["cmvn"],
                      rank=rank, world=world, comm=comm,
                      sequences=meta["data"] if "chunk" in meta["data"] else None)
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
