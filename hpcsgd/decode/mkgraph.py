"""`hpcsgd mkgraph`: a decoding graph estimated from a training archive's own utterances.

    hpcsgd mkgraph TRAIN_ARCHIVE GRAPH_DIR --kind phones|words|digits [--text TEXT]
    hpcsgd mkgraph TRAIN_ARCHIVE GRAPH_DIR --kind phones|words|digits --topology ctc \\
        --tokens phones|chars|bpe

  phones  a phone loop with a phone n-gram (default bigram) from the training alignments
          (CTC: the training phone token sequences): for phone error rates (PER)
  words   pronunciations and a word n-gram from the training utterances' transcripts (the
          archive's own, or --text, Kaldi's `text` file): for word error rates (WER). The
          pronunciations: CMUdict (or --lexicon) in phones; for CTC chars tokens each word's
          letters, for bpe tokens the sentencepiece pieces of the archive's bpe.model
  digits  one word per utterance out of the training transcripts' words (FSDD's digits)

Topologies: hmm (HLG, for the hybrid frame classifiers: each phone 3 HMM states) and ctc (TLG,
for CTC models: the CTC topology over the archive's token inventory; hpcsgd/decode/graph.py).

Only the archive's utterances are used: its frame labels give the phone sequences, each
phone's mean duration (its HMM's self-loop) and how often silence falls between words; the
transcripts of other utterances in TEXT (held-out speakers) are never read. A word without a
pronunciation is left out of the lexicon and counted (GRAPH_DIR/oov.txt); the n-grams that
contain it are dropped from G.

GRAPH_DIR gets HLG.fst or TLG.fst (OpenFst), words.txt, phones.txt or tokens.txt, lm.arpa
(phones, words), lexicon.txt (words, digits) and graph.json (what decode needs, and the
figures printed here); every file is written under a temporary name and renamed, graph.json
last.
"""
import json
import os
import time

import numpy as np

from hpcsgd.data import archive
from hpcsgd.decode import ctc, graph, lexicon, lm
from hpcsgd.errors import UserError

KINDS = ("phones", "words", "digits")
TOPOLOGIES = ("hmm", "ctc")
SIL = "SIL"
SIL_PROB_RANGE = (0.05, 0.95)   # keep both choices possible however the training data fell
# chars CTC: a <space> after a word (and before the first) or none equally likely, as EESEN's
# char lexicons have it: the frames decide. Not estimated: the training tokens always have one
# between words and none at the ends, and L cannot tell the ends from the middle, so 0.95
# would make an utterance's start and end without a <space> cost 3 nats more than with one (a
# bonus for hearing its first or last word as a <space>)
SPACE_PROB = 0.5

EXAMPLES = """examples:
  hpcsgd mkgraph runs/so762/archive/train runs/so762/graph_phones --kind phones
  hpcsgd mkgraph runs/so762/archive/train runs/so762/graph_words --kind words \\
      --text ../shared/data/so762_dev/text
  hpcsgd mkgraph runs/fsdd/archive/train runs/fsdd/graph --kind digits --text data_prep/demo/fsdd/text
  hpcsgd mkgraph runs/so762/archive/train runs/so762/tlg_chars --kind words --topology ctc \\
      --tokens chars
Then: hpcsgd decode RUN_DIR --data ARCHIVE --graph GRAPH_DIR (docs/decode.md)."""


