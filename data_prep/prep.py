"""hpcsgd prep: Kaldi data directory or LibriSpeech subset (+ alignments) -> sharded HDF5 archive.

    hpcsgd prep DATA_DIR OUT [--alignments ALI] [--labels labels.txt] [--tokens phones,chars,bpe]
                [--speed-perturb 0.9,1.0,1.1] [--num-shards S] [options]
    hpcsgd prep ../shared/data/so762_dev runs/so762 --alignments ../shared/data/so762_dev/phones.ctm \\
        --labels ../shared/data/so762_dev/labels.txt --num-shards 4
    hpcsgd prep ../shared/data/so762_dev runs/so762_text --labels ../shared/data/so762_dev/labels.txt
    hpcsgd prep LibriSpeech/train-clean-5 runs/ls --tokens bpe,chars \\
        --speakers train_speakers.txt,dev_speakers.txt --cv-speakers dev_speakers.txt

DATA_DIR is a Kaldi data directory (wav.scp, utt2spk, ...: data_prep/kaldi_dir.py), a
LibriSpeech subset in its own layout (<speaker>/<chapter>/*.flac + *.trans.txt:
data_prep/librispeech.py), or lhotse manifests (recordings + supervisions JSON lines:
data_prep/lhotse_manifests.py).

Alignments give frame labels (hybrid training); the data directory's `text` gives transcripts
and token sequences (CTC, RNN-T: data_prep/tokens.py). Either suffices; with both, both are
stored. Speed perturbation adds every training utterance at each factor f != 1 (Kaldi's
sp{f}-utt, sp{f}-spk), its audio resampled (soxr) and its alignment's times divided by f.

Cluster use (one shard per Slurm array task, then the index; see jobs/prep.sbatch):
    hpcsgd prep DATA_DIR OUT --alignments ALI --num-shards S --shard-index $SLURM_ARRAY_TASK_ID
    hpcsgd prep --write-index OUT

Speakers are dealt whole to shards (balanced by alignment frames, or utterance counts without
alignments). Frame label convention: a segment [start, end) covers frames round(start/shift) ..
round(end/shift)-1 (data_prep/kaldi_dir.py, docs/prep.md). Bad utterances are skipped and counted per reason; the index step fails (exit 2,
no index.json) when more than --max-bad-fraction of all utterances were skipped.
"""
import fnmatch
import glob
import json
import math
import os
import signal
import sys
import time
from collections import Counter

import numpy as np

from data_prep import features, kaldi_dir, lhotse_manifests, librispeech, tokens
from data_prep.kaldi_dir import BadUtterance
from data_prep.split import deal_speakers, split_speakers
from hpcsgd.data import archive
from hpcsgd.decode import lexicon
from hpcsgd.errors import UserError

REPORT_SUFFIX = ".report.json"  # per-shard skip counts, summed by the index step
MAX_LISTED = 10                  # skipped utterances printed per reason (the rest only counted)
EXIT_INTERRUPTED = 130           # 128 + SIGINT, as the shell reports Ctrl-C


