"""`hpcsgd mkgraph`: a decoding graph estimated from a training archive's own utterances.

    hpcsgd mkgraph TRAIN_ARCHIVE GRAPH_DIR --kind phones|words|digits [--text TEXT]

  phones  a phone loop with a phone n-gram (default bigram) from the training alignments:
          for phone error rates (PER)
  words   CMUdict pronunciations (or --lexicon) and a word n-gram from the training
          utterances' transcripts (--text, Kaldi's `text` file): for word error rates (WER)
  digits  one word per utterance out of the training transcripts' words (FSDD's digits)

Only the archive's utterances are used: its frame labels give the phone sequences, each
phone's mean duration (its HMM's self-loop) and how often silence falls between words; the
transcripts of other utterances in TEXT (held-out speakers) are never read. A word without a
pronunciation is left out of the lexicon and counted (GRAPH_DIR/oov.txt); the n-grams that
contain it are dropped from G.

GRAPH_DIR gets HLG.fst (OpenFst), words.txt, phones.txt, lm.arpa (phones, words),
lexicon.txt (words, digits) and graph.json (what decode needs, and the figures printed
here); every file is written under a temporary name and renamed, graph.json last.
"""
import json
import os
import time

import numpy as np

from hpcsgd.data import archive
from hpcsgd.decode import graph, lexicon, lm
from hpcsgd.errors import UserError

KINDS = ("phones", "words", "digits")
SIL = "SIL"
SIL_PROB_RANGE = (0.05, 0.95)   # keep both choices possible however the training data fell

EXAMPLES = """examples:
  hpcsgd mkgraph runs/so762/archive/train runs/so762/graph_phones --kind phones
  hpcsgd mkgraph runs/so762/archive/train runs/so762/graph_words --kind words \\
      --text ../shared/data/so762_dev/text
  hpcsgd mkgraph runs/fsdd/archive/train runs/fsdd/graph --kind digits --text data_prep/demo/fsdd/text
Then: hpcsgd decode RUN_DIR --data ARCHIVE --graph GRAPH_DIR (docs/decode.md)."""


def add_arguments(parser):
    parser.add_argument("archive", help="the TRAINING archive (hpcsgd prep OUT/train)")
    parser.add_argument("graph_dir", help="directory to write the graph into")
    parser.add_argument("--kind", choices=KINDS, required=True,
                        help="phones: phone n-gram for PER; words: lexicon + word n-gram for "
                             "WER; digits: one word per utterance")
    parser.add_argument("--text", help="Kaldi `text` file with the training utterances' "
                                       "transcripts (words, digits)")
    parser.add_argument("--lexicon", help="Kaldi lexicon.txt (WORD PH1 PH2 ...) used before "
                                          "CMUdict")
    parser.add_argument("--lm", help="an ARPA n-gram of your own instead of the estimated one "
                                     "(phones, words)")
    parser.add_argument("--order", type=int, default=2, help="n-gram order (phones, words)")
    parser.add_argument("--states", type=int, default=3,
                        help="HMM states per phone: the minimum duration in frames")
    parser.add_argument("--self-loop-scale", type=float, default=0.1,
                        help="scale of the HMM transition log-probabilities (Kaldi's "
                             "--self-loop-scale for hybrid DNN models)")


