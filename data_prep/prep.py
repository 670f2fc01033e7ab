"""hpcsgd prep: Kaldi data directory + alignments -> sharded HDF5 feature archive.

    hpcsgd prep DATA_DIR OUT --alignments ALI [--labels labels.txt] [--num-shards S] [options]
    hpcsgd prep ../shared/data/so762_dev runs/so762 --alignments ../shared/data/so762_dev/phones.ctm \\
        --labels ../shared/data/so762_dev/labels.txt --num-shards 4

Cluster use (one shard per Slurm array task, then the index; see jobs/prep.sbatch):
    hpcsgd prep DATA_DIR OUT --alignments ALI --num-shards S --shard-index $SLURM_ARRAY_TASK_ID
    hpcsgd prep --write-index OUT

Speakers are dealt whole to shards (balanced by alignment frames). Frame label convention: a
segment [start, end) covers frames round(start/shift) .. round(end/shift)-1 (data_prep/kaldi_dir.py,
docs/prep.md). Bad utterances are skipped and counted per reason; the index step fails (exit 2,
no index.json) when more than --max-bad-fraction of all utterances were skipped.
"""
import glob
import json
import os
import sys
import time
from collections import Counter

import numpy as np

from data_prep import features, kaldi_dir
from data_prep.kaldi_dir import BadUtterance
from data_prep.split import deal_speakers, split_speakers
from hpcsgd.data import archive
from hpcsgd.errors import UserError

REPORT_SUFFIX = ".report.json"  # per-shard skip counts, summed by the index step
MAX_LISTED = 10                  # skipped utterances printed per reason (the rest only counted)


def add_arguments(p):
    p.add_argument("data_dir", nargs="?", metavar="DATA_DIR",
                   help="Kaldi data directory: wav.scp, utt2spk, optional segments and text")
    p.add_argument("out", nargs="?", metavar="OUT", help="archive directory to write")
    p.add_argument("--alignments", metavar="PATH",
                   help="frame-label text, CTM file, or a directory of per-utterance segment files")
    p.add_argument("--ali-format", default="auto", choices=["auto", "frames", "ctm", "segments"],
                   help="alignment form (auto: directory -> segments, 5 fields with times -> ctm, "
                        "else frames)")
    p.add_argument("--labels", metavar="labels.txt",
                   help="label inventory 'symbol id'; default: built from the alignments (sorted "
                        "symbols, or ids 0..max for numeric frame labels) and written to OUT/labels.txt")
    p.add_argument("--features", default="fbank", choices=["fbank", "mfcc"],
                   help="log-mel filterbank or MFCC (Kaldi-compatible, kaldi-native-fbank)")
    p.add_argument("--num-mel-bins", type=int, default=40, help="mel bins (fbank dim)")
    p.add_argument("--num-ceps", type=int, default=13,
                   help="MFCC coefficients (13; 40 with --num-mel-bins 40 for hi-res MFCC)")
    p.add_argument("--sample-rate", type=int, default=16000,
                   help="expected sample rate in Hz; other rates are rejected per utterance")
    p.add_argument("--length-tolerance", type=int, default=3,
                   help="frames the alignment may differ from the features (and gap/overlap inside "
                        "it); beyond this the utterance is rejected")
    p.add_argument("--max-bad-fraction", type=float, default=0.05,
                   help="fail (exit 2, no index) when more than this fraction of utterances is skipped")
    p.add_argument("--num-shards", type=int, default=1, help="shards (whole speakers each)")
    p.add_argument("--shard-index", type=int, default=_env_int("SLURM_ARRAY_TASK_ID"),
                   help="write only this shard (default $SLURM_ARRAY_TASK_ID); run --write-index after")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="worker processes for feature extraction (default: all cores)")
    p.add_argument("--cv-speakers", type=int, default=0,
                   help="hold out N speakers: writes OUT/train and OUT/cv (speaker-disjoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --cv-speakers draw")
    p.add_argument("--write-index", metavar="OUT",
                   help="final step: check skip reports and write OUT/index.json (and OUT/train, "
                        "OUT/cv with --cv-speakers); alone, or after all shards when DATA_DIR is given")


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def run(args):
    if args.data_dir is None:
        if not args.write_index:
            raise UserError("give DATA_DIR OUT --alignments PATH, or --write-index OUT")
        finish(args.write_index, args.max_bad_fraction)
        return 0
    if args.out is None or args.alignments is None:
        raise UserError("need DATA_DIR, OUT and --alignments PATH")
    plan = make_plan(args)
    only = args.shard_index
    if only is not None and not 0 <= only < args.num_shards:
        raise UserError(f"--shard-index {only} outside 0..{args.num_shards - 1}")
    todo = [t for t in plan["shards"] if only is None or t["index"] == only]
    for out_dir in plan["archives"]:
        os.makedirs(out_dir, exist_ok=True)
        clean_stale(out_dir, None if only is None else only)
        archive.atomic_write_text(os.path.join(out_dir, archive.LABELS_NAME),
                                  archive.inventory_text(plan["symbols"]))
    t0 = time.time()
    totals = Counter()
    for shard, results in extract_all(plan, todo, args.jobs):
        totals.update(write_one(plan, shard, results, time.time() - t0))
    wall = time.time() - t0
    if totals["utterances"]:
        print(f"prep: {totals['ok']} utterances ({totals['audio_s'] / 3600:.2f} h audio) in {wall:.1f} s "
              f"on {args.jobs} workers: {totals['ok'] / wall:.1f} utterances/s, real-time factor "
              f"{wall / max(totals['audio_s'], 1e-9):.4f} ({totals['audio_s'] / wall:.0f}x real time)")
    if only is None or args.write_index:
        finish(args.out if only is None else args.write_index, args.max_bad_fraction)
    return 0