def add_arguments(p):
    p.add_argument("data_dir", nargs="?", metavar="DATA_DIR",
                   help="Kaldi data directory (wav.scp, utt2spk, optional segments and text), a "
                        "LibriSpeech subset (<speaker>/<chapter>/*.flac + *.trans.txt), or "
                        "lhotse manifests (a *supervisions*.jsonl[.gz] file with its "
                        "recordings beside it, or a directory holding one such pair)")
    p.add_argument("out", nargs="?", metavar="OUT", help="archive directory to write")
    p.add_argument("--alignments", metavar="PATH",
                   help="frame-label text, CTM file, or a directory of per-utterance segment files; "
                        "without it: no frame labels, tokens from DATA_DIR/text")
    p.add_argument("--ali-format", default="auto", choices=["auto", "frames", "ctm", "segments"],
                   help="alignment form (auto: directory -> segments, 5 fields with times -> ctm, "
                        "else frames)")
    p.add_argument("--labels", metavar="labels.txt",
                   help="label inventory 'symbol id'; default: built from the alignments (sorted "
                        "symbols, or ids 0..max for numeric frame labels) and written to OUT/labels.txt")
    p.add_argument("--tokens", metavar="KINDS",
                   help="token sequences to store, comma-separated from phones,chars,bpe, or none "
                        "(default: phones with --alignments, or from the lexicon with --labels and "
                        "a `text` it can pronounce; chars with a `text`; with --token-inventory: "
                        "that archive's kinds)")
    p.add_argument("--bpe-size", type=int, default=256,
                   help="sentencepiece BPE pieces (--tokens bpe), learnt from the training text")
    p.add_argument("--lexicon", metavar="FILE",
                   help="Kaldi lexicon.txt (WORD PH1 PH2 ...) for phones without --alignments, "
                        "before CMUdict; each word's first pronunciation")
    p.add_argument("--token-inventory", metavar="ARCHIVE",
                   help="take tokens_<kind>.txt (and bpe.model) from this archive instead of "
                        "building them (a test set for a trained model)")
    p.add_argument("--speed-perturb", metavar="FACTORS",
                   help="e.g. 0.9,1.0,1.1: also every training utterance at each factor != 1 "
                        "(sp{f}-utt, sp{f}-spk, audio f times faster; never the --cv-speakers)")
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
    p.add_argument("--speakers", metavar="FILE[,FILE]",
                   help="keep only these speakers (one id per line; several files are joined); "
                        "a listed speaker the corpus lacks is an error")
    p.add_argument("--cv-speakers", default="0", metavar="N|FILE[,FILE]",
                   help="hold out speakers: N drawn at random (--seed), or the speakers listed in "
                        "FILE; writes OUT/train and OUT/cv (speaker-disjoint)")
    p.add_argument("--seed", type=int, default=0, help="seed of the --cv-speakers draw")
    p.add_argument("--write-index", metavar="OUT",
                   help="final step: check skip reports and write OUT/index.json (and OUT/train, "
                        "OUT/cv with --cv-speakers); alone, or after all shards when DATA_DIR is given")


def _env_int(name):
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else None


def run(args):
    try:
        return prep(args)
    except KeyboardInterrupt:   # Ctrl-C: one line, not the pool's tracebacks
        return interrupted(args)


def interrupted(args):
    """After Ctrl-C: the workers are stopped (prep closes extract_all, which terminates the
    pool; they ignore SIGINT themselves, so print nothing), this process's temp files in OUT
    are removed, and every file left there is complete (each is written under a temp name and
    renamed). One line on stderr; exit 130, the shell's code for Ctrl-C."""
    out = args.out or args.write_index
    dirs = {d for d in (args.out, args.write_index) if d}
    dirs |= {os.path.join(d, part) for d in dirs for part in ("train", "cv")}
    for d in dirs:
        for path in glob.glob(os.path.join(glob.escape(d), f"*.tmp.{os.getpid()}")):
            os.unlink(path)
    print(f"prep: interrupted; workers stopped, nothing half-written"
          f"{f' in {out}' if out else ''} (the files there are complete; no index until a "
          f"run finishes): run the same command again to finish", file=sys.stderr)
    return EXIT_INTERRUPTED


def prep(args):
    if args.data_dir is None:
        if not args.write_index:
            raise UserError("give DATA_DIR OUT [--alignments PATH], or --write-index OUT")
        finish(args.write_index, args.max_bad_fraction)
        return 0
    if args.out is None:
        raise UserError("need DATA_DIR and OUT (and --alignments PATH, or a `text` in DATA_DIR)")
    check_out_apart(args)
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
        for kind, symbols in plan["tokens"]["inventories"].items():
            archive.atomic_write_text(os.path.join(out_dir, archive.token_inventory_name(kind)),
                                      archive.inventory_text(symbols))
        if plan["tokens"]["bpe_model"] is not None:
            archive.atomic_write_bytes(os.path.join(out_dir, archive.BPE_MODEL),
                                       plan["tokens"]["bpe_model"])
    t0 = time.time()
    totals = Counter()
    shards = extract_all(plan, todo, args.jobs)
    try:
        for shard, results in shards:
            totals.update(write_one(plan, shard, results, time.time() - t0))
    finally:
        shards.close()   # its pool terminated now, on Ctrl-C too (not when collected)
    wall = time.time() - t0
    if totals["utterances"]:
        print(f"prep: {totals['ok']} utterances ({totals['audio_s'] / 3600:.2f} h audio) in {wall:.1f} s "
              f"on {args.jobs} workers: {totals['ok'] / wall:.1f} utterances/s, real-time factor "
              f"{wall / max(totals['audio_s'], 1e-9):.4f} ({totals['audio_s'] / wall:.0f}x real time)")
    if only is None or args.write_index:
        finish(args.out if only is None else args.write_index, args.max_bad_fraction)
    return 0


