"""CTC recognition: greedy search, the CTC topology T, TLG graphs over phones, chars and bpe
tokens from a tiny synthetic token archive, the graph/model checks, references from the
archive, and `hpcsgd decode --greedy|--graph` on a stand-in CTC model's posteriors."""
import argparse
import io
import itertools
import json
import os

import numpy as np
import pytest

from hpcsgd import cli
from hpcsgd.data import archive
from hpcsgd.decode import ctc, graph as graphs, recognize, score, search
from hpcsgd.errors import UserError

BLK, SPACE = archive.BLANK, ctc.SPACE
TRAIN = {"u1": "AB C", "u2": "BA", "u3": "SEE AB", "u4": "A BA", "u5": "C SEE", "u6": "AB"}
# phone tokens: C and SEE are homophones (each gets its own #k in L), A a prefix of AB
PRONS = {"AB": "AE B", "BA": "B AA", "C": "S IY", "SEE": "S IY", "A": "AE"}
PHONES = [BLK, "AA", "AE", "B", "IY", "S"]
CHARS = [BLK, SPACE, "A", "B", "C", "E", "S"]
LABELS = ["SIL", "AA", "AE", "B", "IY", "S"]      # frame labels for the hybrid graph


def phone_tokens(text):
    return [p for w in text.split() for p in PRONS[w].split()]


def char_tokens(text):
    return [SPACE if c == " " else c for c in text]


def train_bpe(texts):
    spm = pytest.importorskip("sentencepiece")
    model = io.BytesIO()     # the options of data_prep/tokens.py's train_bpe
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts), model_writer=model, model_type="bpe", vocab_size=12,
        character_coverage=1.0, normalization_rule_name="identity", num_threads=1,
        shuffle_input_sentence=False, input_sentence_size=0, bos_id=-1, eos_id=-1,
        minloglevel=2)
    return model.getvalue()


