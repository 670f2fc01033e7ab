"""The HDF5 feature archive: one format, written by `hpcsgd prep`, read by the loader.

An archive is a directory:

    OUT/shard-00000.h5 ...   one file per shard (one Slurm array task each)
    OUT/index.json           shard list with frame/utterance counts, so ranks plan their
                             share of the data without opening every shard
    OUT/labels.txt           the frame-label inventory, `symbol id` per line
    OUT/tokens_<kind>.txt    a token inventory (kind phones, chars or bpe), `symbol id` per
                             line, id 0 the CTC blank <blk>; OUT/bpe.model beside kind bpe
                             (the sentencepiece model, trained on the training speakers' text)

A shard holds whole speakers (so its per-speaker CMVN statistics are complete):

    feats        (F, D) float32   all utterances' frames concatenated, chunked along frames
    labels       (F,)   int32     frame labels (zero-based ids into the inventory); absent when
                                  the corpus came without alignments (attrs frame_labels false)
    text         (U,)   str       each utterance's transcript words (when the corpus has text)
    tokens/<kind>/ids      (N,)   int32  every utterance's token ids (1.., never the blank 0),
    tokens/<kind>/offsets  (U+1,) int64  utterance u's are ids[offsets[u]:offsets[u+1]]
    utt_offsets  (U+1,) int64     utterance u is frames [utt_offsets[u], utt_offsets[u+1])
    utt_ids      (U,)   str
    utt_spk      (U,)   int32     index into spk_ids
    spk_ids      (S,)   str
    spk_gender   (S,)   str       'm', 'f' or '' (unknown); optional: when the corpus says
                                  (SPEAKERS.TXT, spk2gender)
    cmvn_stats   (S, 2, D+1) float64   Kaldi layout: row 0 = sums and frame count, row 1 = sums of squares
    label_counts (L,)   int64     frames per label (priors for hybrid decoding)
    attrs: format_version, feature_type, feature_dim, num_labels, label_inventory_hash,
           sample_rate, frame_shift_ms, frame_length_ms, extractor_config (JSON), and since
           format 2 frame_labels (bool), has_text (bool), tokens (JSON {kind: {"num_tokens",
           "inventory_hash"}})

Format 1 archives (no tokens, no text, always frame labels) still load: their missing
attributes read as FORMAT1_DEFAULTS.

Shards and the index are written under a temporary name and renamed, so a crash never leaves
a half-written file with the final name.
"""
import hashlib
import json
import os

import h5py
import numpy as np

from hpcsgd.errors import UserError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
INDEX_NAME = "index.json"
LABELS_NAME = "labels.txt"
BPE_MODEL = "bpe.model"
BLANK = "<blk>"                            # token id 0 of every token inventory
TOKEN_KINDS = ("phones", "chars", "bpe")
CHUNK_BYTES = 512 * 1024  # feats chunk ~0.5 MiB: large sequential reads, small enough for random blocks
# Attributes that must agree across all shards of one archive.
SHARED_ATTRS = ("format_version", "feature_type", "feature_dim", "num_labels",
                "label_inventory_hash", "sample_rate", "frame_shift_ms", "frame_length_ms",
                "extractor_config", "frame_labels", "has_text", "tokens")
# what a format 1 shard, written before these attributes, means by their absence
FORMAT1_DEFAULTS = {"frame_labels": True, "has_text": False, "tokens": "{}"}


def shard_name(index):
    return f"shard-{index:05d}.h5"


def inventory_text(symbols):
    """The label inventory as Kaldi writes it: `symbol id` per line, ids 0..L-1."""
    return "".join(f"{s} {i}\n" for i, s in enumerate(symbols))


def inventory_hash(symbols):
    return hashlib.sha256(inventory_text(symbols).encode()).hexdigest()[:16]


def token_inventory_name(kind):
    return f"tokens_{kind}.txt"


def token_attrs(inventories):
    """The shards' `tokens` attribute for {kind: symbols}: JSON of {kind: {num_tokens,
    inventory_hash}}, kinds sorted (every shard writes the same string)."""
    return json.dumps({k: {"num_tokens": len(v), "inventory_hash": inventory_hash(v)}
                       for k, v in sorted(inventories.items())}, sort_keys=True)


