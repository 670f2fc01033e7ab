"""hpcsgd inspect: validate an HDF5 feature archive and print a summary.

    hpcsgd inspect ARCHIVE [--no-values]
    hpcsgd inspect runs/so762

Checks: index.json readable and naming only existing shards; every shard's datasets, shapes,
offsets, label range, label counts and (unless --no-values) NaN/Inf features; attributes equal
across shards and the index; index frame/utterance/speaker/token counts vs the shards; each
speaker and utterance in exactly one shard; labels.txt matching the inventory hash; each token
kind's tokens_<kind>.txt present, blank first and matching its hash, token ids in range, and for
bpe a bpe.model whose pieces are that inventory; one transcript per utterance. Exits 1 naming
every problem. Summary: hours, frames, utterances, speakers, features, label histogram (or "no
frame labels"), and per token kind: inventory size, tokens, tokens per second of speech, the
longest sequence, the fewest frames per token (how tight CTC is) and the utterances too short
for CTC (fewer frames than tokens + repeated neighbours, the blanks CTC needs between them).
"""
import glob
import json
import os

import numpy as np

from hpcsgd.data import archive
from hpcsgd.errors import UserError

TOP_LABELS = 10  # labels listed in the histogram


def add_arguments(p):
    p.add_argument("archive", metavar="ARCHIVE", help="archive directory (holds index.json)")
    p.add_argument("--no-values", action="store_true",
                   help="skip the full read of feats/labels (NaN/Inf, label range): metadata only")


def check_archive(archive_dir, check_values=True):
    """-> (problems, summary). Problems name the file at fault; summary is None when unusable."""
    problems = []
    if not os.path.isdir(archive_dir):
        return [f"{archive_dir}: no such directory"], None
    try:
        index = archive.read_index(archive_dir)
        entries = index["shards"]
    except UserError as err:
        problems.append(str(err))
        index = None
        entries = [{"file": os.path.basename(p)}
                   for p in sorted(glob.glob(os.path.join(archive_dir, "shard-*.h5")))]
        entries = [e for e in entries if os.path.isfile(os.path.join(archive_dir, e["file"]))]
    metas, seen_spk, seen_utt = [], {}, {}
    for entry in entries:
        path = os.path.join(archive_dir, entry["file"])
        if not os.path.isfile(path):
            continue  # already reported by read_index
        shard_problems = archive.validate_shard(path, check_values=check_values)
        problems += shard_problems
        if shard_problems:
            continue
        meta = archive.read_shard_meta(path)
        meta["file"] = entry["file"]
        metas.append(meta)
        if index is not None:
            got = {"frames": meta["num_frames"], "utterances": len(meta["utt_ids"]),
                   "speakers": len(meta["spk_ids"])}
            for key, value in got.items():
                if entry.get(key) != value:
                    problems.append(f"{path}: has {value} {key}, index.json says {entry.get(key)}")
        for spk in meta["spk_ids"]:
            if spk in seen_spk:
                problems.append(f"{path}: speaker {spk} also in {seen_spk[spk]} (per-speaker CMVN "
                                f"stats would be split)")
            seen_spk[spk] = entry["file"]
        for utt in meta["utt_ids"]:
            if utt in seen_utt:
                problems.append(f"{path}: utterance {utt} also in {seen_utt[utt]}")
            seen_utt[utt] = entry["file"]
    if not entries:
        problems.append(f"{archive_dir}: no shards")
    if metas:
        ref = metas[0]
        for m in metas[1:]:
            for key in archive.SHARED_ATTRS:
                if m["attrs"][key] != ref["attrs"][key]:
                    problems.append(f"{archive_dir}/{m['file']}: {key}={m['attrs'][key]!r} differs from "
                                    f"{ref['file']} ({ref['attrs'][key]!r})")
        if index is not None:
            for key in archive.SHARED_ATTRS:
                if key == "tokens":   # the index adds each kind's total to the shards' JSON
                    shards = json.loads(ref["attrs"][key])
                    listed = {k: {f: v for f, v in info.items() if f != "total_tokens"}
                              for k, info in index[key].items()}
                    if listed != shards:
                        problems.append(f"{archive_dir}/index.json: tokens {listed} but shards "
                                        f"have {shards}")
                elif key in index and index[key] != ref["attrs"][key]:
                    problems.append(f"{archive_dir}/index.json: {key}={index[key]!r} but shards have "
                                    f"{ref['attrs'][key]!r}")
            for key, value in (("total_frames", sum(m["num_frames"] for m in metas)),
                               ("total_utterances", sum(len(m["utt_ids"]) for m in metas)),
                               ("total_speakers", sum(len(m["spk_ids"]) for m in metas))):
                if len(metas) == len(entries) and index.get(key) != value:
                    problems.append(f"{archive_dir}/index.json: {key} {index.get(key)} but the shards "
                                    f"hold {value}")
    symbols = None
    labels_path = os.path.join(archive_dir, archive.LABELS_NAME)
    if os.path.isfile(labels_path):
        try:
            symbols = archive.read_inventory(labels_path)
        except UserError as err:
            problems.append(str(err))
        if symbols is not None and metas and \
                archive.inventory_hash(symbols) != metas[0]["attrs"]["label_inventory_hash"]:
            problems.append(f"{labels_path}: does not match the shards' label_inventory_hash")
            symbols = None
    token_kinds = json.loads(metas[0]["attrs"]["tokens"]) if metas else {}
    problems += check_token_files(archive_dir, token_kinds)
    tokens = {}
    for kind in token_kinds:
        per_shard = [token_stats(os.path.join(archive_dir, m["file"]), kind, m) for m in metas]
        tokens[kind] = merge_token_stats(per_shard, token_kinds[kind]["num_tokens"])
        if index is not None and len(metas) == len(entries):
            listed = index["tokens"].get(kind, {}).get("total_tokens")
            if listed != tokens[kind]["total"]:
                problems.append(f"{archive_dir}/index.json: {kind} total_tokens {listed} but the "
                                f"shards hold {tokens[kind]['total']}")
    if not metas:
        return problems, None
    attrs = metas[0]["attrs"]
    frames = sum(m["num_frames"] for m in metas)
    counts = np.sum([m["label_counts"] for m in metas if m["label_counts"].shape ==
                     metas[0]["label_counts"].shape], axis=0)
    summary = {
        "shards": len(metas), "frames": frames, "hours": frames * attrs["frame_shift_ms"] / 3.6e6,
        "utterances": sum(len(m["utt_ids"]) for m in metas),
        "speakers": sum(len(m["spk_ids"]) for m in metas),
        "feature_type": attrs["feature_type"], "feature_dim": attrs["feature_dim"],
        "sample_rate": attrs["sample_rate"], "num_labels": attrs["num_labels"],
        "label_counts": counts, "symbols": symbols, "frame_labels": bool(attrs["frame_labels"]),
        "texts": None, "tokens": tokens,
    }
    if attrs["has_text"]:
        texts = [t for m in metas for t in archive.read_shard_text(
            os.path.join(archive_dir, m["file"])) or []]
        summary["texts"] = (len(texts), sum(1 for t in texts if not t))
    return problems, summary