def write_token_archive(out, utts=TRAIN, kinds=("phones", "chars"), labels=False, bpe=None,
                        text=True, dim=4, seed=0):
    """One shard: each utterance's transcript, its phone/chars (and bpe) tokens and, with
    labels, frame labels that spell its phones with SIL around and between the words."""
    rng = np.random.default_rng(seed)
    inventories = {"phones": PHONES, "chars": CHARS}
    inventories = {k: inventories[k] for k in kinds}
    sp = None
    if bpe is not None:
        import sentencepiece
        sp = sentencepiece.SentencePieceProcessor(model_proto=bpe)
        inventories["bpe"] = [BLK] + [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    per_kind = {k: [] for k in inventories}
    frame_labels, offsets = [], [0]
    for utt, words in utts.items():
        for kind, symbols in inventories.items():
            if kind == "bpe":
                ids = [i + 1 for i in sp.encode(words)]
            else:
                toks = phone_tokens(words) if kind == "phones" else char_tokens(words)
                ids = [symbols.index(t) for t in toks]
            per_kind[kind].append(ids)
        runs = ["SIL"] + [p for w in words.split() for p in PRONS[w].split() + ["SIL"]]
        frame_labels.append(np.repeat([LABELS.index(p) for p in runs], 4))
        offsets.append(offsets[-1] + len(frame_labels[-1]))
    frame_labels = np.concatenate(frame_labels).astype(np.int32)
    feats = rng.normal(size=(len(frame_labels), dim)).astype(np.float32)
    stats = np.zeros((1, 2, dim + 1))
    stats[0, 0, :dim], stats[0, 0, dim] = feats.sum(0), len(feats)
    stats[0, 1, :dim] = (feats.astype(np.float64) ** 2).sum(0)
    label_symbols = LABELS if labels else []
    attrs = dict(format_version=archive.FORMAT_VERSION, feature_type="fbank", feature_dim=dim,
                 num_labels=len(label_symbols),
                 label_inventory_hash=archive.inventory_hash(label_symbols), sample_rate=16000,
                 frame_shift_ms=10.0, frame_length_ms=25.0, extractor_config="{}",
                 frame_labels=labels, has_text=text, tokens=archive.token_attrs(inventories))
    tokens = {}
    for kind, seqs in per_kind.items():
        ids = np.array([i for s in seqs for i in s], np.int32)
        tokens[kind] = (ids, np.concatenate([[0], np.cumsum([len(s) for s in seqs])]))
    os.makedirs(out, exist_ok=True)
    archive.write_shard(os.path.join(out, archive.shard_name(0)), feats,
                        frame_labels if labels else None, offsets, list(utts),
                        np.zeros(len(utts), np.int32), ["spk"], stats,
                        np.bincount(frame_labels, minlength=len(LABELS)) if labels else
                        np.zeros(0, np.int64), attrs, tokens=tokens,
                        text=list(utts.values()) if text else None)
    for kind, symbols in inventories.items():
        archive.atomic_write_text(os.path.join(out, archive.token_inventory_name(kind)),
                                  archive.inventory_text(symbols))
    if bpe is not None:
        with open(os.path.join(out, archive.BPE_MODEL), "wb") as f:
            f.write(bpe)
    if labels:
        archive.atomic_write_text(os.path.join(out, archive.LABELS_NAME),
                                  archive.inventory_text(LABELS))
    archive.write_index(out)
    return out


def posteriors(symbols, frames, peak=0.9, second=None):
    """A (T', V) log-posterior matrix whose frames spell `frames` (one symbol per frame, BLK
    the blank): `peak` on the frame's symbol, the rest spread evenly; second = {frame: (symbol,
    probability)} puts some of the rest on another symbol."""
    V = len(symbols)
    probs = np.full((len(frames), V), (1 - peak) / (V - 1))
    probs[np.arange(len(frames)), [symbols.index(s) for s in frames]] = peak
    for t, (s, p) in (second or {}).items():
        probs[t] = (1 - peak - p) / (V - 2)
        probs[t, symbols.index(frames[t])] = peak
        probs[t, symbols.index(s)] = p
    return np.log(probs).astype(np.float32)


def spell(tokens, blanks=1, repeat=2):
    """Frames of a CTC path: each token `repeat` frames, `blanks` blank frames after it (and
    one before the first)."""
    return [BLK] + [f for t in tokens for f in [t] * repeat + [BLK] * blanks]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The token archive (with frame labels and bpe when sentencepiece is there) and its
    graphs: phone TLG, chars word TLG, phone-token word TLG."""
    root = tmp_path_factory.mktemp("ctc")
    try:
        bpe = train_bpe(list(TRAIN.values()))
    except pytest.skip.Exception:
        bpe = None
    arch = write_token_archive(str(root / "archive"), labels=True, bpe=bpe)
    lex = str(root / "lexicon.txt")
    with open(lex, "w") as f:
        f.writelines(f"{w} {p}\n" for w, p in PRONS.items())
    made = {"archive": arch, "root": root, "lexicon": lex, "bpe": bpe}
    for name, extra in (("phones", ["--kind", "phones", "--tokens", "phones"]),
                        ("chars", ["--kind", "words", "--tokens", "chars"]),
                        ("phone_words", ["--kind", "words", "--tokens", "phones",
                                         "--lexicon", lex])):
        made[name] = str(root / name)
        assert cli.main(["mkgraph", arch, made[name], "--topology", "ctc", *extra]) == 0
    return made


def tlg_decode(graph_dir, logpost, scale=1.0):
    graph = search.Graph(graph_dir)
    words, final, frames = search.Decoder(graph).decode(search.ctc_scores(logpost, scale))
    return [graph.words[w] for w in words], final, frames


# --- greedy search ----------------------------------------------------------------------------

def test_greedy_merges_repeats_keeps_what_a_blank_separates_and_drops_blanks():
    symbols = [BLK, "a", "b"]
    cases = {("a", "a", BLK, "a", "b", "b", BLK): ["a", "a", "b"],
             ("a", "a", "a"): ["a"],
             (BLK, "a", "b", "a", BLK): ["a", "b", "a"],
             (BLK, BLK, BLK): [],
             (BLK,): []}
    for frames, want in cases.items():
        ids = ctc.greedy_search(posteriors(symbols, list(frames)))
        assert [symbols[i] for i in ids] == want, frames
    assert ctc.greedy_search(np.zeros((0, 3), np.float32)).tolist() == []
    # the vectorised merge against a frame-by-frame loop on random matrices
    rng = np.random.default_rng(0)
    for _ in range(20):
        logpost = rng.normal(size=(int(rng.integers(1, 30)), 4)).astype(np.float32)
        logpost[rng.random(len(logpost)) < 0.3, 0] = 9.0     # blanks, and ties broken alike
        out, prev = [], None
        for k in logpost.argmax(axis=1):
            if k != prev and k != 0:
                out.append(int(k))
            prev = k
        assert ctc.greedy_search(logpost).tolist() == out


def test_tokens_become_words_per_inventory_kind():
    assert ctc.tokens_to_words(["H", "I", SPACE, "Y", "O", "U"], "chars") == ["HI", "YOU"]
    assert ctc.tokens_to_words([SPACE, "H", "I", SPACE, SPACE], "chars") == ["HI"]
    assert ctc.tokens_to_words(["\u2581HI", "\u2581Y", "OU"], "bpe") == ["HI", "YOU"]
    assert ctc.tokens_to_words(["AE", "B"], "phones") == ["AE", "B"]
    assert ctc.tokens_to_words([], "chars") == []


# --- the CTC topology -------------------------------------------------------------------------

def collapse(frames):
    return [k for k, _ in itertools.groupby(frames) if k != 0]


def test_the_ctc_topology_reads_exactly_the_ctc_alignments():
    import kaldifst as kf
    V, disambig = 3, [10, 11]
    T = graphs.make_ctc_topo_fst(V, disambig)
    assert T.start == 0 and T.num_states == V
    for s in kf.StateIterator(T):
        arcs = [(a.ilabel, a.olabel, a.nextstate) for a in kf.ArcIterator(T, s)]
        assert float(T.final(s).value) == 0.0                    # every state final
        # one arc per input label (token + 1): T is deterministic on the frames ...
        assert sorted(i for i, _, _ in arcs if i) == list(range(1, V + 1))
        # ... and writes the disambiguation symbols on loops that read nothing
        assert sorted((i, o, n) for i, o, n in arcs if not i) == [(0, d, s) for d in disambig]
    # every frame sequence of up to 5 frames is read, and writes its CTC collapse
    for n in range(1, 6):
        for frames in itertools.product(range(V), repeat=n):
            X = kf.make_linear_acceptor([k + 1 for k in frames])
            path = kf.shortest_path(kf.compose(X, T))
            ok, _, out, _ = kf.get_linear_symbol_sequence(path)
            assert ok and [o for o in out if o not in disambig] == collapse(frames), frames
    # so the frame sequences of 4 frames T o Y accepts for Y = "a a" (tokens 1 1) are exactly
    # those that collapse to it: a blank between the two
    Y = kf.make_linear_acceptor([1, 1])
    kf.arcsort(T, sort_type="olabel")
    TY = kf.compose(T, Y)
    accepted = set()
    for frames in itertools.product(range(V), repeat=4):
        X = kf.make_linear_acceptor([k + 1 for k in frames])
        if kf.compose(X, TY).num_states:
            accepted.add(frames)
    want = {f for f in itertools.product(range(V), repeat=4) if collapse(f) == [1, 1]}
    assert accepted == want and (1, 0, 0, 1) in want and (1, 1, 1, 1) not in want


# --- TLG --------------------------------------------------------------------------------------

def test_a_spelled_word_sequence_is_recognized_through_the_chars_tlg(tiny):
    info = json.load(open(os.path.join(tiny["chars"], "graph.json")))
    assert info["topology"] == "ctc" and info["tokens"]["symbols"] == CHARS
    assert info["tokens"]["inventory_hash"] == archive.inventory_hash(CHARS)
    assert info["space_probability"] == 0.5
    assert "SEE S E E" in open(os.path.join(tiny["chars"], "lexicon.txt")).read()
    for words in ("AB C", "SEE AB", "A BA", "C SEE AB"):
        frames = spell([t for t in char_tokens(words)])
        tokens, final, aligned = tlg_decode(tiny["chars"], posteriors(CHARS, frames))
        assert final and tokens == words.split(), words
        assert [CHARS[k] for k in aligned] == frames       # TLG's path is the frames' argmax
    # SEE's two Es need a blank between them: three frames of E with none spell SE, no word;
    # the graph takes the middle E frame's second choice, a blank
    frames = [BLK, "S", "E", "E", "E", BLK, SPACE, "A", "B"]
    logpost = posteriors(CHARS, frames, second={3: (BLK, 0.09)})
    assert [CHARS[i] for i in ctc.greedy_search(logpost)] == ["S", "E", SPACE, "A", "B"]
    tokens, final, aligned = tlg_decode(tiny["chars"], logpost)
    assert final and tokens == ["SEE", "AB"] and CHARS[aligned[3]] == BLK
    # a missed <space>: AB and C run together still make two words (ABC is not one)
    tokens, _, _ = tlg_decode(tiny["chars"], posteriors(CHARS, spell(list("ABC"))))
    assert tokens == ["AB", "C"]


def test_the_phone_tlg_best_path_is_the_greedy_path_on_peaked_posteriors(tiny):
    rng = np.random.default_rng(1)
    graph = search.Graph(tiny["phones"])
    assert graph.words[1:-3] == PHONES[1:]         # the phone tokens are the "words"
    decoder = search.Decoder(graph)
    for _ in range(10):
        frames = [PHONES[k] for k in rng.integers(0, len(PHONES), int(rng.integers(1, 25)))]
        logpost = posteriors(PHONES, frames, peak=1 - 1e-5)    # 14 nats a frame over the rest
        greedy = [PHONES[i] for i in ctc.greedy_search(logpost)]
        words, final, aligned = decoder.decode(search.ctc_scores(logpost, 1.0))
        assert final and [graph.words[w] for w in words] == greedy, frames
        np.testing.assert_array_equal(aligned, logpost.argmax(axis=1))


def test_the_insertion_penalty_is_added_to_the_arcs_that_output_a_token(tiny):
    import kaldifst as kf
    fst = search.Graph(tiny["phones"]).fst
    moved = graphs.with_insertion_penalty(fst, -1.5)
    assert moved.num_states == fst.num_states and moved.start == fst.start
    outputs = 0
    for s in range(fst.num_states):
        assert moved.final(s).value == fst.final(s).value
        theirs = {(a.ilabel, a.olabel, a.nextstate): a.weight.value for a in kf.ArcIterator(fst, s)}
        mine = {(a.ilabel, a.olabel, a.nextstate): a.weight.value
                for a in kf.ArcIterator(moved, s)}
        assert mine.keys() == theirs.keys()
        for key, cost in theirs.items():   # float32 costs: the sum rounded once
            want = np.float32(cost) + np.float32(-1.5 if key[1] else 0.0)
            assert mine[key] == pytest.approx(float(want), abs=1e-6)
            outputs += key[1] != 0
    assert outputs > 0


def test_a_bonus_keeps_weak_tokens_and_a_penalty_drops_them(tiny):
    """Phones heard weakly (each token frame 0.3, the blank 0.5): the more a token costs, the
    fewer the search outputs; Kaldi's word insertion penalty on a phone graph."""
    graph = search.Graph(tiny["phones"])
    frames = spell(phone_tokens("SEE AB C"), repeat=1)
    probs = np.full((len(frames), len(PHONES)), 0.2 / (len(PHONES) - 2))
    for t, f in enumerate(frames):
        if f == BLK:
            probs[t] = 0.9 * (np.arange(len(PHONES)) == 0) + 0.1 / len(PHONES)
        else:
            probs[t, 0], probs[t, PHONES.index(f)] = 0.5, 0.3
    scores = search.ctc_scores(np.log(probs).astype(np.float32), 1.0)
    decoder = search.Decoder(graph)
    counts = []
    for penalty in (-6.0, -3.0, 0.0, 3.0, 6.0):
        d = decoder.with_penalty(penalty)
        assert d.insertion_penalty == penalty and (d is decoder) == (penalty == 0.0)
        words, _, _ = d.decode(scores)
        counts.append(len(words))
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1], counts
    assert counts[0] >= len(phone_tokens("SEE AB C"))