# ---------------------------------------------------------------- planning (cheap: no audio read)

def make_plan(args):
    config = features.extractor_config(args.features, args.num_mel_bins, args.num_ceps,
                                       args.sample_rate)
    utts, problems = kaldi_dir.read_data_dir(args.data_dir)
    fmt, ali = kaldi_dir.read_alignments(args.alignments, args.ali_format)
    symbols = archive.read_inventory(args.labels) if args.labels else kaldi_dir.build_inventory(fmt, ali)
    numeric = fmt == "frames" and all(t.isdigit() for labels in ali.values() for t in labels)
    label_ids = {str(i) if numeric else s: i for i, s in enumerate(symbols)}
    shift_s = features.FRAME_SHIFT_MS / 1000
    by_spk = {}
    for utt, info in utts.items():
        by_spk.setdefault(info["spk"], []).append(utt)
    weight = {s: sum(max(1, kaldi_dir.alignment_length(fmt, ali[u], shift_s)) if u in ali else 1
                     for u in us) for s, us in by_spk.items()}
    if not weight:
        raise UserError(f"{args.data_dir}: no utterances with both audio and speaker")
    if args.cv_speakers:
        train, cv = split_speakers(weight, args.cv_speakers, args.seed)
        parts = [(os.path.join(args.out, "train"), train, args.num_shards),
                 (os.path.join(args.out, "cv"), cv, min(args.num_shards, len(cv)))]
    else:
        parts = [(args.out, sorted(weight), args.num_shards)]
    shards = []
    for out_dir, speakers, count in parts:
        dealt = deal_speakers({s: weight[s] for s in speakers}, count)
        for i, spks in enumerate(dealt):
            shards.append({"dir": out_dir, "index": i, "num_shards": count,
                           "utts": [u for s in spks for u in sorted(by_spk[s])], "problems": []})
    shards[0]["problems"] = problems  # entries without speaker/audio: counted once, in shard 0
    attrs = {
        "format_version": archive.FORMAT_VERSION, "feature_type": args.features,
        "feature_dim": features.feature_dim(config), "num_labels": len(symbols),
        "label_inventory_hash": archive.inventory_hash(symbols), "sample_rate": args.sample_rate,
        "frame_shift_ms": features.FRAME_SHIFT_MS, "frame_length_ms": features.FRAME_LENGTH_MS,
        "extractor_config": features.config_json(config),
    }
    return {"config": config, "utts": utts, "fmt": fmt, "ali": ali, "symbols": symbols,
            "label_ids": label_ids, "tolerance": args.length_tolerance, "attrs": attrs,
            "shards": shards, "archives": [p[0] for p in parts]}