# ---------------------------------------------------------------- planning (cheap: no audio read)

# what prep writes or removes in an archive directory (write_one, run, clean_stale, finish)
WRITES = (archive.LABELS_NAME, archive.INDEX_NAME, archive.BPE_MODEL,
          archive.token_inventory_name("*"), "shard-*.h5", "shard-*" + REPORT_SUFFIX, "*.tmp.*")


def check_out_apart(args):
    """Refuse an OUT that would write into prep's input (a later --labels DATA_DIR/labels.txt
    would name other classes): OUT, or the OUT/train and OUT/cv that --cv-speakers writes
    (and the index step reads whenever they exist), being DATA_DIR, the --alignments
    directory or the --token-inventory archive; or an archive directory prep writes holding
    an input file (--alignments, --labels, --lexicon) under a name it writes or removes.
    Compared as real paths (symbolic links, `..`), before anything is read or written."""
    out = os.path.realpath(args.out)
    parts = [os.path.realpath(os.path.join(out, part)) for part in ("train", "cv")]
    archives = [out] + parts
    written = parts if str(args.cv_speakers) != "0" else [out]   # N or a speaker list
    dirs = [("DATA_DIR", args.data_dir)]
    files = []
    for option, path in (("--alignments", args.alignments), ("--labels", args.labels),
                         ("--lexicon", args.lexicon), ("--token-inventory", args.token_inventory)):
        if path is not None:
            (dirs if os.path.isdir(path) else files).append((option, path))
    for what, path in dirs:
        real = os.path.realpath(path)
        if real in archives:
            part = "" if real == out else f"/{('train', 'cv')[parts.index(real)]} (where " \
                f"--cv-speakers writes and the index step reads an archive)"
            raise UserError(f"OUT {args.out}{part} is the input {what} {path}: prep never "
                            f"writes into its input; give another OUT")
    for what, path in files:
        real = os.path.realpath(path)
        if os.path.dirname(real) in written and any(
                fnmatch.fnmatch(os.path.basename(real), name) for name in WRITES):
            raise UserError(f"OUT {args.out} would overwrite the input {what} {path}: prep "
                            f"never writes into its input; give another OUT")