def check_token_files(archive_dir, kinds):
    """Each kind's inventory file (present, blank first, the shards' hash) and bpe.model."""
    problems = []
    for kind, info in sorted(kinds.items()):
        path = os.path.join(archive_dir, archive.token_inventory_name(kind))
        if not os.path.isfile(path):
            problems.append(f"{path}: missing (the shards have {kind} tokens)")
            continue
        try:
            symbols = archive.read_inventory(path)
        except UserError as err:
            problems.append(str(err))
            continue
        if symbols[:1] != [archive.BLANK]:
            problems.append(f"{path}: id 0 must be the blank {archive.BLANK}, not {symbols[:1]}")
        if archive.inventory_hash(symbols) != info["inventory_hash"]:
            problems.append(f"{path}: does not match the shards' {kind} inventory_hash "
                            f"(its {len(symbols)} symbols, the shards' {info['num_tokens']})")
            continue
        if kind == "bpe":
            model = os.path.join(archive_dir, archive.BPE_MODEL)
            if not os.path.isfile(model):
                problems.append(f"{model}: missing (the shards have bpe tokens)")
                continue
            import sentencepiece as spm
            try:
                sp = spm.SentencePieceProcessor(model_file=model)
            except (OSError, RuntimeError) as err:
                problems.append(f"{model}: not a sentencepiece model ({err})")
                continue
            pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
            if [archive.BLANK, *pieces] != symbols:
                problems.append(f"{model}: its {len(pieces)} pieces are not {path} after the blank")
    return problems