def read_inventory(path):
    """Read `symbol id` lines; ids must be exactly 0..L-1 (in any order)."""
    by_id = {}
    with open(path, encoding="utf-8") as f:   # token symbols: any character, bpe's "▁"
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) != 2 or not parts[1].lstrip("-").isdigit():
                raise UserError(f"{path}:{lineno}: expected 'symbol id', got {line.strip()!r}")
            sym, idx = parts[0], int(parts[1])
            if idx in by_id:
                raise UserError(f"{path}:{lineno}: id {idx} used twice ({by_id[idx]}, {sym})")
            by_id[idx] = sym
    if sorted(by_id) != list(range(len(by_id))):
        raise UserError(f"{path}: label ids must be 0..{len(by_id) - 1} without gaps")
    symbols = [by_id[i] for i in range(len(by_id))]
    if len(set(symbols)) != len(symbols):
        raise UserError(f"{path}: a symbol appears twice")
    return symbols


def atomic_write_text(path, text):
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_bytes(path, data):
    """atomic_write_text for binary files (bpe.model)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_shard(path, feats, labels, utt_offsets, utt_ids, utt_spk, spk_ids, cmvn_stats,
                label_counts, attrs, tokens=None, text=None, spk_gender=None):
    """Write one shard atomically (temp name + fsync + rename). `attrs` holds SHARED_ATTRS
    (FORMAT1_DEFAULTS fill the format-2 ones not given); labels None when the archive has no
    frame labels; tokens {kind: (ids, offsets)}; text one transcript string per utterance;
    spk_gender one of 'm', 'f', '' per speaker (None: not stored)."""
    feats = np.ascontiguousarray(feats, dtype=np.float32)
    num_frames, dim = feats.shape
    attrs = {**FORMAT1_DEFAULTS, **attrs}
    if (labels is None) == bool(attrs["frame_labels"]):
        raise ValueError(f"write_shard: labels given = {labels is not None}, attribute "
                         f"frame_labels = {attrs['frame_labels']}")
    declared = set(json.loads(attrs["tokens"]))
    if declared != set(tokens or {}) or bool(attrs["has_text"]) != (text is not None):
        raise ValueError(f"write_shard: token kinds {sorted(tokens or {})} / text given "
                         f"{text is not None} differ from the attributes ({sorted(declared)}, "
                         f"has_text {attrs['has_text']})")
    missing = [k for k in SHARED_ATTRS if k not in attrs]
    if missing:
        raise ValueError(f"write_shard: missing attributes {missing}")
    if attrs["feature_dim"] != dim:
        raise ValueError(f"write_shard: feature_dim attr {attrs['feature_dim']} != feats dim {dim}")
    chunk_frames = max(1, min(num_frames, CHUNK_BYTES // (4 * max(dim, 1))))
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("feats", data=feats, chunks=(chunk_frames, dim) if num_frames else None)
            if labels is not None:
                f.create_dataset("labels", data=np.asarray(labels, dtype=np.int32))
            if text is not None:
                f.create_dataset("text", data=np.array(list(text), dtype=object),
                                 dtype=h5py.string_dtype())
            for kind, (ids, offsets) in sorted((tokens or {}).items()):
                f.create_dataset(f"tokens/{kind}/ids", data=np.asarray(ids, dtype=np.int32))
                f.create_dataset(f"tokens/{kind}/offsets",
                                 data=np.asarray(offsets, dtype=np.int64))
            f.create_dataset("utt_offsets", data=np.asarray(utt_offsets, dtype=np.int64))
            f.create_dataset("utt_ids", data=np.array(utt_ids, dtype=object),
                             dtype=h5py.string_dtype())
            f.create_dataset("utt_spk", data=np.asarray(utt_spk, dtype=np.int32))
            f.create_dataset("spk_ids", data=np.array(spk_ids, dtype=object),
                             dtype=h5py.string_dtype())
            if spk_gender is not None:
                f.create_dataset("spk_gender", data=np.array(list(spk_gender), dtype=object),
                                 dtype=h5py.string_dtype())
            f.create_dataset("cmvn_stats", data=np.asarray(cmvn_stats, dtype=np.float64))
            f.create_dataset("label_counts", data=np.asarray(label_counts, dtype=np.int64))
            for key in SHARED_ATTRS:
                f.attrs[key] = attrs[key]
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def shard_summary(path):
    """The index entry of one shard (reads only small datasets and attributes)."""
    with open_shard(path) as f:
        attrs = shard_attrs(f)
        return {
            "file": os.path.basename(path),
            "frames": int(f["feats"].shape[0]),
            "utterances": int(f["utt_ids"].shape[0]),
            "speakers": int(f["spk_ids"].shape[0]),
            "tokens": {k: int(f[f"tokens/{k}/ids"].shape[0])
                       for k in json.loads(attrs["tokens"])},
            "attrs": attrs,
        }


def shard_attrs(f):
    """An open shard's SHARED_ATTRS as plain Python, format 1's missing ones defaulted."""
    return {k: _plain(f.attrs[k]) if k in f.attrs else FORMAT1_DEFAULTS[k] for k in SHARED_ATTRS
            if k in f.attrs or k in FORMAT1_DEFAULTS}


def write_index(out_dir):
    """Scan OUT/shard-*.h5 and write OUT/index.json atomically (the final step of prep)."""
    files = sorted(n for n in os.listdir(out_dir) if n.startswith("shard-") and n.endswith(".h5"))
    if not files:
        raise UserError(f"{out_dir}: no shard-*.h5 files to index")
    shards = [shard_summary(os.path.join(out_dir, n)) for n in files]
    attrs = shards[0]["attrs"]
    for s in shards[1:]:
        for key in SHARED_ATTRS:
            if s["attrs"][key] != attrs[key]:
                raise UserError(f"{out_dir}/{s['file']}: attribute {key}={s['attrs'][key]!r} "
                                f"differs from {shards[0]['file']} ({attrs[key]!r})")
    for s in shards:
        del s["attrs"]
    total_frames = sum(s["frames"] for s in shards)
    tokens = json.loads(attrs["tokens"])
    for kind, info in tokens.items():
        info["total_tokens"] = sum(s["tokens"][kind] for s in shards)
    index = {
        "format_version": attrs["format_version"],
        **{k: attrs[k] for k in SHARED_ATTRS if k not in ("format_version", "tokens")},
        "tokens": tokens,
        "shards": shards,
        "total_frames": total_frames,
        "total_utterances": sum(s["utterances"] for s in shards),
        "total_speakers": sum(s["speakers"] for s in shards),
        "hours": total_frames * attrs["frame_shift_ms"] / 3.6e6,
    }
    atomic_write_text(os.path.join(out_dir, INDEX_NAME), json.dumps(index, indent=1) + "\n")
    return index


def read_index(archive_dir):
    """Load OUT/index.json; every shard it names must exist."""
    path = os.path.join(archive_dir, INDEX_NAME)
    if not os.path.isdir(archive_dir):
        raise UserError(f"{archive_dir}: no such archive directory (make it with `hpcsgd prep "
                        f"DATA_DIR {archive_dir} --alignments ALI`; the README's pipeline shows how)")
    if not os.path.isfile(path):
        shards = [n for n in os.listdir(archive_dir) if n.startswith("shard-") and n.endswith(".h5")]
        hint = (f"its shards are there but the index step did not run: `hpcsgd prep --write-index "
                f"{archive_dir}`" if shards else f"not an hpcsgd archive: make one with "
                f"`hpcsgd prep DATA_DIR {archive_dir} --alignments ALI`")
        raise UserError(f"{archive_dir}: no {INDEX_NAME} ({hint})")
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: unreadable index ({err})") from None
    if index.get("format_version") not in READABLE_VERSIONS:
        raise UserError(f"{path}: format_version {index.get('format_version')} "
                        f"(this hpcsgd reads {', '.join(map(str, READABLE_VERSIONS))}); re-run "
                        f"hpcsgd prep")
    for key, value in FORMAT1_DEFAULTS.items():   # format 1: no tokens, no text, labels
        index.setdefault(key, json.loads(value) if key == "tokens" else value)
    for s in index["shards"]:
        if not os.path.isfile(os.path.join(archive_dir, s["file"])):
            raise UserError(f"{path}: names shard {s['file']}, which does not exist")
    index["dir"] = os.path.abspath(archive_dir)
    return index


def open_shard(path):
    """h5py.File opened read-only, with a clear error for missing, truncated or corrupt files."""
    try:
        return h5py.File(path, "r")
    except (OSError, ValueError) as err:
        raise UserError(f"{path}: cannot open shard ({err}); truncated or corrupt? "
                        f"re-run hpcsgd prep for it") from None


def read_shard_meta(path):
    """Everything but feats and labels: offsets, ids, CMVN stats, counts, attributes."""
    with open_shard(path) as f:
        try:
            return {
                "utt_offsets": f["utt_offsets"][()],
                "utt_ids": [u.decode() if isinstance(u, bytes) else u for u in f["utt_ids"][()]],
                "utt_spk": f["utt_spk"][()],
                "spk_ids": [s.decode() if isinstance(s, bytes) else s for s in f["spk_ids"][()]],
                "spk_gender": ([s.decode() if isinstance(s, bytes) else s for s in f["spk_gender"][()]]
                               if "spk_gender" in f else None),
                "cmvn_stats": f["cmvn_stats"][()],
                "label_counts": f["label_counts"][()],
                "attrs": shard_attrs(f),
                "num_frames": int(f["feats"].shape[0]),
            }
        except (KeyError, OSError) as err:
            raise UserError(f"{path}: incomplete shard ({err})") from None


def validate_shard(path, check_values=True):
    """Check one shard's internal consistency; return a list of problems (empty when valid)."""
    problems = []
    try:
        f = open_shard(path)
    except UserError as err:
        return [str(err)]
    with f:
        attrs_missing = [k for k in SHARED_ATTRS if k not in f.attrs and k not in FORMAT1_DEFAULTS]
        if attrs_missing:
            return [f"{path}: missing attributes {attrs_missing}"]
        attrs = shard_attrs(f)
        has_labels = bool(attrs["frame_labels"])
        tokens = json.loads(attrs["tokens"])
        needed = (("feats", "utt_offsets", "utt_ids", "utt_spk", "spk_ids", "cmvn_stats",
                   "label_counts") + (("labels",) if has_labels else ())
                  + (("text",) if attrs["has_text"] else ())
                  + tuple(f"tokens/{k}/{d}" for k in tokens for d in ("ids", "offsets")))
        absent = [k for k in needed if k not in f]
        if absent:
            return [f"{path}: missing datasets {absent}"]
        num_frames, dim = f["feats"].shape
        num_labels = int(f.attrs["num_labels"])
        offsets = f["utt_offsets"][()]
        num_utts = f["utt_ids"].shape[0]
        num_spk = f["spk_ids"].shape[0]
        if dim != f.attrs["feature_dim"]:
            problems.append(f"{path}: feats dim {dim} != feature_dim attribute {f.attrs['feature_dim']}")
        if has_labels and f["labels"].shape != (num_frames,):
            problems.append(f"{path}: labels shape {f['labels'].shape} != ({num_frames},)")
        if offsets.shape != (num_utts + 1,) or offsets[0] != 0 or offsets[-1] != num_frames \
                or np.any(np.diff(offsets) <= 0):
            problems.append(f"{path}: utt_offsets must rise strictly from 0 to {num_frames} "
                            f"with {num_utts + 1} entries")
        utt_spk = f["utt_spk"][()]
        if utt_spk.shape != (num_utts,) or (num_utts and (utt_spk.min() < 0 or utt_spk.max() >= num_spk)):
            problems.append(f"{path}: utt_spk must index the {num_spk} speakers")
        if f["cmvn_stats"].shape != (num_spk, 2, dim + 1):
            problems.append(f"{path}: cmvn_stats shape {f['cmvn_stats'].shape} != ({num_spk}, 2, {dim + 1})")
        counts = f["label_counts"][()]
        if counts.shape != (num_labels,):
            problems.append(f"{path}: label_counts shape {counts.shape} != ({num_labels},)")
        if attrs["has_text"] and f["text"].shape != (num_utts,):
            problems.append(f"{path}: text has {f['text'].shape[0]} entries, not {num_utts}")
        for kind, info in tokens.items():
            ids, starts = f[f"tokens/{kind}/ids"][()], f[f"tokens/{kind}/offsets"][()]
            if starts.shape != (num_utts + 1,) or starts[0] != 0 or starts[-1] != len(ids) \
                    or np.any(np.diff(starts) < 0):
                problems.append(f"{path}: tokens/{kind}/offsets must rise from 0 to "
                                f"{len(ids)} with {num_utts + 1} entries")
            elif len(ids) and (ids.min() < 1 or ids.max() >= info["num_tokens"]):
                bad = int(np.flatnonzero((ids < 1) | (ids >= info["num_tokens"]))[0])
                utt = int(np.searchsorted(starts, bad, side="right") - 1)
                problems.append(f"{path}: utterance {_decoded(f['utt_ids'][utt])} has {kind} "
                                f"token {ids[bad]} outside 1..{info['num_tokens'] - 1}")
        if check_values and not problems and has_labels:
            labels = f["labels"][()]
            if num_frames and (labels.min() < 0 or labels.max() >= num_labels):
                bad = int(np.flatnonzero((labels < 0) | (labels >= num_labels))[0])
                problems.append(f"{path}: label {labels[bad]} at frame {bad} outside 0..{num_labels - 1}")
            elif not np.array_equal(np.bincount(labels, minlength=num_labels), counts):
                problems.append(f"{path}: label_counts do not match the labels")
        if check_values and not problems:
            step = max(1, (1 << 24) // max(dim, 1))  # 64 MiB of features at a time
            for start in range(0, num_frames, step):
                block = f["feats"][start:start + step]
                if not np.isfinite(block).all():
                    row = start + int(np.flatnonzero(~np.isfinite(block).all(axis=1))[0])
                    utt = int(np.searchsorted(offsets, row, side="right") - 1)
                    name = f["utt_ids"][utt]
                    name = name.decode() if isinstance(name, bytes) else name
                    problems.append(f"{path}: NaN/Inf feature in utterance {name} (frame {row})")
                    break
    return problems


def _decoded(value):
    return value.decode() if isinstance(value, bytes) else value


def read_tokens(archive_dir, kind, index=None):
    """The token inventory of `kind` (id order, the blank first), checked against the index:
    the file exists, id 0 is the blank, its hash is the shards'. UserError naming the kinds the
    archive has otherwise."""
    index = index or read_index(archive_dir)
    if kind not in index["tokens"]:
        have = ", ".join(sorted(index["tokens"])) or "none"
        raise UserError(f"{archive_dir}: no {kind} tokens in this archive (it has: {have}); "
                        f"prep it with --tokens {kind} (docs/prep.md)")
    path = os.path.join(archive_dir, token_inventory_name(kind))
    if not os.path.isfile(path):
        raise UserError(f"{path}: missing (the {kind} token inventory of {archive_dir})")
    symbols = read_inventory(path)
    if not symbols or symbols[0] != BLANK:
        raise UserError(f"{path}: id 0 must be the blank {BLANK}, not {symbols[:1]}")
    if inventory_hash(symbols) != index["tokens"][kind]["inventory_hash"]:
        raise UserError(f"{path}: does not match the inventory the shards were written with "
                        f"(hash {inventory_hash(symbols)}, index {index['tokens'][kind]['inventory_hash']})")
    return symbols


def read_shard_tokens(path, kind):
    """(ids int32, offsets int64 (U+1,)) of one shard's `kind` tokens."""
    with open_shard(path) as f:
        try:
            return f[f"tokens/{kind}/ids"][()], f[f"tokens/{kind}/offsets"][()]
        except KeyError:
            raise UserError(f"{path}: no {kind} tokens (prep with --tokens {kind})") from None


def read_shard_text(path):
    """Each utterance's transcript (list of str), or None when the shard has none."""
    with open_shard(path) as f:
        if "text" not in f:
            return None
        return [_decoded(t) for t in f["text"][()]]


def _plain(value):
    """HDF5 attribute -> plain Python (for JSON and comparisons)."""
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.generic):
        return value.item()
    return value