def make_plan(args):
    config = features.extractor_config(args.features, args.num_mel_bins, args.num_ceps,
                                       args.sample_rate)
    keep = read_speaker_lists(args.speakers, "--speakers") if args.speakers else None
    corpus = read_corpus(args.data_dir, keep)
    utts, problems, text = corpus["utts"], corpus["problems"], corpus["text"]
    if args.alignments is None and text is None:
        raise UserError(f"{args.data_dir}: no `text` (transcripts: UTT WORD WORD ...) and no "
                        f"--alignments given: nothing to train on; give --alignments ALI (frame "
                        f"labels) or add the transcripts (token sequences)")
    if args.alignments is not None:
        fmt, ali = kaldi_dir.read_alignments(args.alignments, args.ali_format)
        symbols = archive.read_inventory(args.labels) if args.labels else kaldi_dir.build_inventory(fmt, ali)
        numeric = fmt == "frames" and all(t.isdigit() for labels in ali.values() for t in labels)
    else:   # text only: no frame labels; --labels still names the phones of the lexicon's tokens
        fmt, ali = None, None
        wants_phones = args.tokens is not None and "phones" in args.tokens.split(",")
        symbols = archive.read_inventory(args.labels) if args.labels else \
            [tokens.SIL, *lexicon.ARPABET] if wants_phones and not args.token_inventory else []
        numeric = False
    label_ids = {str(i) if numeric else s: i for i, s in enumerate(symbols)}
    shift_s = features.FRAME_SHIFT_MS / 1000
    by_spk = {}
    for utt, info in utts.items():
        by_spk.setdefault(info["spk"], []).append(utt)
    if ali is not None:   # alignment frames, known before any audio is read
        weight = {s: sum(max(1, kaldi_dir.alignment_length(fmt, ali[u], shift_s)) if u in ali else 1
                         for u in us) for s, us in by_spk.items()}
    else:
        weight = {s: len(us) for s, us in by_spk.items()}
    if not weight:
        raise UserError(f"{args.data_dir}: no utterances with both audio and speaker")
    train, cv = choose_cv(args, weight)
    train_utts = sorted(u for s in train for u in by_spk[s])   # the text inventories learn from
    train = train + add_speed_copies(parse_speeds(args.speed_perturb), train, utts, by_spk, weight)
    if cv:
        parts = [(os.path.join(args.out, "train"), train, args.num_shards),
                 (os.path.join(args.out, "cv"), cv, min(args.num_shards, len(cv)))]
    else:
        parts = [(args.out, train, args.num_shards)]
    shards = []
    for out_dir, speakers, count in parts:
        dealt = deal_speakers({s: weight[s] for s in speakers}, count)
        for i, spks in enumerate(dealt):
            shards.append({"dir": out_dir, "index": i, "num_shards": count,
                           "utts": [u for s in spks for u in sorted(by_spk[s])], "problems": []})
    shards[0]["problems"] = problems  # entries without speaker/audio: counted once, in shard 0
    tok = plan_tokens(args, text, corpus["text_path"],
                      [" ".join(text.get(u, [])) for u in train_utts] if text else [],
                      symbols, ali is not None)
    if text is not None and not tok["needs_text"]:
        lacking = sum(1 for u, info in utts.items() if "src" not in info and u not in text)
        if lacking:
            print(f"prep: {lacking} utterances have no line in {tok['text_path']}: stored with an "
                  f"empty transcript")
    attrs = {
        "format_version": archive.FORMAT_VERSION, "feature_type": args.features,
        "feature_dim": features.feature_dim(config), "num_labels": len(symbols),
        "label_inventory_hash": archive.inventory_hash(symbols), "sample_rate": args.sample_rate,
        "frame_shift_ms": features.FRAME_SHIFT_MS, "frame_length_ms": features.FRAME_LENGTH_MS,
        "extractor_config": features.config_json(config), "frame_labels": ali is not None,
        "has_text": text is not None, "tokens": archive.token_attrs(tok["inventories"]),
    }
    return {"config": config, "utts": utts, "gender": corpus["gender"], "fmt": fmt, "ali": ali, "symbols": symbols,
            "label_ids": label_ids, "tolerance": args.length_tolerance, "attrs": attrs,
            "text": text, "tokens": tok, "shards": shards, "archives": [p[0] for p in parts]}


def read_corpus(data_dir, keep):
    """The corpus in any of its layouts -> {utts, problems, text, text_path, gender}; `keep` a
    set of speaker ids (None: all), one the corpus lacks is an error."""
    pair = lhotse_manifests.manifest_pair(data_dir)
    if pair:
        utts, problems, text, gender = lhotse_manifests.read_manifests(pair, keep)
        return {"utts": utts, "problems": problems, "text": text, "gender": gender,
                "text_path": pair[0]}
    if librispeech.is_subset(data_dir):
        utts, problems, text = librispeech.read_subset(data_dir, keep)
        return {"utts": utts, "problems": problems, "text": text, "gender": librispeech.read_genders(data_dir),
                "text_path": os.path.join(data_dir, "*/*/*" + librispeech.TRANS_SUFFIX)}
    if os.path.isdir(data_dir) and not os.path.isfile(os.path.join(data_dir, "wav.scp")):
        raise UserError(f"{data_dir}: neither a Kaldi data directory (wav.scp, utt2spk), a "
                        f"LibriSpeech subset (<speaker>/<chapter>/*.flac and *.trans.txt) nor "
                        f"lhotse manifests (*supervisions*.jsonl[.gz] and its recordings)")
    utts, problems = kaldi_dir.read_data_dir(data_dir)
    if keep is not None:
        present = {info["spk"] for info in utts.values()}
        lacking = sorted(set(keep) - present)
        if lacking:
            raise UserError(f"--speakers: {len(lacking)} speakers are not in {data_dir}/utt2spk: "
                            f"{' '.join(lacking[:10])}{' ...' if len(lacking) > 10 else ''}")
        utts = {u: info for u, info in utts.items() if info["spk"] in keep}
        problems = [p for p in problems if p[0] in utts]
    return {"utts": utts, "problems": problems, "text": kaldi_dir.read_text(data_dir),
            "text_path": os.path.join(data_dir, "text"), "gender": kaldi_dir.read_genders(data_dir)}