def token_stats(path, kind, meta):
    """One shard's figures for one token kind (the ids are already checked by validate_shard)."""
    ids, offsets = archive.read_shard_tokens(path, kind)
    starts, ends = offsets[:-1], offsets[1:]
    lengths, frames = ends - starts, np.diff(meta["utt_offsets"])
    # CTC puts a blank between two equal neighbours, so it needs T >= tokens + repeats;
    # pairs[k] = equal neighbours (i, i + 1) with i < k, so an utterance has
    # pairs[end - 1] - pairs[start] of them
    pairs = np.zeros(len(ids) + 1, dtype=np.int64)
    pairs[1:len(ids)] = np.cumsum(ids[1:] == ids[:-1])
    pairs[len(ids)] = pairs[max(len(ids) - 1, 0)]
    repeats = pairs[np.maximum(ends - 1, starts)] - pairs[starts]
    ratio = np.where(lengths > 0, frames / np.maximum(lengths, 1), np.inf)
    tightest = int(np.argmin(ratio)) if len(ratio) and np.isfinite(ratio.min()) else None
    return {"total": int(offsets[-1]), "longest": int(lengths.max(initial=0)),
            "min_ratio": float(ratio[tightest]) if tightest is not None else np.inf,
            "tightest": meta["utt_ids"][tightest] if tightest is not None else None,
            "too_short": int((frames < lengths + repeats).sum()),
            "empty": int((lengths == 0).sum())}


def merge_token_stats(per_shard, num_tokens):
    best = min(per_shard, key=lambda s: s["min_ratio"], default=None)
    return {"num_tokens": num_tokens, "total": sum(s["total"] for s in per_shard),
            "longest": max((s["longest"] for s in per_shard), default=0),
            "min_ratio": best["min_ratio"] if best else np.inf,
            "tightest": best["tightest"] if best else None,
            "too_short": sum(s["too_short"] for s in per_shard),
            "empty": sum(s["empty"] for s in per_shard)}


def format_summary(archive_dir, s):
    lines = [f"{archive_dir}: {s['shards']} shards, {s['hours']:.3f} h, {s['frames']} frames, "
             f"{s['utterances']} utterances, {s['speakers']} speakers"]
    if not s["frame_labels"]:
        lines.append(f"features: {s['feature_type']} dim {s['feature_dim']}, {s['sample_rate']} Hz; "
                     f"no frame labels (label inventory of {s['num_labels']})")
    else:
        lines.append(f"features: {s['feature_type']} dim {s['feature_dim']}, {s['sample_rate']} Hz; "
                     f"labels: {s['num_labels']} ({int((s['label_counts'] > 0).sum())} seen)")
    if s["texts"] is not None:
        lines.append(f"text: {s['texts'][0]} transcripts ({s['texts'][1]} empty)")
    seconds = max(s["hours"] * 3600, 1e-9)
    for kind, t in sorted(s["tokens"].items()):
        lines.append(f"tokens {kind}: inventory {t['num_tokens']} (blank included), {t['total']} "
                     f"tokens, {t['total'] / seconds:.1f}/s of speech, longest {t['longest']}, "
                     f"frames per token min {t['min_ratio']:.2f}"
                     f"{' (' + t['tightest'] + ')' if t['tightest'] else ''}; utterances too short "
                     f"for CTC {t['too_short']}, without tokens {t['empty']}")
    if not s["frame_labels"]:
        return "\n".join(lines)
    total = max(int(s["label_counts"].sum()), 1)
    order = np.argsort(-s["label_counts"], kind="stable")[:TOP_LABELS]
    lines.append(f"top {len(order)} labels:")
    for i in order:
        name = s["symbols"][i] if s["symbols"] else str(i)
        lines.append(f"  {i:5d} {name:<8s} {int(s['label_counts'][i]):10d} "
                     f"{100 * s['label_counts'][i] / total:6.2f}%")
    return "\n".join(lines)


def run(args):
    problems, summary = check_archive(args.archive, check_values=not args.no_values)
    if summary is not None:
        print(format_summary(args.archive, summary))
    if problems:
        for p in problems:
            print(f"hpcsgd inspect: problem: {p}")
        print(f"hpcsgd inspect: {args.archive}: INVALID ({len(problems)} problems)")
        return 1
    print(f"hpcsgd inspect: {args.archive}: OK")
    return 0