def test_tuning_holds_out_each_half_of_the_speakers(tiny):
    """tune's held-out figure: each fold scored at the point the other fold chose."""
    graph = search.Graph(tiny["phones"])
    decoder = search.Decoder(graph)
    rng = np.random.default_rng(3)
    logposts, refs = [], {}
    for utt, words in TRAIN.items():
        frames = spell(phone_tokens(words))
        second = {t: (PHONES[int(rng.integers(1, len(PHONES)))], 0.3)
                  for t in range(len(frames)) if rng.random() < 0.4 and frames[t] != BLK}
        second = {t: v for t, v in second.items() if v[0] != frames[t]}
        logposts.append((utt, posteriors(PHONES, frames, peak=0.45, second=second)))
        refs[utt] = phone_tokens(words)
    folds = {utt: i % 2 for i, utt in enumerate(TRAIN)}
    grid = [(a, None, p) for a in (0.3, 1.0, 3.0) for p in (-2.0, 0.0, 2.0)]
    table, held_out = recognize.tune(decoder, logposts, None, refs, grid=grid,
                                     default=(1.0, None, 0.0), folds=folds)
    assert len(table) == len(grid) and sorted(r[:3] for r in table) == sorted(grid)
    half = {f: ([lp for lp in logposts if folds[lp[0]] == f],
                {u: r for u, r in refs.items() if folds[u] == f}) for f in (0, 1)}
    want = 0
    for f in (0, 1):
        other, _ = recognize.tune(decoder, *half[1 - f][:1], None, half[1 - f][1], grid=grid,
                                  default=(1.0, None, 0.0))
        assert held_out["points"][f] == other[0][:3]
        a, _, p = other[0][:3]
        hyps, _, _ = recognize.recognize(decoder.with_penalty(p), half[f][0], None, a, None)
        want = want + recognize.error_counts(half[f][1], hyps)[0]
    np.testing.assert_array_equal(held_out["counts"], want)
    # no better than the best point of the table, which saw every utterance
    assert score.error_rate(held_out["counts"]) >= score.error_rate(table[0][3])