def clean_stale(out_dir, only):
    """Remove what an earlier (possibly killed) run left: temp files always; with all shards to
    write, also old shards and reports (a different --num-shards would leave extras). The index
    goes in both cases, since the shards are about to change."""
    pattern = "*.tmp.*" if only is None else f"{archive.shard_name(only)}*.tmp.*"
    stale = glob.glob(os.path.join(out_dir, pattern)) + glob.glob(os.path.join(out_dir, archive.INDEX_NAME))
    if only is None:
        stale += glob.glob(os.path.join(out_dir, "shard-*.h5"))
        stale += glob.glob(os.path.join(out_dir, "shard-*" + REPORT_SUFFIX))
    for path in stale:
        os.unlink(path)


# ---------------------------------------------------------------- extraction (in worker processes)

_worker = {}


def _init_worker(plan):
    _worker.clear()
    _worker.update(plan)


def extract_one(utt):
    """-> (utt, feats, labels, seconds) or (utt, None, reason, detail). Runs in a worker."""
    w = _worker
    info = w["utts"][utt]
    try:
        if utt not in w["ali"]:
            raise BadUtterance("no alignment", f"{utt}: no alignment in the alignments given")
        sr = w["config"]["sample_rate"]
        samples = features.read_audio(utt, info["path"], info["start"], info["end"], sr)
        feats = features.compute(w["config"], samples, utt)
        labels = kaldi_dir.frame_labels(utt, w["fmt"], w["ali"][utt], w["label_ids"], len(feats),
                                        features.FRAME_SHIFT_MS / 1000, w["tolerance"])
        return utt, feats, labels, len(samples) / sr
    except BadUtterance as bad:
        return utt, None, bad.reason, str(bad)


def extract_all(plan, todo, jobs):
    """Yield (shard, results) in order; one pool streams all shards' utterances so no core idles
    at shard boundaries. Workers get the plan at fork time and open their own audio files."""
    worker_plan = {k: plan[k] for k in ("config", "utts", "fmt", "ali", "label_ids", "tolerance")}
    stream = [u for shard in todo for u in shard["utts"]]
    if jobs <= 1:
        _init_worker(worker_plan)
        results = map(extract_one, stream)
        pool = None
    else:
        import multiprocessing
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        pool = ctx.Pool(jobs, initializer=_init_worker, initargs=(worker_plan,))
        results = pool.imap(extract_one, stream, chunksize=4)
    try:
        for shard in todo:
            yield shard, [next(results) for _ in shard["utts"]]
    finally:
        if pool is not None:
            pool.terminate()


# ---------------------------------------------------------------- writing one shard

