"""Which statistics normalise the features: data.cmvn (what: none, mean, meanvar) and
data.cmvn_scope (whose):

  speaker    each speaker's own (Kaldi's per-speaker CMVN, the archive's cmvn_stats): the best
             a trainer can do with a corpus of known speakers, and what no recognizer of one
             utterance or one stream can apply.
  global     the training archive's statistics summed over its speakers: one mean and variance
             for everything the model ever sees, kept in the checkpoint; what `hpcsgd export
             --onnx --cmvn global` folds into the graph, for offline and streaming recognizers.
  utterance  each utterance's own, from all its frames: what an offline recognizer computes
             inside the graph (`--cmvn utterance`).

The loaders take the normalisation as a checkpoint's data meta keeps it: {"cmvn": kind,
"cmvn_scope": scope, "cmvn_stats": the global scope's (2, D+1) Kaldi stats or None} (meta(),
of_config()), or a kind alone (per speaker, as every checkpoint before scopes). Each gives
the (shift, scale) rows hpcsgd/data/splice.py's apply_cmvn applies: x_norm = (x + shift) *
scale.
"""
import os

import numpy as np

from hpcsgd.data import archive
from hpcsgd.data.splice import cmvn_from_stats
from hpcsgd.errors import UserError

KINDS = ("none", "mean", "meanvar")
SCOPES = ("speaker", "global", "utterance")


def spec(cmvn):
    """(kind, scope, global stats or None) of a kind string or a data meta dict."""
    if isinstance(cmvn, str):
        kind, scope, stats = cmvn, "speaker", None
    else:
        kind, scope = cmvn["cmvn"], cmvn.get("cmvn_scope") or "speaker"
        stats = cmvn.get("cmvn_stats")
    if kind not in KINDS:
        raise UserError(f"loader: cmvn must be none, mean or meanvar, not {kind!r}")
    if scope not in SCOPES:
        raise UserError(f"loader: cmvn_scope must be one of {', '.join(SCOPES)}, not {scope!r}")
    if scope == "global":
        if stats is None:
            raise UserError("loader: cmvn_scope global without the training archive's "
                            "statistics (cmvn_stats)")
        stats = np.asarray(stats, np.float64)
    return kind, scope, stats


def summed_stats(archive_dir):
    """(stats (2, D+1) float64, speakers): an archive's per-speaker Kaldi stats summed over
    every speaker of every shard."""
    index = archive.read_index(archive_dir)
    total, speakers = None, 0
    for s in index["shards"]:
        stats = archive.read_shard_meta(os.path.join(index["dir"], s["file"]))["cmvn_stats"]
        total = stats.sum(axis=0) if total is None else total + stats.sum(axis=0)
        speakers += len(stats)
    return total, speakers


def of_config(cfg):
    """The training's normalisation as data meta: the global scope's statistics are the
    training archive's (data.train), summed once here and kept in every checkpoint, so CV,
    decode and export normalise as training did whatever archive they read."""
    stats = None
    if cfg["data.cmvn_scope"] == "global":
        stats = summed_stats(cfg["data.train"])[0].tolist()
    return {"cmvn": cfg["data.cmvn"], "cmvn_scope": cfg["data.cmvn_scope"], "cmvn_stats": stats}


def global_shift_scale(stats, kind):
    """(shift (D,), scale (D,)) float32 of summed stats (spec's): x_norm = (x + shift) * scale."""
    dim = stats.shape[-1] - 1
    if kind == "none":
        return np.zeros(dim, np.float32), np.ones(dim, np.float32)
    shift, scale = cmvn_from_stats(stats[None], kind == "meanvar")
    return shift[0], scale[0]


def speaker_rows(cmvn, stats):
    """(shift, scale), (S, D) float32, of a shard's S speakers (stats: its (S, 2, D+1)
    cmvn_stats) under the speaker or global scope; None under the utterance scope (the
    frames give them: utterance_rows)."""
    kind, scope, total = spec(cmvn)
    if scope == "utterance":
        return None
    if kind == "none":
        shift = np.zeros((len(stats), stats.shape[-1] - 1), np.float32)
        return shift, np.ones_like(shift)
    if scope == "global":
        shift, scale = global_shift_scale(total, kind)
        return (np.ascontiguousarray(np.broadcast_to(shift, (len(stats), len(shift)))),
                np.ascontiguousarray(np.broadcast_to(scale, (len(stats), len(scale)))))
    return cmvn_from_stats(stats, kind == "meanvar")


def utterance_rows(cmvn, feats, offsets, span=1 << 20):
    """(shift, scale), (U, D) float32: each of U utterances' own normalisation from its
    frames feats[offsets[u]:offsets[u+1]] (float64 sums, as Kaldi's stats). feats: an array
    or a shard's HDF5 dataset, read whole utterances at a time, about `span` frames."""
    kind = spec(cmvn)[0]
    offsets = np.asarray(offsets, np.int64)
    lengths = np.diff(offsets)
    if np.any(lengths <= 0):
        raise ValueError("an utterance without frames")
    dim = feats.shape[1]
    if kind == "none":
        shift = np.zeros((len(lengths), dim), np.float32)
        return shift, np.ones_like(shift)
    stats = np.zeros((len(lengths), 2, dim + 1))
    stats[:, 0, -1] = lengths
    first = 0
    while first < len(lengths):   # utterances first..last-1, at least one
        last = max(first + 1, int(np.searchsorted(offsets, offsets[first] + span, "right")) - 1)
        x = np.asarray(feats[offsets[first]:offsets[last]], np.float64)
        starts = offsets[first:last] - offsets[first]
        stats[first:last, 0, :-1] = np.add.reduceat(x, starts, axis=0)
        stats[first:last, 1, :-1] = np.add.reduceat(x * x, starts, axis=0)
        first = last
    return cmvn_from_stats(stats, kind == "meanvar")


def normalise(cmvn, feats, rows, index):
    """feats normalised in place by row `index` of rows (speaker_rows'), or by their own
    statistics (one utterance's frames) when rows is None."""
    if rows is None:
        rows, index = utterance_rows(cmvn, feats, [0, len(feats)]), 0
    feats += rows[0][index]
    feats *= rows[1][index]
    return feats