def test_phone_tokens_through_a_lexicon_and_homophones(tiny):
    # C and SEE are both S IY: the word bigram picks, as in the hybrid word graphs
    frames = spell(phone_tokens("AB C"))
    tokens, final, _ = tlg_decode(tiny["phone_words"], posteriors(PHONES, frames))
    assert final and tokens == ["AB", "C"]          # after AB the bigram has seen C
    frames = spell(phone_tokens("SEE AB"))
    tokens, _, _ = tlg_decode(tiny["phone_words"], posteriors(PHONES, frames))
    assert tokens == ["SEE", "AB"]                  # <s> SEE AB, never <s> C AB


def test_bpe_pieces_through_their_tlg(tiny, tmp_path):
    if tiny["bpe"] is None:
        pytest.skip("sentencepiece is not installed")
    out = str(tmp_path / "bpe")
    assert cli.main(["mkgraph", tiny["archive"], out, "--kind", "words", "--topology", "ctc",
                     "--tokens", "bpe"]) == 0
    symbols = json.load(open(os.path.join(out, "graph.json")))["tokens"]["symbols"]
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_proto=tiny["bpe"])
    for words in ("A BA", "SEE AB C"):
        pieces = sp.encode(words, out_type=str)
        tokens, final, _ = tlg_decode(out, posteriors(symbols, spell(pieces)))
        assert final and tokens == words.split()
        assert ctc.tokens_to_words(pieces, "bpe") == words.split()


def test_the_hybrid_word_graph_reads_silence_between_words(tiny, tmp_path):
    """L's optional silence after a word reads SIL (Kaldi's make_lexicon_fst; it once read
    nothing, and the SIL frames went to the neighbouring phones). With the archive's own
    transcripts, no --text."""
    arch = write_token_archive(str(tmp_path / "a"), labels=True, kinds=())
    out = str(tmp_path / "g")
    assert cli.main(["mkgraph", arch, out, "--kind", "words", "--lexicon",
                     tiny["lexicon"]]) == 0
    graph = search.Graph(out)
    runs = ["SIL", "AE", "B", "SIL", "S", "IY", "SIL"]
    frames = np.repeat([LABELS.index(p) for p in runs], 4)
    logpost = np.full((len(frames), len(LABELS)), -20.0, np.float32)
    logpost[np.arange(len(frames)), frames] = 0.0
    scores = search.scaled_loglikelihoods(logpost, np.zeros(len(LABELS), np.float32), 1.0, 0.0,
                                          graph.states)
    words, final, phones = search.Decoder(graph).decode(scores)
    assert final and [graph.words[w] for w in words] == ["AB", "C"]
    np.testing.assert_array_equal(phones, frames)       # the middle SIL is SIL


# --- checks and references --------------------------------------------------------------------

def test_a_graph_for_other_tokens_or_another_model_type_is_a_clear_error(tiny):
    graph = search.Graph(tiny["chars"])
    other = [BLK, SPACE, "A", "B"]
    meta = {"model": {"type": "ctc"}, "path": "runs/ctc/ckpt.h5",
            "tokens": {"kind": "chars", "inventory_hash": archive.inventory_hash(other),
                       "symbols": other}}
    with pytest.raises(UserError) as err:
        graph.check_model(meta)
    msg = str(err.value)
    assert archive.inventory_hash(other) in msg and archive.inventory_hash(CHARS) in msg
    assert tiny["chars"] in msg and "tokens_chars.txt" in msg and "runs/ctc/ckpt.h5" in msg
    with pytest.raises(UserError, match="outputs phones tokens"):
        graph.check_tokens({"kind": "phones", "inventory_hash": "x"})
    with pytest.raises(UserError, match="a ctc graph, but .* is a hybrid model"):
        graph.check_model({"model": {"type": "dnn"}, "path": "runs/dnn"})
    graph.check_model({**meta, "tokens": {"kind": "chars",
                                          "inventory_hash": archive.inventory_hash(CHARS)}})