def read_speaker_lists(option, flag):
    """'a.txt,b.txt' -> the set of speaker ids listed (first field of each line)."""
    speakers = set()
    for path in option.split(","):
        if not os.path.isfile(path):
            raise UserError(f"{flag} {option}: {path} is not a file (one speaker id per line)")
        with open(path, encoding="utf-8") as f:
            speakers.update(line.split()[0] for line in f if line.split())
    if not speakers:
        raise UserError(f"{flag} {option}: lists no speaker")
    return speakers


def choose_cv(args, weight):
    """-> (train, cv) speaker lists: --cv-speakers N draws N (seeded), FILE names them."""
    option = str(args.cv_speakers)
    if option.isdigit():
        n = int(option)
        return split_speakers(weight, n, args.seed) if n else (sorted(weight), [])
    cv = read_speaker_lists(option, "--cv-speakers")
    lacking = sorted(cv - set(weight))
    if lacking:
        raise UserError(f"--cv-speakers {option}: {len(lacking)} speakers have no usable "
                        f"utterance in {args.data_dir}"
                        f"{' (or are not in --speakers)' if args.speakers else ''}: "
                        f"{' '.join(lacking[:10])}{' ...' if len(lacking) > 10 else ''}")
    if len(cv) == len(weight):
        raise UserError(f"--cv-speakers {option}: lists every speaker; none would be left to train on")
    return sorted(s for s in weight if s not in cv), sorted(cv)


def parse_speeds(option):
    """--speed-perturb '0.9,1.0,1.1' -> [0.9, 1.1]: the factors that add copies (1.0 is the
    original, always kept)."""
    if not option:
        return []
    try:
        factors = [float(f) for f in option.split(",") if f.strip()]
    except ValueError:
        raise UserError(f"--speed-perturb {option!r}: expected factors such as 0.9,1.0,1.1") from None
    names = [f"{f:g}" for f in factors]
    if any(not 0 < f < 10 for f in factors) or len(set(names)) != len(names):
        raise UserError(f"--speed-perturb {option!r}: factors must be distinct, above 0 (and "
                        f"below 10)")
    return [f for f in factors if f != 1.0]


def add_speed_copies(factors, speakers, utts, by_spk, weight):
    """Add each speaker's utterances at each factor (Kaldi's perturb_data_dir_speed.sh ids:
    sp{f}-utt of speaker sp{f}-spk, a speaker of its own with its own CMVN statistics) to
    utts, by_spk and weight (frames / f); -> the new speakers."""
    added = []
    for f in factors:
        prefix = f"sp{f:g}-"
        for spk in speakers:
            new_spk = prefix + spk
            if new_spk in by_spk:
                raise UserError(f"--speed-perturb: speaker {new_spk} already in utt2spk")
            by_spk[new_spk] = []
            for utt in by_spk[spk]:
                if prefix + utt in utts:
                    raise UserError(f"--speed-perturb: utterance {prefix + utt} already in utt2spk")
                utts[prefix + utt] = {**utts[utt], "spk": new_spk, "src": utt, "speed": f}
                by_spk[new_spk].append(prefix + utt)
            weight[new_spk] = weight[spk] / f
            added.append(new_spk)
    return added