def read_text(path):
    """Kaldi `text`: {utt: [words]}; a line with an id and no words gives an empty list."""
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such transcript file (Kaldi `text`: UTT WORD WORD ...)")
    text = {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if parts[0] in text:
                raise UserError(f"{path}:{lineno}: utterance {parts[0]} appears twice")
            text[parts[0]] = parts[1:]
    return text


def archive_alignments(archive_dir):
    """-> (label symbols, [(utt, label ids of its segments, segment lengths in frames)]) in
    archive order: the frame labels with runs of one label merged."""
    index = archive.read_index(archive_dir)
    symbols = archive.read_inventory(os.path.join(archive_dir, archive.LABELS_NAME))
    utts = []
    for shard in index["shards"]:
        path = os.path.join(index["dir"], shard["file"])
        meta = archive.read_shard_meta(path)
        with archive.open_shard(path) as f:
            labels = f["labels"][()]
        offsets = meta["utt_offsets"]
        for u, utt in enumerate(meta["utt_ids"]):
            ids, lengths = segments(labels[offsets[u]:offsets[u + 1]])
            utts.append((utt, ids, lengths))
    return symbols, utts


def segments(frame_labels):
    """Runs of equal labels: (label of each run, its length in frames)."""
    frame_labels = np.asarray(frame_labels)
    if len(frame_labels) == 0:
        return frame_labels[:0], frame_labels[:0]
    starts = np.flatnonzero(np.diff(frame_labels, prepend=frame_labels[0] - 1))
    lengths = np.diff(np.append(starts, len(frame_labels)))
    return frame_labels[starts], lengths


def phone_sequence(symbols, ids, keep_sil=True):
    return [symbols[i] for i in ids if keep_sil or symbols[i] != SIL]


def mean_durations(symbols, utts):
    """Mean segment length in frames per label (0 for a label never seen)."""
    total = np.zeros(len(symbols))
    count = np.zeros(len(symbols))
    for _, ids, lengths in utts:
        np.add.at(total, ids, lengths)
        np.add.at(count, ids, 1)
    return np.where(count > 0, total / np.maximum(count, 1), 0.0), total, count


def silence_probability(symbols, utts, text):
    """How often a silence falls between two words: silences strictly inside the utterances
    over the word boundaries of their transcripts."""
    sil = symbols.index(SIL) if SIL in symbols else None
    inside = boundaries = 0
    for utt, ids, _ in utts:
        words = text.get(utt)
        if not words or sil is None:
            continue
        runs = list(ids)
        while runs and runs[0] == sil:
            runs.pop(0)
        while runs and runs[-1] == sil:
            runs.pop()
        inside += sum(1 for i in runs if i == sil)
        boundaries += len(words) - 1
    lo, hi = SIL_PROB_RANGE
    return min(max(inside / boundaries, lo), hi) if boundaries else 0.5


def run(args):
    t0 = time.perf_counter()
    if args.kind != "phones" and not args.text:
        raise UserError(f"--kind {args.kind} needs --text (the Kaldi `text` file with the "
                        f"training utterances' transcripts)")
    if args.kind == "digits" and args.lm:
        raise UserError("--lm is for n-gram graphs (phones, words); digits is a fixed grammar")
    if args.states < 1 or args.order < 1:
        raise UserError("--states and --order must be >= 1")
    symbols, utts = archive_alignments(args.archive)
    if SIL not in symbols and args.kind != "phones":
        raise UserError(f"{args.archive}: the label inventory has no {SIL}, which the word "
                        f"graphs use between words")
    index = archive.read_index(args.archive)
    info = {"kind": args.kind, "archive": os.path.abspath(args.archive),
            "label_inventory_hash": index["label_inventory_hash"], "labels": symbols,
            "states": args.states, "self_loop_scale": args.self_loop_scale,
            "utterances": len(utts), "text": os.path.abspath(args.text) if args.text else None}
    os.makedirs(args.graph_dir, exist_ok=True)
    out = lambda name: os.path.join(args.graph_dir, name)   # noqa: E731

    # the sentences of G and the lexicon of L
    text = read_text(args.text) if args.text else {}
    if args.kind == "phones":
        sentences = [phone_sequence(symbols, ids) for _, ids, _ in utts]
        prons = {s: [(s,)] for s in symbols}
        lacking, sil_prob = [], None
    else:
        missing = [utt for utt, _, _ in utts if utt not in text]
        if missing:
            raise UserError(f"{args.text}: no transcript for {len(missing)} of the archive's "
                            f"{len(utts)} utterances (first: {missing[0]}); is it the text of "
                            f"the data directory {args.archive} was prepared from?")
        sentences = [text[utt] for utt, _, _ in utts if text[utt]]
        empty = len(utts) - len(sentences)
        if empty:
            print(f"mkgraph: {empty} training utterances with an empty transcript skipped")
        vocab = sorted({w for s in sentences for w in s})
        prons, lacking = lexicon.pronunciations(vocab, symbols, args.lexicon)
        if not prons:
            raise UserError(f"no word of {args.text} has a pronunciation (CMUdict"
                            f"{' or ' + args.lexicon if args.lexicon else ''})")
        sil_prob = silence_probability(symbols, utts, text)
        info["silence_probability"] = sil_prob
        tokens = sum(len(s) for s in sentences)
        lacking_set = set(lacking)
        info["oov_words"] = len(lacking)
        info["oov_tokens"] = sum(1 for s in sentences for w in s if w in lacking_set)
        info["oov_token_rate"] = info["oov_tokens"] / max(tokens, 1)
        archive.atomic_write_text(out("oov.txt"), "".join(f"{w}\n" for w in lacking))
        archive.atomic_write_text(out("lexicon.txt"), "".join(
            f"{w} {' '.join(p)}\n" for w in sorted(prons) for p in prons[w]))

    # G: symbols, then the n-gram or the word grammar
    entries, num_disambig = graph.disambiguate(prons)
    phone_table = [graph.EPS, *symbols] + [f"#{k}" for k in range(num_disambig + 1)]
    words = sorted(prons) if args.kind != "phones" else list(symbols)
    word_table = [graph.EPS, *words, "#0", lm.BOS, lm.EOS]
    phone_id = {s: i for i, s in enumerate(phone_table)}
    word_id = {s: i for i, s in enumerate(word_table)}
    archive.atomic_write_text(out("phones.txt"), archive.inventory_text(phone_table))
    archive.atomic_write_text(out("words.txt"), archive.inventory_text(word_table))
    if args.kind == "digits":
        G = graph.grammar_of_words([word_id[w] for w in words])
        info["grammar"] = f"one of {len(words)} words per utterance"
    else:
        if args.lm:
            model = lm.read_arpa(args.lm)
            with open(args.lm) as f:
                arpa = f.read()
            info["lm"] = os.path.abspath(args.lm)
        else:
            model = lm.estimate(sentences, args.order)
            arpa = lm.arpa_text(model)
            info["lm"] = f"interpolated Kneser-Ney, order {args.order}, from the archive"
        archive.atomic_write_text(out("lm.arpa"), arpa)
        info["lm_order"] = model["order"]
        info["lm_ngrams"] = {n: len(g) for n, g in model["ngrams"].items()}
        info["train_perplexity"], _ = lm.perplexity(model, sentences)
        G = graph.grammar_from_arpa(out("lm.arpa"), out("words.txt"))

    # L, H, and their composition
    L = graph.make_lexicon_fst(entries, phone_id, word_id, sil_prob, SIL,
                               backoff=(phone_id["#0"], word_id["#0"]))
    mean, _, count = mean_durations(symbols, utts)
    loops = graph.loop_probabilities(mean, args.states)
    short = sum(int((lengths < args.states).sum()) for _, _, lengths in utts)
    H = graph.make_hmm_fst(len(symbols), args.states, loops, args.self_loop_scale,
                           [phone_id[f"#{k}"] for k in range(num_disambig + 1)])
    HLG = graph.compose_hlg(H, L, G)
    graph.write_fst(HLG, out("HLG.fst"))
    states, arcs = graph.fst_size(HLG)
    info.update(hlg_states=states, hlg_arcs=arcs, disambiguation_symbols=num_disambig + 1,
                mean_phone_frames={s: round(float(m), 3) for s, m in zip(symbols, mean)},
                loop_probabilities={s: round(float(a), 6) for s, a in zip(symbols, loops)},
                segments_shorter_than_states=short, segments=int(count.sum()),
                words=len(words), seconds=round(time.perf_counter() - t0, 2))
    archive.atomic_write_text(out("graph.json"), json.dumps(info, indent=1) + "\n")

    print(f"mkgraph: {args.kind} graph from {len(utts)} training utterances of {args.archive}")
    if args.kind != "phones":
        print(f"mkgraph: {len(words)} words with a pronunciation, {len(lacking)} without "
              f"({info['oov_tokens']} of the transcripts' tokens, "
              f"{100 * info['oov_token_rate']:.2f}%: {out('oov.txt')}); silence between "
              f"words {100 * sil_prob:.1f}% of the time")
    if args.kind != "digits":
        print(f"mkgraph: LM {info['lm']}: {info['lm_ngrams']} n-grams, training perplexity "
              f"{info['train_perplexity']:.2f}")
    print(f"mkgraph: {args.states} states per phone (minimum duration); "
          f"{short} of {int(count.sum())} training segments are shorter")
    print(f"mkgraph: HLG {states} states, {arcs} arcs -> {out('HLG.fst')} "
          f"({info['seconds']:.1f} s)")
    return 0