@pytest.mark.parametrize("case", ["no_tokens_option", "phones_of_chars", "kind_missing",
                                  "lexicon_for_chars"])
def test_bad_ctc_graph_options_are_clear_errors(case, tiny, tmp_path, capsys):
    args = {"no_tokens_option": (["--kind", "phones", "--topology", "ctc"],
                                 "--topology ctc needs --tokens"),
            "phones_of_chars": (["--kind", "phones", "--topology", "ctc", "--tokens", "chars"],
                                "--kind phones needs --tokens phones"),
            "kind_missing": (["--kind", "words", "--topology", "ctc", "--tokens", "bpe"],
                             "no bpe tokens in this archive (it has: chars, phones)"),
            "lexicon_for_chars": (["--kind", "words", "--topology", "ctc", "--tokens", "chars",
                                   "--lexicon", tiny["lexicon"]],
                                  "--lexicon gives phone pronunciations")}[case]
    arch = tiny["archive"]
    if case == "kind_missing":
        arch = write_token_archive(str(tmp_path / "nobpe"))
    assert cli.main(["mkgraph", arch, str(tmp_path / "g"), *args[0]]) == 2
    assert args[1] in capsys.readouterr().err


def test_references_come_from_the_archive(tiny, tmp_path):
    refs, source = recognize.archive_references("words", tiny["archive"])
    assert refs == {u: t.split() for u, t in TRAIN.items()} and "its transcripts" in source
    # phone references from the phone tokens, also without frame labels
    bare = write_token_archive(str(tmp_path / "bare"), labels=False)
    refs, source = recognize.archive_references("phones", bare)
    assert refs["u3"] == ["S", "IY", "AE", "B"] and "phone tokens" in source
    # --text wins when given
    text = str(tmp_path / "text")
    with open(text, "w") as f:
        f.write("u1 X Y\n")
    refs, source = recognize.archive_references("words", bare, text)
    assert refs == {"u1": ["X", "Y"]} and source == text
    # a hybrid word graph made with --text scores a held-out archive that has transcripts
    # against them (before: every utterance "without a reference" unless --text was given)
    graph = search.Graph(tiny["chars"])
    assert recognize.references(graph, bare, None)["u4"] == ["A", "BA"]
    nothing = write_token_archive(str(tmp_path / "none"), labels=False, text=False)
    with pytest.raises(UserError, match="has no transcripts of its own"):
        recognize.archive_references("words", nothing)


# --- hpcsgd decode on a stand-in CTC model ----------------------------------------------------

def test_decode_greedy_and_through_tlg_with_tuning(tiny, tmp_path, monkeypatch, capsys):
    """`hpcsgd decode --greedy` and `--graph TLG --tune` end to end, the model's posteriors
    handed in where hpcsgd.outputs.ctc_posteriors would compute them: every utterance spelled
    right, but u2's BA heard as BE (A second on that frame)."""
    from hpcsgd import model_io, outputs
    meta = {"model": {"type": "ctc"}, "path": "stand-in",
            "tokens": {"kind": "chars", "inventory_hash": archive.inventory_hash(CHARS),
                       "symbols": CHARS}, "config": {"data.train": tiny["archive"]}}
    spelled = {}
    for utt, words in TRAIN.items():
        frames = spell(char_tokens(words))
        second = None
        if utt == "u2":                     # B A -> B E, A the E frames' second choice
            frames = [("E" if f == "A" else f) for f in frames]
            second = {t: ("A", 0.08) for t, f in enumerate(frames) if f == "E"}
        spelled[utt] = posteriors(CHARS, frames, second=second)
    calls = []

    def ctc_posteriors(model, params, m, archive_dir, rank=0, world=1):
        calls.append((m is meta, archive_dir, rank, world))
        return [(utt, spelled[utt]) for utt in TRAIN], 0.01

    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: (None, None, meta))
    monkeypatch.setattr(model_io, "check_archive", lambda *a: None)     # no features to check
    monkeypatch.setattr(outputs, "ctc_posteriors", ctc_posteriors, raising=False)
    out = str(tmp_path / "greedy")
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--greedy",
                     "--out", out]) == 0
    printed = capsys.readouterr().out
    assert calls == [(True, tiny["archive"], 0, 1)]
    assert "by CTC greedy search over chars tokens" in printed
    assert "%WER 10.00 [ 1 / 10, 0 ins, 0 del, 1 sub ]" in printed
    assert "%CER 5.26 [ 1 / 19, 0 ins, 0 del, 1 sub ]" in printed     # spaces not counted
    assert "0 of the 10 reference words never occur in the training transcripts" in printed
    result = json.load(open(os.path.join(out, "result.json")))
    assert result["search"] == "greedy" and result["cer"]["errors"] == 1
    assert result["audio_seconds"] == pytest.approx(
        archive.read_index(tiny["archive"])["total_frames"] / 100)   # frames, not rows
    assert "u2 BE" in open(os.path.join(out, "hyp.txt")).read()
    # the word graph knows no BE: BA, every word right
    out = str(tmp_path / "tlg")
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--graph", tiny["chars"],
                     "--tune", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "acoustic scale -> %WER" in printed and "(words, CTC over chars tokens)" in printed
    result = json.load(open(os.path.join(out, "result.json")))
    assert result["error_rate"] == 0 and result["cer"]["error_rate"] == 0
    assert result["prior_scale"] is None and result["acoustic_scale"] == 1.0   # a tie: default
    assert result["insertion_penalty"] == 0.0 and result["held_out"] is None   # one speaker
    assert [r["acoustic_scale"] for r in result["tuning"]][0] == 1.0
    assert len(result["tuning"]) == len(recognize.TUNE_CTC) * len(recognize.TUNE_CTC_PENALTY)
    assert open(os.path.join(out, "hyp.txt")).read() == open(os.path.join(out, "ref.txt")).read()
    # what `eval --graph` reports for a CTC model
    args = argparse.Namespace(text=None, acoustic_scale=None, prior_scale=None,
                              beam=search.BEAM, max_active=search.MAX_ACTIVE)
    res = recognize.recognize_archive(None, None, meta, tiny["archive"], tiny["chars"], args)
    assert res["error_rate"] == 0 and res["topology"] == "ctc" and "%CER 0.00" in res["lines"]
    # what does not apply to CTC is an error, not ignored
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--graph", tiny["chars"],
                     "--prior-scale", "0.5"]) == 2
    assert "--prior-scale is for hybrid models" in capsys.readouterr().err
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--graph",
                     tiny["phones"]]) == 2
    assert "a graph over phones tokens, but stand-in outputs chars" in capsys.readouterr().err