def plan_tokens(args, text, text_path, train_text, symbols, have_ali):
    """Which token kinds, their inventories (built from the training transcripts, or taken from
    --token-inventory) and what the workers need to encode an utterance."""
    kinds = None
    if args.tokens is not None:
        kinds = [] if args.tokens.strip() == "none" else \
            [k.strip() for k in args.tokens.split(",") if k.strip()]
        bad = [k for k in kinds if k not in archive.TOKEN_KINDS]
        if bad or len(set(kinds)) != len(kinds):
            raise UserError(f"--tokens {args.tokens}: kinds are {', '.join(archive.TOKEN_KINDS)} "
                            f"(each once), or none")
    elif args.token_inventory:
        kinds = sorted(archive.read_index(args.token_inventory)["tokens"])
    if text is None and kinds and {"chars", "bpe"} & set(kinds):
        raise UserError(f"--tokens {','.join(kinds)}: chars and bpe come from the transcripts, "
                        f"and {text_path} does not exist")
    loaded, model = tokens.load_inventories(args.token_inventory, kinds or []) \
        if args.token_inventory else ({}, None)
    # phones without alignments: the lexicon's pronunciations of the transcripts' words
    phone_symbols = loaded["phones"][1:] if "phones" in loaded else tokens.phone_inventory(symbols)[1:]
    prons, lacking = None, 0
    if not have_ali and text is not None and ("phones" in kinds if kinds is not None else phone_symbols):
        if not phone_symbols:
            raise UserError("--tokens phones without --alignments spells the words with the "
                            "lexicon's phones: give their inventory, --labels labels.txt")
        prons, lacking = tokens.pronunciations([w for ws in text.values() for w in ws],
                                               phone_symbols, args.lexicon)
        prons = {w: [p[0]] for w, p in prons.items()}   # the first pronunciation
    if kinds is None:   # the defaults
        kinds = (["phones"] if have_ali or prons else []) + (["chars"] if text is not None else [])
        if prons is not None and "phones" not in kinds:
            print(f"prep: no phones tokens: no word of {text_path} has a pronunciation with the "
                  f"phones of {args.labels}")
    if "phones" in kinds and not have_ali and text is None:
        raise UserError("--tokens phones needs --alignments, or a `text` and --labels (the "
                        "lexicon's phones)")
    inventories = dict(loaded)
    for kind in kinds:
        if kind in inventories:
            continue
        if kind == "phones":
            inventories[kind] = tokens.phone_inventory(symbols)
        elif kind == "chars":
            inventories[kind] = tokens.char_inventory(train_text)
        else:
            model = tokens.train_bpe(train_text, args.bpe_size, text_path)
            inventories[kind] = tokens.bpe_inventory(model)
    if inventories.get("phones") == [archive.BLANK]:
        raise UserError(f"--tokens phones: the label inventory has no phone but {tokens.SIL}")
    phones_from = None if "phones" not in kinds else "alignments" if have_ali else "lexicon"
    source = {"alignments": ", from the alignments", None: "",
              "lexicon": f", from the lexicon: {lacking} words without a pronunciation"}
    described = ", ".join(f"{k} ({len(inventories[k]) - 1} + blank"
                          f"{source[phones_from] if k == 'phones' else ''})" for k in kinds)
    print(f"prep: tokens: {described or 'none'}"
          f"{' from ' + args.token_inventory if args.token_inventory else ''}")
    return {"kinds": kinds, "inventories": inventories,
            "ids": {k: {s: i for i, s in enumerate(inventories[k])} for k in kinds if k != "bpe"},
            "bpe_model": model if "bpe" in kinds else None, "phones_from": phones_from,
            "prons": prons if phones_from == "lexicon" else None, "text_path": text_path,
            "needs_text": bool({"chars", "bpe"} & set(kinds)) or phones_from == "lexicon"}


def clean_stale(out_dir, only):
    """Remove what an earlier (possibly killed) run left: temp files always; with all shards to
    write, also old shards, reports and token inventories (a different --num-shards or --tokens
    would leave extras). The index goes in both cases, since the shards are about to change."""
    pattern = "*.tmp.*" if only is None else f"{archive.shard_name(only)}*.tmp.*"
    stale = glob.glob(os.path.join(out_dir, pattern)) + glob.glob(os.path.join(out_dir, archive.INDEX_NAME))
    if only is None:
        stale += glob.glob(os.path.join(out_dir, "shard-*.h5"))
        stale += glob.glob(os.path.join(out_dir, "shard-*" + REPORT_SUFFIX))
        stale += glob.glob(os.path.join(out_dir, archive.token_inventory_name("*")))
        stale += glob.glob(os.path.join(out_dir, archive.BPE_MODEL))
    for path in stale:
        os.unlink(path)


