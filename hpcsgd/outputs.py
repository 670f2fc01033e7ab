"""The network's outputs per utterance: what `infer` writes and `decode` searches.

loglik = log posterior - log prior, the prior being the label frequencies of the TRAINING data
(stored in the checkpoint; floored so an unseen label does not give +inf). A sequence model
(LSTM) runs each utterance either in the chunks it was trained on (the checkpoint's chunk and
left/right context; each frame's output comes from the one chunk that labels it: the
default, the condition the model knows) or as one whole sequence (every frame sees the whole
utterance; a BLSTM trained on chunks was not trained so). A CTC model runs whole
utterances and gives log-posteriors over its tokens (ctc_outputs: no priors, no frame labels).
"""
import os
import time

import numpy as np

from hpcsgd.data import BLOCK_FRAMES, archive
from hpcsgd.data.loader import iter_utterances
from hpcsgd.data.sequences import chunk_windows, gather_sequences
from hpcsgd.data.splice import splice_gather
from hpcsgd.data.utterances import UtteranceLoader
from hpcsgd.errors import UserError

PRIOR_FLOOR = 1e-8  # a label never seen in training gets this prior instead of 0


def log_priors(label_counts):
    counts = np.asarray(label_counts, np.float64)
    return np.log(np.maximum(counts / counts.sum(), PRIOR_FLOOR)).astype(np.float32)


def utterances(archive_dir, cmvn, rank, world):
    """This rank's utterances (all with world 1), archive order: small blocks under several
    ranks, so that a small archive is shared out evenly (an utterance goes with the block of
    its first frame; each is output by exactly one rank)."""
    block_frames = BLOCK_FRAMES
    if world > 1:
        total = archive.read_index(archive_dir)["total_frames"]
        block_frames = max(1, min(BLOCK_FRAMES, total // (8 * world)))
    return iter_utterances(archive_dir, rank, world, cmvn=cmvn, shuffle=False,
                           block_frames=block_frames)


def utterance_outputs(model, params, archive_dir, context, cmvn, output, priors, rank=0,
                      world=1):
    """Yield (utt_id, (T, V) float32) in archive order; long utterances go in max_batch pieces."""
    out = np.empty((model.max_batch, model.input_dim), np.float32)
    for utt, feats, _labels in utterances(archive_dir, cmvn, rank, world):
        feats = np.ascontiguousarray(feats, np.float32)
        T = len(feats)
        src = np.arange(T)
        lo, hi = np.zeros(T, np.int64), np.full(T, T - 1, np.int64)
        values = np.empty((T, model.num_labels), np.float32)
        for start in range(0, T, model.max_batch):
            order = src[start:start + model.max_batch]
            n = len(order)
            splice_gather(feats, src, lo, hi, order, context, out[:n])
            model.forward(params, out, n, out=values[start:start + n], log=output != "posteriors")
        if output == "loglik":
            values -= priors
        yield utt, values


def sequence_outputs(model, params, archive_dir, data, output, priors, whole=False,
                     rank=0, world=1):
    """A sequence model's (utt_id, (T, V) float32), archive order. Chunks: the utterance's
    chunks (hpcsgd.data.sequences) in batches of whole sequences; gathering the frame
    numbers as 'labels' gives each labelled row's frame, the row that frame's output is
    taken from. Whole: the utterance as one sequence (model.max_batch >= its length).
    data: the checkpoint's data meta (chunks and contexts, normalisation)."""
    chunk, left, right = data["chunk"], data["left_context"], data["right_context"]
    steps = left + chunk + right
    per_batch = max(1, model.max_batch // steps)
    x = np.empty((steps, per_batch, model.input_dim), np.float32)
    where = np.empty((steps, per_batch), np.int64)
    log = output != "posteriors"
    for utt, feats, _labels in utterances(archive_dir, data, rank, world):
        feats = np.ascontiguousarray(feats, np.float32)
        length = len(feats)
        values = np.empty((length, model.num_labels), np.float32)
        if whole:
            model.forward(params, feats, length, out=values, log=log, steps=length)
        else:
            frames = np.arange(length)
            _, window, lo, hi = chunk_windows([length], chunk)
            for first in range(0, len(window), per_batch):
                nb = min(per_batch, len(window) - first)
                part = slice(first, first + nb)
                zero = np.zeros(nb, np.int64)
                gather_sequences(feats, frames, zero, zero + length, window[part], lo[part],
                                 hi[part], left, x[:, :nb], where[:, :nb])
                rows = np.ascontiguousarray(x[:, :nb]).reshape(steps * nb, -1)
                out = model.forward(params, rows, steps * nb, log=log, steps=steps)
                at = where[:, :nb].reshape(-1)
                keep = np.flatnonzero(at >= 0)
                values[at[keep]] = out[keep]
        if output == "loglik":
            values -= priors
        yield utt, values


def ctc_outputs(model, params, archive_dir, data, output="logpost", rank=0, world=1):
    """A CTC model's (utt_id, (T', V) float32) log-posteriors (or posteriors) over its
    tokens, column 0 the blank, T' the frames after its subsampling: whole utterances in
    batches of similar lengths (hpcsgd.data.utterances: eval_batches; the ranks' shares
    disjoint), longest first. The archive needs no transcripts."""
    if output not in ("logpost", "posteriors"):
        raise UserError(f"a CTC model's outputs are posteriors over tokens, not {output!r} "
                        f"(a hybrid decoder's scaled likelihoods): --output logpost or "
                        f"posteriors")
    loader = UtteranceLoader(archive_dir, rank, world, tokens=None, cmvn=data,
                             minibatch=model.max_batch, prefetch=False)
    try:
        for utts, x, targets in loader.eval_batches(model.max_batch, model.max_sequences):
            lengths = model.out_lengths(len(x), targets.frames)
            out = model.forward(params, x, len(x), log=output == "logpost",
                                lengths=targets.frames)
            for b, utt in enumerate(utts):
                yield utt, np.ascontiguousarray(out[np.arange(lengths.lengths[b]) *
                                                    lengths.nb + b], np.float32)
    finally:
        loader.close()


def ctc_posteriors(model, params, meta, archive_dir, rank=0, world=1):
    """This rank's share of the archive as [(utt, (T', V) log-posteriors)], and the CPU
    seconds the acoustic model took (all of this process's threads): what a CTC decoder
    searches (hpcsgd/decode/)."""
    t0 = time.process_time()
    mine = list(ctc_outputs(model, params, archive_dir, meta["data"], "logpost", rank, world))
    return mine, time.process_time() - t0


def longest_utterance(archive_dir):
    """Frames of the archive's longest utterance (from the shards' offsets alone)."""
    index = archive.read_index(archive_dir)
    return max(int(np.diff(archive.read_shard_meta(os.path.join(index["dir"], s["file"]))
                           ["utt_offsets"]).max(initial=0)) for s in index["shards"])