# --- n-best lists from lattices --------------------------------------------------------------

def hand_lattice(arcs, finals, start=0):
    """A kaldifst.Lattice from (src, dst, input, word, graph cost, acoustic cost) arcs and
    {state: (graph, acoustic)} final weights."""
    import kaldifst as kf
    lat = kf.Lattice()
    for _ in range(1 + max([max(a[:2]) for a in arcs] + list(finals))):
        lat.add_state()
    lat.start = start
    for src, dst, i, w, g, a in arcs:
        lat.add_arc(src, kf.LatticeArc(i, w, kf.LatticeWeight(g, a), dst))
    for state, (g, a) in finals.items():
        lat.set_final(state, kf.LatticeWeight(g, a))
    return lat


def test_a_lattice_gives_each_word_sequence_once_at_its_best_alignment():
    """Word 7 on three alignments (costs 5, 4 and 6.5), word 8 on one (4.5), 7 then SIL (9)
    on one (4.25): the n-best is 7 (4), 7 9 (4.25), 8 (4.5) -- the raw lattice's three
    shortest paths would be 7, 7 9 and 8 only by luck of the costs -- and with SIL skipped
    7 9 is 7 again, not a second entry; graph and acoustic costs add up."""
    from hpcsgd.decode import lattice
    arcs = [(0, 1, 1, 7, 1.0, 1.0), (1, 3, 2, 0, 0.0, 3.0),       # 7 early: 5
            (0, 2, 1, 0, 0.0, 1.5), (2, 3, 2, 7, 1.0, 1.5),       # 7 late: 4
            (0, 3, 3, 7, 1.0, 5.5),                               # 7 in one frame: 6.5
            (0, 4, 4, 8, 2.0, 1.0), (4, 3, 4, 0, 0.0, 1.5),       # 8: 4.5
            (0, 5, 1, 7, 1.0, 1.0), (5, 6, 2, 9, 0.0, 2.0)]       # 7 9: 4.25 with 6's final
    lat = hand_lattice(arcs, {3: (0.0, 0.0), 6: (0.25, 0.0)})
    assert lattice.nbest(lat, 5, 8.0) == [(4.0, [7]), (4.25, [7, 9]), (4.5, [8])]
    assert lattice.nbest(lat, 2, 8.0) == [(4.0, [7]), (4.25, [7, 9])]
    assert lattice.nbest(lat, 5, 8.0, skip=(9,)) == [(4.0, [7]), (4.5, [8])]
    # only what lies within the lattice beam of the best is listed (exact costs)
    assert lattice.nbest(lat, 5, 0.3) == [(4.0, [7]), (4.25, [7, 9])]
    import kaldifst as kf
    assert lattice.nbest(kf.Lattice(), 3, 8.0) == []          # nothing survived the search
    # the arrays are the lattice's, read from its binary file
    with __import__("tempfile").TemporaryDirectory() as scratch:
        start, finals, src, read = lattice.lattice_arrays(lat, scratch)
    assert start == 0 and sorted(zip(src, read["next"], read["ilabel"], read["olabel"],
                                     read["graph"], read["acoustic"])) == sorted(arcs)
    assert np.isinf(finals[0]).all() and finals[6].tolist() == [0.25, 0.0]


def test_a_lattice_too_rich_to_determinize_is_made_again_at_half_the_beam(tiny, monkeypatch):
    """Past lattice.MAX_STATES determinized states nbest() gives None, and Decoder.nbest
    decodes the utterance again at half the lattice beam, until it fits."""
    from hpcsgd.decode import lattice
    rng = np.random.default_rng(4)
    scores = search.ctc_scores(np.log(rng.dirichlet(np.full(len(CHARS), 0.3), 14)), 1.0)
    decoder = search.Decoder(search.Graph(tiny["chars"]))
    wide, _, beam, widened = decoder.nbest(scores, 3)
    assert beam == search.LATTICE_BEAM == 4.0 and len(wide) == 3 and not widened
    sizes = []
    real = lattice.nbest

    def counting(lat, n, beam, skip=()):     # fits only at a quarter of the beam
        sizes.append(beam)
        return None if beam > search.LATTICE_BEAM / 4 else real(lat, n, beam, skip)
    monkeypatch.setattr(lattice, "nbest", counting)
    narrow, _, beam, _ = decoder.nbest(scores, 3)
    assert sizes == [4.0, 2.0, 1.0] and beam == 1.0
    assert narrow[0][1] == wide[0][1] and narrow[0][0] == pytest.approx(wide[0][0], abs=1e-4)
    assert all(c <= narrow[0][0] + 1.0 for c, _ in narrow)
    monkeypatch.setattr(lattice, "MAX_STATES", 1)
    lat = decoder._lattice[(search.NBEST_BEAM, 4.0)].get_raw_lattice()[1]
    assert real(lat, 3, 4.0) is None