def write_one(plan, shard, results, elapsed):
    good = [r for r in results if r[1] is not None]
    bad = [(r[0], r[2], r[3]) for r in results if r[1] is None] + shard["problems"]
    spk_ids = sorted({plan["utts"][u]["spk"] for u, *_ in good})
    spk_index = {s: i for i, s in enumerate(spk_ids)}
    dim, num_labels = plan["attrs"]["feature_dim"], plan["attrs"]["num_labels"]
    lengths = [len(f) for _, f, _, _ in good]
    offsets = np.zeros(len(good) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    feats = np.concatenate([f for _, f, _, _ in good]) if good else np.zeros((0, dim), np.float32)
    labels = np.concatenate([l for _, _, l, _ in good]) if good else np.zeros(0, np.int32)
    utt_spk = np.array([spk_index[plan["utts"][u]["spk"]] for u, *_ in good], dtype=np.int32)
    cmvn = np.zeros((len(spk_ids), 2, dim + 1), dtype=np.float64)  # Kaldi: [sums, count; sumsq, 0]
    for u, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        block = feats[a:b].astype(np.float64)
        cmvn[utt_spk[u], 0, :dim] += block.sum(axis=0)
        cmvn[utt_spk[u], 0, dim] += b - a
        cmvn[utt_spk[u], 1, :dim] += (block * block).sum(axis=0)
    counts = np.bincount(labels, minlength=num_labels).astype(np.int64)
    path = os.path.join(shard["dir"], archive.shard_name(shard["index"]))
    archive.write_shard(path, feats, labels, offsets, [u for u, *_ in good], utt_spk, spk_ids,
                        cmvn, counts, plan["attrs"])
    reasons = Counter(reason for _, reason, _ in bad)
    report = {"shard": shard["index"], "num_shards": shard["num_shards"],
              "utterances": len(results) + len(shard["problems"]), "ok": len(good),
              "skipped": dict(sorted(reasons.items())), "frames": int(len(feats)),
              "audio_s": float(sum(r[3] for r in good))}
    archive.atomic_write_text(path[:-len(".h5")] + REPORT_SUFFIX, json.dumps(report, indent=1) + "\n")
    listed = Counter()
    for utt, reason, detail in bad:
        listed[reason] += 1
        if listed[reason] <= MAX_LISTED:
            print(f"prep: skipped {detail}", file=sys.stderr)
    for reason, n in sorted(listed.items()):
        if n > MAX_LISTED:
            print(f"prep: ... and {n - MAX_LISTED} more skipped for {reason}", file=sys.stderr)
    print(f"prep: wrote {path}: {len(good)} utterances, {len(spk_ids)} speakers, {len(feats)} frames, "
          f"{len(bad)} skipped ({elapsed:.1f} s)")
    return Counter(utterances=report["utterances"], ok=len(good), audio_s=report["audio_s"])


# ---------------------------------------------------------------- the index step

def finish(out, max_bad_fraction):
    """Check every shard's report (all shards present, skip fraction) and write the index(es)."""
    dirs = [os.path.join(out, d) for d in ("train", "cv") if os.path.isdir(os.path.join(out, d))] or [out]
    reports = {d: load_reports(d) for d in dirs}
    total = sum(r["utterances"] for rs in reports.values() for r in rs)
    skipped = Counter()
    for rs in reports.values():
        for r in rs:
            skipped.update(r["skipped"])
    bad = sum(skipped.values())
    if skipped:
        print("prep: skipped utterances by reason: " +
              ", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) + f" (total {bad} of {total})")
    if total == 0 or bad / total > max_bad_fraction:
        raise UserError(f"{out}: {bad} of {total} utterances skipped, more than --max-bad-fraction "
                        f"{max_bad_fraction}; no index written (fix the inputs listed above, or raise "
                        f"the fraction)")
    for d in dirs:
        index = archive.write_index(d)
        print(f"prep: wrote {os.path.join(d, archive.INDEX_NAME)}: {len(index['shards'])} shards, "
              f"{index['total_utterances']} utterances, {index['total_speakers']} speakers, "
              f"{index['total_frames']} frames, {index['hours']:.3f} h")


def load_reports(out_dir):
    paths = sorted(glob.glob(os.path.join(out_dir, "shard-*" + REPORT_SUFFIX)))
    if not paths:
        raise UserError(f"{out_dir}: no shard reports (shard-*{REPORT_SUFFIX}); run the shard tasks first")
    reports = []
    for p in paths:
        try:
            with open(p) as f:
                reports.append(json.load(f))
        except (OSError, ValueError) as err:
            raise UserError(f"{p}: unreadable shard report ({err})") from None
    expected = reports[0]["num_shards"]
    have = {r["shard"] for r in reports}
    missing = [archive.shard_name(i) for i in range(expected) if i not in have]
    missing += [archive.shard_name(r["shard"]) for r in reports
                if not os.path.isfile(os.path.join(out_dir, archive.shard_name(r["shard"])))]
    if missing:
        raise UserError(f"{out_dir}: shards {sorted(set(missing))} of {expected} are missing; "
                        f"re-run their array tasks (--shard-index) before --write-index")
    extra = sorted(set(glob.glob(os.path.join(out_dir, "shard-*.h5"))) -
                   {os.path.join(out_dir, archive.shard_name(i)) for i in range(expected)})
    if extra or any(r["num_shards"] != expected for r in reports):
        raise UserError(f"{out_dir}: shards from runs with a different --num-shards ({extra}); "
                        f"delete the directory and re-run")
    return reports