# ---------------------------------------------------------------- extraction (in worker processes)

_worker = {}
WORKER_KEYS = ("config", "utts", "fmt", "ali", "symbols", "label_ids", "tolerance", "text", "tokens")


def _init_pool_worker(plan):
    # Ctrl-C reaches the whole process group: the parent stops the workers (terminate), and a
    # worker's own KeyboardInterrupt would only print its traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _init_worker(plan)


def _init_worker(plan):
    _worker.clear()
    _worker.update(plan)
    tok = plan["tokens"]
    _worker["bpe"] = tokens.bpe_processor(tok["bpe_model"]) if tok["bpe_model"] else None


def extract_one(utt):
    """-> (utt, {feats, labels, seconds, tokens, text}, None, None) or (utt, None, reason,
    detail). Runs in a worker. A speed-perturbed copy reads its source's audio, alignment and
    transcript; its tokens are the source's."""
    w = _worker
    info = w["utts"][utt]
    src, speed = info.get("src", utt), info.get("speed", 1.0)
    name = utt if src == utt else f"{utt} (speed {speed:g} copy of {src})"   # in skip reasons
    try:
        if w["ali"] is not None and src not in w["ali"]:
            raise BadUtterance("no alignment", f"{name}: no alignment in the alignments given")
        words = w["text"].get(src) if w["text"] is not None else None
        toks = text_tokens(name, words)
        sr = w["config"]["sample_rate"]
        samples = features.read_audio(utt, info["path"], info["start"], info["end"], sr)
        src_frames = features.num_frames(len(samples), sr)
        if speed != 1.0:
            if src_frames == 0:   # the source is skipped, so its copies are too
                raise BadUtterance("empty audio", f"{name}: {len(samples)} samples, shorter than "
                                                  f"one {features.FRAME_LENGTH_MS:g} ms frame")
            samples = features.perturb_speed(samples, speed, sr)
        feats = features.compute(w["config"], samples, utt)
        labels = None
        if w["ali"] is not None:
            shift_s = features.FRAME_SHIFT_MS / 1000
            src_labels = kaldi_dir.frame_labels(name, w["fmt"], w["ali"][src], w["label_ids"],
                                                src_frames, shift_s, w["tolerance"])
            if speed == 1.0:
                labels = src_labels
            else:   # segment times / f (as a ctm's segments); the tolerance stretches with them
                segs = [(a / speed, b / speed, label) for a, b, label in
                        kaldi_dir.time_segments(w["fmt"], w["ali"][src], shift_s)]
                labels = kaldi_dir.frame_labels(utt, "ctm", segs, w["label_ids"], len(feats),
                                                shift_s, math.ceil(w["tolerance"] / min(speed, 1)))
            if w["tokens"]["phones_from"] == "alignments":
                toks["phones"] = tokens.phones_of_labels(name, src_labels, w["symbols"],
                                                         w["tokens"]["ids"]["phones"])
        out = {"feats": feats, "labels": labels, "seconds": len(samples) / sr, "tokens": toks,
               "text": " ".join(words or [])}
        return utt, out, None, None
    except BadUtterance as bad:
        return utt, None, bad.reason, str(bad)


def text_tokens(utt, words):
    """{kind: ids} of the kinds spelt from the transcript (chars, bpe, phones from the lexicon)."""
    tok = _worker["tokens"]
    if not tok["needs_text"]:
        return {}
    if words is None:
        raise BadUtterance("no transcript", f"{utt}: no transcript in {tok['text_path']}")
    if not words:
        raise BadUtterance("empty transcript", f"{utt}: empty transcript in {tok['text_path']}")
    out = {}
    if "chars" in tok["kinds"]:
        out["chars"] = tokens.chars(utt, words, tok["ids"]["chars"])
    if "bpe" in tok["kinds"]:
        out["bpe"] = tokens.bpe(utt, words, _worker["bpe"])
    if tok["phones_from"] == "lexicon":
        out["phones"] = tokens.phones_of_words(utt, words, tok["prons"], tok["ids"]["phones"])
    return out