def test_a_lattice_search_that_lost_the_best_path_is_made_again_at_the_full_beam(tiny):
    """At nbest_beam 0.5 the lattice search of a noisy utterance loses the best path (its
    best comes out dearer): it is searched again at the best path's beam, and its best is
    decode()'s; at nbest_beam = beam nothing is searched twice."""
    rng = np.random.default_rng(5)
    graph = search.Graph(tiny["chars"])
    widened = 0
    for _ in range(6):
        scores = search.ctc_scores(np.log(rng.dirichlet(np.full(len(CHARS), 0.3), 14)), 1.0)
        best = search.Decoder(graph).decode(scores)[0]
        for nbest_beam in (0.5, search.BEAM):
            ranked, _, _, widen = search.Decoder(graph, nbest_beam=nbest_beam).nbest(scores, 3)
            assert ranked[0][1] == best and not (widen and nbest_beam == search.BEAM)
            widened += widen
    assert widened > 0


def cheapest_path_writing(graph_dir, scores, words):
    """An independent check of an n-best entry's cost: the best path of the graph restricted
    to paths that write `words` (TLG composed with their linear acceptor), wide beam."""
    import kaldi_decoder
    import kaldifst as kf
    graph = search.Graph(graph_dir)
    tlg = graph.fst.copy()
    kf.arcsort(tlg, sort_type="olabel")
    restricted = kf.compose(tlg, kf.make_linear_acceptor(words))
    kf.arcsort(restricted, sort_type="ilabel")
    decoder = kaldi_decoder.FasterDecoder(
        restricted, kaldi_decoder.FasterDecoderOptions(beam=1000.0, max_active=100000))
    decoder.decode(kaldi_decoder.DecodableCtc(scores))
    ok, path = decoder.get_best_path()
    assert ok and decoder.reached_final()
    ok, _, out, weight = kf.get_linear_symbol_sequence(path)
    assert list(out) == list(words)
    return weight.value1 + weight.value2


def read_nbest(path):
    """nbest.txt -> {utt: [(rank, score, words)]} in file order."""
    lists = {}
    for line in open(path):
        key, sc, *words = line.split()
        utt, rank = key.rsplit("-", 1)
        lists.setdefault(utt, []).append((int(rank), float(sc), " ".join(words)))
    return lists


