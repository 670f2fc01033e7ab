"""hpcsgd inspect: validate an HDF5 feature archive and print a summary.

    hpcsgd inspect ARCHIVE [--no-values]
    hpcsgd inspect runs/so762

Checks: index.json readable and naming only existing shards; every shard's datasets, shapes,
offsets, label range, label counts and (unless --no-values) NaN/Inf features; attributes equal
across shards and the index; index frame/utterance/speaker counts vs the shards; each speaker and
utterance in exactly one shard; labels.txt matching the inventory hash. Exits 1 naming every
problem. Summary: hours, frames, utterances, speakers, features, label histogram.
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
        "label_counts": counts, "symbols": symbols,
    }
    return problems, summary


def format_summary(archive_dir, s):
    lines = [f"{archive_dir}: {s['shards']} shards, {s['hours']:.3f} h, {s['frames']} frames, "
             f"{s['utterances']} utterances, {s['speakers']} speakers",
             f"features: {s['feature_type']} dim {s['feature_dim']}, {s['sample_rate']} Hz; "
             f"labels: {s['num_labels']} ({int((s['label_counts'] > 0).sum())} seen)"]
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