def extract_all(plan, todo, jobs):
    """Yield (shard, results) in order; one pool streams all shards' utterances so no core idles
    at shard boundaries. Workers get the plan at fork time and open their own audio files."""
    worker_plan = {k: plan[k] for k in WORKER_KEYS}
    stream = [u for shard in todo for u in shard["utts"]]
    if jobs <= 1:
        _init_worker(worker_plan)
        results = map(extract_one, stream)
        pool = None
    else:
        import multiprocessing
        ctx = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
        pool = ctx.Pool(jobs, initializer=_init_pool_worker, initargs=(worker_plan,))
        results = pool.imap(extract_one, stream, chunksize=4)
    try:
        for shard in todo:
            yield shard, [next(results) for _ in shard["utts"]]
    finally:
        if pool is not None:
            pool.terminate()


# ---------------------------------------------------------------- writing one shard

def write_one(plan, shard, results, elapsed):
    good = [(u, r) for u, r, _, _ in results if r is not None]
    bad = [(u, reason, detail) for u, r, reason, detail in results if r is None] + shard["problems"]
    spk_ids = sorted({plan["utts"][u]["spk"] for u, _ in good})
    spk_index = {s: i for i, s in enumerate(spk_ids)}
    attrs = plan["attrs"]
    dim, num_labels = attrs["feature_dim"], attrs["num_labels"]
    offsets = np.zeros(len(good) + 1, dtype=np.int64)
    np.cumsum([len(r["feats"]) for _, r in good], out=offsets[1:])
    feats = np.concatenate([r["feats"] for _, r in good]) if good else np.zeros((0, dim), np.float32)
    labels = None
    if attrs["frame_labels"]:
        labels = np.concatenate([r["labels"] for _, r in good]) if good else np.zeros(0, np.int32)
    utt_spk = np.array([spk_index[plan["utts"][u]["spk"]] for u, _ in good], dtype=np.int32)
    cmvn = np.zeros((len(spk_ids), 2, dim + 1), dtype=np.float64)  # Kaldi: [sums, count; sumsq, 0]
    for u, (a, b) in enumerate(zip(offsets[:-1], offsets[1:])):
        block = feats[a:b].astype(np.float64)
        cmvn[utt_spk[u], 0, :dim] += block.sum(axis=0)
        cmvn[utt_spk[u], 0, dim] += b - a
        cmvn[utt_spk[u], 1, :dim] += (block * block).sum(axis=0)
    counts = (np.bincount(labels, minlength=num_labels) if labels is not None
              else np.zeros(num_labels)).astype(np.int64)
    toks = {k: tokens.concatenate([r["tokens"][k] for _, r in good])
            for k in plan["tokens"]["kinds"]}
    text = [r["text"] for _, r in good] if attrs["has_text"] else None
    path = os.path.join(shard["dir"], archive.shard_name(shard["index"]))
    gender = plan["gender"]
    archive.write_shard(path, feats, labels, offsets, [u for u, _ in good], utt_spk, spk_ids,
                        cmvn, counts, attrs, tokens=toks, text=text,
                        spk_gender=[gender.get(s, "") for s in spk_ids] if gender else None)
    reasons = Counter(reason for _, reason, _ in bad)
    report = {"shard": shard["index"], "num_shards": shard["num_shards"],
              "utterances": len(results) + len(shard["problems"]), "ok": len(good),
              "skipped": dict(sorted(reasons.items())), "frames": int(len(feats)),
              "audio_s": float(sum(r["seconds"] for _, r in good))}
    archive.atomic_write_text(path[:-len(".h5")] + REPORT_SUFFIX, json.dumps(report, indent=1) + "\n")
    listed = Counter()
    for utt, reason, detail in bad:
        listed[reason] += 1
        if listed[reason] <= MAX_LISTED:
            print(f"prep: skipped {detail}", file=sys.stderr)
    for reason, n in sorted(listed.items()):
        if n > MAX_LISTED:
            print(f"prep: ... and {n - MAX_LISTED} more skipped for {reason}", file=sys.stderr)
    counted = "".join(f", {len(ids)} {k} tokens" for k, (ids, _) in toks.items())
    print(f"prep: wrote {path}: {len(good)} utterances, {len(spk_ids)} speakers, {len(feats)} frames"
          f"{counted}, {len(bad)} skipped ({elapsed:.1f} s)")
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
