"""`hpcsgd infer`: per-utterance posteriors or scaled log-likelihoods for a hybrid decoder.

    hpcsgd infer RUN_DIR|CHECKPOINT --data ARCHIVE --out OUT [--output loglik|posteriors|logpost]
                 [--format hdf5|ark|both] [--sequences chunks|whole]

loglik = log posterior - log prior, the prior being the label frequencies of the TRAINING data
(stored in the checkpoint; floored so an unseen label does not give +inf). Writes OUT.h5
(`values` (F, V) float32 concatenated, `utt_offsets`, `utt_ids`, like an archive) and/or
OUT.ark + OUT.scp (Kaldi matrices, readable by latgen-faster-mapped via kaldiio). Files are
written under temporary names and renamed.

A sequence model (LSTM) runs each utterance either in the chunks it was trained on (the
checkpoint's chunk and left/right context; each frame's output comes from the one chunk that
labels it: the default, the condition the model knows) or as one whole sequence (--sequences
whole: every frame sees the whole utterance; a BLSTM trained on chunks was not trained so).
"""
import os

import h5py
import numpy as np

from hpcsgd.data import archive
from hpcsgd.data.loader import iter_utterances
from hpcsgd.data.sequences import chunk_windows, gather_sequences
from hpcsgd.data.splice import splice_gather
from hpcsgd.evaluate import EVAL_BATCH, check_archive, load_model

PRIOR_FLOOR = 1e-8  # a label never seen in training gets this prior instead of 0


def log_priors(label_counts):
    counts = np.asarray(label_counts, np.float64)
    return np.log(np.maximum(counts / counts.sum(), PRIOR_FLOOR)).astype(np.float32)


def utterance_outputs(model, params, archive_dir, context, cmvn, output, priors):
    """Yield (utt_id, (T, V) float32) in archive order; long utterances go in max_batch pieces."""
    out = np.empty((model.max_batch, model.input_dim), np.float32)
    for utt, feats, _labels in iter_utterances(archive_dir, cmvn=cmvn, shuffle=False):
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


def sequence_outputs(model, params, archive_dir, data, cmvn, output, priors, whole=False):
    """A sequence model's (utt_id, (T, V) float32), archive order. Chunks: the utterance's
    chunks (hpcsgd.data.sequences) in batches of whole sequences; gathering the frame
    numbers as 'labels' gives each labelled row's frame, the row that frame's output is
    taken from. Whole: the utterance as one sequence (model.max_batch >= its length)."""
    chunk, left, right = data["chunk"], data["left_context"], data["right_context"]
    steps = left + chunk + right
    per_batch = max(1, model.max_batch // steps)
    x = np.empty((steps, per_batch, model.input_dim), np.float32)
    where = np.empty((steps, per_batch), np.int64)
    log = output != "posteriors"
    for utt, feats, _labels in iter_utterances(archive_dir, cmvn=cmvn, shuffle=False):
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


def longest_utterance(archive_dir):
    """Frames of the archive's longest utterance (from the shards' offsets alone)."""
    index = archive.read_index(archive_dir)
    return max(int(np.diff(archive.read_shard_meta(os.path.join(index["dir"], s["file"]))
                           ["utt_offsets"]).max(initial=0)) for s in index["shards"])


def add_arguments(parser):
    parser.add_argument("model", help="run directory (latest checkpoint) or checkpoint file")
    parser.add_argument("--data", required=True, help="archive to run on (hpcsgd prep OUT)")
    parser.add_argument("--out", required=True, help="output path without extension")
    parser.add_argument("--output", choices=("loglik", "posteriors", "logpost"), default="loglik",
                        help="scaled log-likelihoods (for a hybrid decoder), posteriors, or log-posteriors")
    parser.add_argument("--format", choices=("hdf5", "ark", "both"), default="both",
                        help="OUT.h5, Kaldi OUT.ark + OUT.scp, or both")
    parser.add_argument("--sequences", choices=("chunks", "whole"), default="chunks",
                        help="sequence (LSTM) models: run the training chunks with their "
                             "context, or each utterance as one sequence")


def run(args):
    whole = getattr(args, "sequences", "chunks") == "whole"
    model, params, meta = load_model(args.model, max(EVAL_BATCH, longest_utterance(args.data))
                                     if whole else EVAL_BATCH)
    check_archive(args.data, meta)
    priors = log_priors(meta["label_counts"])
    context, cmvn = meta["data"]["context"], meta["data"]["cmvn"]
    if model.recurrent:
        outputs = sequence_outputs(model, params, args.data, meta["data"], cmvn, args.output,
                                   priors, whole)
        print(f"infer: {'whole utterances' if whole else 'the training chunks'} "
              f"(--sequences {'whole' if whole else 'chunks'})")
    else:
        outputs = utterance_outputs(model, params, args.data, context, cmvn, args.output,
                                    priors)
    pid = os.getpid()
    h5_tmp, ark_tmp, scp_tmp = (f"{args.out}.h5.tmp.{pid}", f"{args.out}.ark.tmp.{pid}",
                                f"{args.out}.scp.tmp.{pid}")
    want_h5, want_ark = args.format in ("hdf5", "both"), args.format in ("ark", "both")
    writer = h5 = None
    try:
        if want_ark:
            import kaldiio
            writer = kaldiio.WriteHelper(f"ark,scp:{ark_tmp},{scp_tmp}")
        utt_ids, offsets, frames = [], [0], 0
        if want_h5:
            h5 = h5py.File(h5_tmp, "w")
            values_ds = h5.create_dataset("values", (0, model.num_labels), np.float32,
                                          maxshape=(None, model.num_labels),
                                          chunks=(1024, model.num_labels))
        for utt, values in outputs:
            utt_ids.append(utt)
            frames += len(values)
            offsets.append(frames)
            if writer is not None:
                writer(utt, values)
            if h5 is not None:
                values_ds.resize(frames, axis=0)
                values_ds[frames - len(values):frames] = values
        if writer is not None:
            writer.close()
            writer = None
            # the scp names the temporary ark: point it at the final name before renaming
            with open(scp_tmp) as f:
                scp = f.read().replace(ark_tmp, f"{args.out}.ark")
            with open(scp_tmp, "w") as f:
                f.write(scp)
            os.replace(ark_tmp, f"{args.out}.ark")
            os.replace(scp_tmp, f"{args.out}.scp")
        if h5 is not None:
            h5.create_dataset("utt_offsets", data=np.array(offsets, np.int64))
            h5.create_dataset("utt_ids", data=np.array(utt_ids, dtype=object),
                              dtype=h5py.string_dtype())
            h5.attrs["output"] = args.output
            h5.attrs["checkpoint"] = meta["path"]
            h5.close()
            h5 = None
            os.replace(h5_tmp, f"{args.out}.h5")
    finally:
        if writer is not None:
            writer.close()
        if h5 is not None:
            h5.close()
        for tmp in (h5_tmp, ark_tmp, scp_tmp):
            if os.path.exists(tmp):
                os.unlink(tmp)
    written = [f"{args.out}.{ext}" for ext, on in (("h5", want_h5), ("ark", want_ark),
                                                    ("scp", want_ark)) if on]
    print(f"infer: {len(utt_ids)} utterances, {frames} frames of {args.output} -> "
          f"{', '.join(written)}")
    return 0