def add_arguments(parser):
    parser.add_argument("archive", help="the TRAINING archive (hpcsgd prep OUT/train)")
    parser.add_argument("graph_dir", help="directory to write the graph into")
    parser.add_argument("--kind", choices=KINDS, required=True,
                        help="phones: phone n-gram for PER; words: lexicon + word n-gram for "
                             "WER; digits: one word per utterance")
    parser.add_argument("--topology", choices=TOPOLOGIES, default="hmm",
                        help="hmm: HLG for hybrid models; ctc: TLG for CTC models (--tokens)")
    parser.add_argument("--tokens", choices=archive.TOKEN_KINDS,
                        help="ctc: the token inventory of the archive the model outputs")
    parser.add_argument("--text", help="Kaldi `text` file with the training utterances' "
                                       "transcripts (words, digits; default: the archive's own)")
    parser.add_argument("--lexicon", help="Kaldi lexicon.txt (WORD PH1 PH2 ...) used before "
                                          "CMUdict")
    parser.add_argument("--lm", help="an ARPA n-gram of your own instead of the estimated one "
                                     "(phones, words)")
    parser.add_argument("--order", type=int, default=2, help="n-gram order (phones, words)")
    parser.add_argument("--states", type=int, default=3,
                        help="hmm: HMM states per phone: the minimum duration in frames")
    parser.add_argument("--self-loop-scale", type=float, default=0.1,
                        help="hmm: scale of the HMM transition log-probabilities (Kaldi's "
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


def archive_tokens(archive_dir, kind):
    """-> (token symbols in id order, the blank first; [(utt, token ids)] in archive order)."""
    index = archive.read_index(archive_dir)
    symbols = archive.read_tokens(archive_dir, kind, index)
    utts = []
    for shard in index["shards"]:
        path = os.path.join(index["dir"], shard["file"])
        meta = archive.read_shard_meta(path)
        ids, offsets = archive.read_shard_tokens(path, kind)
        utts += [(utt, ids[offsets[u]:offsets[u + 1]]) for u, utt in enumerate(meta["utt_ids"])]
    return symbols, utts


def archive_text(archive_dir):
    """{utt: [words]} of the archive's own transcripts, or None when it has none."""
    index = archive.read_index(archive_dir)
    if not index["has_text"]:
        return None
    text = {}
    for shard in index["shards"]:
        path = os.path.join(index["dir"], shard["file"])
        utt_ids = archive.read_shard_meta(path)["utt_ids"]
        text.update(zip(utt_ids, (t.split() for t in archive.read_shard_text(path))))
    return text


# segments and phone_sequence also make prep's phone tokens (data_prep/tokens.py), so that CTC
# targets are the decoder's references: this module must stay importable without kaldifst
# (graph.py imports it inside its functions).

def segments(frame_labels):
    """Runs of equal labels: (label of each run, its length in frames)."""
    frame_labels = np.asarray(frame_labels)
    if len(frame_labels) == 0:
        return frame_labels[:0], frame_labels[:0]
    starts = np.flatnonzero(np.diff(frame_labels, prepend=frame_labels[0] - 1))
    lengths = np.diff(np.append(starts, len(frame_labels)))
    return frame_labels[starts], lengths


def phone_sequence(symbols, ids, keep_sil=True):
    """The symbols of label ids (runs from segments), SIL dropped unless keep_sil."""
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


def spellings(words, symbols):
    """Chars tokens: each word is its letters. -> ({word: [letters]}, sorted words with a
    letter outside the inventory)."""
    known = set(symbols[1:]) - {ctc.SPACE}
    found = {w: [tuple(w)] for w in words if all(c in known for c in w)}
    return found, sorted(set(words) - set(found))


def bpe_pieces(words, symbols, archive_dir):
    """Bpe tokens: each word is the pieces the archive's sentencepiece model gives it alone
    (sentencepiece splits at whitespace before merging, so they are its pieces in any
    sentence, the first one starting with ▁). -> ({word: [pieces]}, sorted words it cannot
    encode without <unk>)."""
    path = os.path.join(archive_dir, archive.BPE_MODEL)
    try:
        import sentencepiece
    except ImportError:
        raise UserError("--tokens bpe needs the `sentencepiece` package "
                        "(pip install sentencepiece)") from None
    if not os.path.isfile(path):
        raise UserError(f"{path}: missing (the bpe model of {archive_dir}; prep with --tokens "
                        f"bpe writes it)")
    sp = sentencepiece.SentencePieceProcessor(model_file=path)
    if [archive.BLANK] + [sp.id_to_piece(i) for i in range(sp.get_piece_size())] != symbols:
        raise UserError(f"{path}: its pieces differ from "
                        f"{os.path.join(archive_dir, archive.token_inventory_name('bpe'))}")
    found, lacking = {}, []
    for word in words:
        ids = sp.encode(word)
        if ids and sp.unk_id() not in ids:
            found[word] = [tuple(symbols[i + 1] for i in ids)]    # token id = piece id + 1
        else:
            lacking.append(word)
    return found, sorted(lacking)


def training_text(args, utt_ids):
    """{utt: words} for the archive's utterances, and where they came from: --text, else the
    archive's own transcripts."""
    if not args.text:
        return archive_text(args.archive), f"{os.path.abspath(args.archive)} (its transcripts)"
    text = read_text(args.text)
    missing = [utt for utt in utt_ids if utt not in text]
    if missing:
        raise UserError(f"{args.text}: no transcript for {len(missing)} of the archive's "
                        f"{len(utt_ids)} utterances (first: {missing[0]}); is it the text of "
                        f"the data directory {args.archive} was prepared from?")
    return text, os.path.abspath(args.text)


def check_options(args, index):
    if args.topology == "ctc" and not args.tokens:
        raise UserError("--topology ctc needs --tokens phones|chars|bpe (the token inventory "
                        "the CTC model outputs)")
    if args.tokens and args.topology != "ctc":
        raise UserError("--tokens is for --topology ctc (an hmm graph reads the archive's "
                        "frame labels)")
    if args.topology == "ctc" and args.kind == "phones" and args.tokens != "phones":
        raise UserError(f"--kind phones needs --tokens phones (its words are the phone tokens; "
                        f"{args.tokens} tokens spell words: --kind words)")
    if args.topology == "ctc" and args.lexicon and args.tokens != "phones":
        raise UserError(f"--lexicon gives phone pronunciations, for --tokens phones; "
                        f"{args.tokens} tokens spell the words themselves")
    if args.kind != "phones" and not args.text and not index["has_text"]:
        raise UserError(f"--kind {args.kind} needs --text (the Kaldi `text` file with the "
                        f"training utterances' transcripts): {args.archive} has no "
                        f"transcripts of its own")
    if args.kind == "digits" and args.lm:
        raise UserError("--lm is for n-gram graphs (phones, words); digits is a fixed grammar")
    if args.states < 1 or args.order < 1:
        raise UserError("--states and --order must be >= 1")


def run(args):
    t0 = time.perf_counter()
    index = archive.read_index(args.archive)
    check_options(args, index)
    is_ctc = args.topology == "ctc"
    if is_ctc:      # utts: (utt, token ids); symbols[0] is the blank
        symbols, utts = archive_tokens(args.archive, args.tokens)
        units = symbols[1:]
    else:           # utts: (utt, label per segment, segment lengths)
        symbols, utts = archive_alignments(args.archive)
        units = symbols
        if SIL not in symbols and args.kind != "phones":
            raise UserError(f"{args.archive}: the label inventory has no {SIL}, which the word "
                            f"graphs use between words")
    utt_ids = [u[0] for u in utts]
    info = {"kind": args.kind, "topology": args.topology,
            "archive": os.path.abspath(args.archive), "utterances": len(utts),
            "text": os.path.abspath(args.text) if args.text else None}
    if is_ctc:
        info["tokens"] = {"kind": args.tokens, "symbols": symbols,
                          "inventory_hash": index["tokens"][args.tokens]["inventory_hash"]}
    else:
        info.update(label_inventory_hash=index["label_inventory_hash"], labels=symbols,
                    states=args.states, self_loop_scale=args.self_loop_scale)
    os.makedirs(args.graph_dir, exist_ok=True)
    out = lambda name: os.path.join(args.graph_dir, name)   # noqa: E731

    # the sentences of G and the lexicon of L (in phones or tokens)
    sil_prob, sil_symbol = None, SIL
    if args.kind == "phones":
        sentences = [[symbols[i] for i in ids] for _, ids in utts] if is_ctc else \
            [phone_sequence(symbols, ids) for _, ids, _ in utts]
        prons = {s: [(s,)] for s in units}
        lacking = []
    else:
        text, info["transcripts"] = training_text(args, utt_ids)
        sentences = [text[utt] for utt in utt_ids if text[utt]]
        empty = len(utts) - len(sentences)
        if empty:
            print(f"mkgraph: {empty} training utterances with an empty transcript skipped")
        vocab = sorted({w for s in sentences for w in s})
        if is_ctc and args.tokens == "chars":
            prons, lacking = spellings(vocab, symbols)
            if ctc.SPACE in symbols:
                sil_prob, sil_symbol = SPACE_PROB, ctc.SPACE
                info["space_probability"] = sil_prob
        elif is_ctc and args.tokens == "bpe":
            prons, lacking = bpe_pieces(vocab, symbols, args.archive)
        else:
            prons, lacking = lexicon.pronunciations(vocab, units, args.lexicon)
            if not is_ctc:    # a phone CTC model has no silence token: words follow words
                sil_prob = info["silence_probability"] = silence_probability(symbols, utts, text)
        if not prons:
            how = {"chars": "a spelling in the chars inventory (letter case?)",
                   "bpe": "bpe pieces without <unk>"}.get(args.tokens, "a pronunciation "
                                                           "(CMUdict" + (" or " + args.lexicon
                                                           if args.lexicon else "") + ")")
            raise UserError(f"no word of the transcripts ({info['transcripts']}) has {how}")
        tokens = sum(len(s) for s in sentences)
        lacking_set = set(lacking)
        info["oov_words"] = len(lacking)
        info["oov_tokens"] = sum(1 for s in sentences for w in s if w in lacking_set)
        info["oov_token_rate"] = info["oov_tokens"] / max(tokens, 1)
        archive.atomic_write_text(out("oov.txt"), "".join(f"{w}\n" for w in lacking))
        archive.atomic_write_text(out("lexicon.txt"), "".join(
            f"{w} {' '.join(p)}\n" for w in sorted(prons) for p in prons[w]))

    # G: symbols, then the n-gram or the word grammar. L's input table: the phones, or the
    # tokens at their archive ids (<eps> in the blank's place: L never reads a blank)
    entries, num_disambig = graph.disambiguate(prons)
    disambig = [f"#{k}" for k in range(num_disambig + 1)]
    phone_table = [graph.EPS, *units, *disambig]
    words = sorted(prons) if args.kind != "phones" else list(units)
    word_table = [graph.EPS, *words, "#0", lm.BOS, lm.EOS]
    phone_id = {s: i for i, s in enumerate(phone_table)}
    word_id = {s: i for i, s in enumerate(word_table)}
    archive.atomic_write_text(out("tokens.txt" if is_ctc else "phones.txt"),
                              archive.inventory_text(phone_table))
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

    # L, H or T, and their composition
    L = graph.make_lexicon_fst(entries, phone_id, word_id, sil_prob, sil_symbol,
                               backoff=(phone_id["#0"], word_id["#0"]))
    disambig_ids = [phone_id[d] for d in disambig]
    if is_ctc:
        T = graph.make_ctc_topo_fst(len(symbols), disambig_ids)
        name = "TLG"
        fst = graph.compose_hlg(T, L, G)
    else:
        mean, _, count = mean_durations(symbols, utts)
        loops = graph.loop_probabilities(mean, args.states)
        short = sum(int((lengths < args.states).sum()) for _, _, lengths in utts)
        H = graph.make_hmm_fst(len(symbols), args.states, loops, args.self_loop_scale,
                               disambig_ids)
        name = "HLG"
        fst = graph.compose_hlg(H, L, G)
        info.update(mean_phone_frames={s: round(float(m), 3) for s, m in zip(symbols, mean)},
                    loop_probabilities={s: round(float(a), 6) for s, a in zip(symbols, loops)},
                    segments_shorter_than_states=short, segments=int(count.sum()))
    graph.write_fst(fst, out(f"{name}.fst"))
    states, arcs = graph.fst_size(fst)
    info.update({f"{name.lower()}_states": states, f"{name.lower()}_arcs": arcs,
                 "disambiguation_symbols": num_disambig + 1, "words": len(words),
                 "seconds": round(time.perf_counter() - t0, 2)})
    archive.atomic_write_text(out("graph.json"), json.dumps(info, indent=1) + "\n")

    units_of = f"{args.tokens} tokens" if is_ctc else "alignments"
    print(f"mkgraph: {args.kind} graph ({args.topology}) from the {units_of} of {len(utts)} "
          f"training utterances of {args.archive}")
    if args.kind != "phones":
        between = ""
        if sil_prob is not None:
            between = (f"; {'<space>' if is_ctc else 'silence'} between words "
                       f"{100 * sil_prob:.1f}% of the time")
        print(f"mkgraph: {len(words)} words with a pronunciation, {len(lacking)} without "
              f"({info['oov_tokens']} of the transcripts' tokens, "
              f"{100 * info['oov_token_rate']:.2f}%: {out('oov.txt')}){between}")
    if args.kind != "digits":
        print(f"mkgraph: LM {info['lm']}: {info['lm_ngrams']} n-grams, training perplexity "
              f"{info['train_perplexity']:.2f}")
    if is_ctc:
        print(f"mkgraph: CTC topology over {len(symbols)} tokens (the blank included), "
              f"{num_disambig + 1} disambiguation symbols")
    else:
        print(f"mkgraph: {args.states} states per phone (minimum duration); "
              f"{short} of {int(count.sum())} training segments are shorter")
    print(f"mkgraph: {name} {states} states, {arcs} arcs -> {out(name + '.fst')} "
          f"({info['seconds']:.1f} s)")
    return 0