def test_decode_nbest_through_a_tlg(tiny, tmp_path, monkeypatch, capsys):
    """`decode --graph TLG --nbest 4` on noisy stand-in posteriors: per utterance at most 4
    distinct word sequences, ranked 1.., scores (minus costs) falling, the first hyp.txt's,
    each score minus the cheapest path of the graph that writes it; a bare --nbest is 10;
    with --tune the lists are the tuned scales'."""
    from hpcsgd import model_io, outputs
    meta = {"model": {"type": "ctc"}, "path": "stand-in",
            "tokens": {"kind": "chars", "inventory_hash": archive.inventory_hash(CHARS),
                       "symbols": CHARS}}
    rng = np.random.default_rng(3)
    noisy = {u: np.log(rng.dirichlet(np.full(len(CHARS), 0.3), 14)).astype(np.float32)
             for u in TRAIN}
    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: (None, None, meta))
    monkeypatch.setattr(model_io, "check_archive", lambda *a: None)
    monkeypatch.setattr(outputs, "ctc_posteriors", lambda *a, **k: (list(noisy.items()), 0.01),
                        raising=False)
    graph = search.Graph(tiny["chars"])
    for how, n in ((["--nbest", "4"], 4), (["--nbest"], recognize.NBEST),
                   (["--nbest", "3", "--tune"], 3)):
        out = str(tmp_path / f"nbest_{len(how)}")
        assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--graph",
                         tiny["chars"], *how, "--out", out]) == 0
        printed = capsys.readouterr().out
        assert f"nbest.txt: up to {n} hypotheses per utterance" in printed
        assert "0 utterance(s) whose lattice's best differs from hyp.txt" in printed
        result = json.load(open(os.path.join(out, "result.json")))
        assert result["nbest"] == n and result["nbest_differ"] == 0
        assert result["nbest_narrowed"] == {}
        best = dict(line.rstrip("\n").partition(" ")[::2]
                    for line in open(os.path.join(out, "hyp.txt")))
        lists = read_nbest(os.path.join(out, "nbest.txt"))
        assert set(lists) == set(best) == set(TRAIN)
        for utt, entries in lists.items():
            assert [r for r, _, _ in entries] == list(range(1, len(entries) + 1))
            assert len(entries) <= n and len({w for _, _, w in entries}) == len(entries)
            assert all(a[1] >= b[1] for a, b in zip(entries, entries[1:]))
            assert entries[0][2] == best[utt]
            if how == ["--nbest", "4"]:     # the scores are the graph's: minus path costs
                scores = search.ctc_scores(noisy[utt], 1.0)
                for _, sc, words in entries:
                    ids = [graph.words.index(w) for w in words.split()]
                    assert sc == pytest.approx(-cheapest_path_writing(tiny["chars"], scores,
                                                                      ids), abs=2e-3)
            # only sequences within the lattice beam of the best (their costs exact)
            assert entries[0][1] - entries[-1][1] <= search.LATTICE_BEAM + 1e-3
        # 14 noisy frames through a 5-word bigram: more than 4 sequences within the lattice
        # beam of every utterance, not always 10
        assert sum(len(e) for e in lists.values()) == n * len(TRAIN) if n <= 4 else \
            4 * len(TRAIN) < sum(len(e) for e in lists.values()) <= n * len(TRAIN)
    assert result["tuning"] is not None
    # hyp.txt is the best path's with or without the lists
    plain = str(tmp_path / "plain")
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--graph", tiny["chars"],
                     "--out", plain]) == 0
    assert "nbest.txt" not in capsys.readouterr().out
    assert not os.path.exists(os.path.join(plain, "nbest.txt"))
    assert open(os.path.join(plain, "hyp.txt")).read() == \
        open(os.path.join(str(tmp_path / "nbest_2"), "hyp.txt")).read()
    # what --nbest cannot mean is an error naming it
    for bad, says in ((["--greedy", "--nbest"], "greedy search keeps one"),
                      (["--graph", tiny["chars"], "--lattice-beam", "2"],
                       "--lattice-beam: the lattice search of --nbest through a graph"),
                      (["--greedy", "--nbest-beam", "6"],
                       "--nbest-beam: the lattice search of --nbest through a graph"),
                      (["--graph", tiny["chars"], "--nbest", "2", "--lattice-beam", "0"],
                       "--lattice-beam 0: a cost above 0")):
        assert cli.main(["decode", "stand-in", "--data", tiny["archive"], *bad]) == 2
        assert says in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["decode", "stand-in", "--data", tiny["archive"], "--graph", tiny["chars"],
                  "--nbest", "0"])
    assert "0: give N >= 1 hypotheses per utterance" in capsys.readouterr().err
    # an RNN-T's beam holds K hypotheses: no more can be listed
    meta.update(model={"type": "rnnt"})
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--beam-size", "2",
                     "--nbest", "3"]) == 2
    assert "final beam holds --beam-size 2 hypotheses" in capsys.readouterr().err


STAND_IN = """
import sys
import numpy as np
from hpcsgd import cli, model_io, outputs
saved = np.load(sys.argv[1])
utts = [str(u) for u in saved["utts"]]
meta = {"model": {"type": "ctc"}, "path": "stand-in",
        "tokens": {"kind": "chars", "inventory_hash": str(saved["hash"]),
                   "symbols": [str(s) for s in saved["symbols"]]}}


def ctc_posteriors(model, params, m, archive_dir, rank=0, world=1):
    return [(u, saved[u]) for u in utts[rank::world]], 0.01   # disjoint shares


model_io.load_model = lambda *a, **k: (None, None, meta)
model_io.check_archive = lambda *a: None
outputs.ctc_posteriors = ctc_posteriors
sys.exit(cli.main(sys.argv[2:]))
"""


def test_two_ranks_decode_disjoint_utterances_and_agree_with_one(tiny, tmp_path, monkeypatch):
    from conftest import run_mpi
    from hpcsgd import model_io, outputs
    rng = np.random.default_rng(2)
    saved = {u: np.log(rng.dirichlet(np.full(len(CHARS), 0.3), 12)).astype(np.float32)
             for u in TRAIN}
    data = str(tmp_path / "stand_in.npz")
    np.savez(data, utts=list(TRAIN), hash=archive.inventory_hash(CHARS), symbols=CHARS, **saved)
    script = str(tmp_path / "stand_in.py")
    with open(script, "w") as f:
        f.write(STAND_IN)
    meta = {"model": {"type": "ctc"}, "path": "stand-in",
            "tokens": {"kind": "chars", "inventory_hash": archive.inventory_hash(CHARS),
                       "symbols": CHARS}}
    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: (None, None, meta))
    monkeypatch.setattr(model_io, "check_archive", lambda *a: None)
    monkeypatch.setattr(outputs, "ctc_posteriors", lambda *a, **k: (list(saved.items()), 0.01),
                        raising=False)
    for k, how in enumerate((["--greedy"], ["--graph", tiny["chars"]],
                             ["--graph", tiny["chars"], "--nbest", "3"])):
        outs = [str(tmp_path / f"{how[0][2:]}{k}_{ranks}") for ranks in (1, 2)]
        assert cli.main(["decode", "stand-in", "--data", tiny["archive"], *how,
                         "--out", outs[0]]) == 0
        proc = run_mpi(2, ["-m", "mpi4py", script, data, "decode", "stand-in", "--data",
                           tiny["archive"], *how, "--out", outs[1]])
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert json.load(open(os.path.join(outs[1], "result.json")))["ranks"] == 2
        hyps = [open(os.path.join(out, "hyp.txt")).read() for out in outs]
        assert hyps[0] == hyps[1] and hyps[0].count("\n") == len(TRAIN)
        if "--nbest" in how:    # the lists gathered from both ranks, the same as one rank's
            lists = [open(os.path.join(out, "nbest.txt")).read() for out in outs]
            assert lists[0] == lists[1] and lists[0].count("\n") == 3 * len(TRAIN)
