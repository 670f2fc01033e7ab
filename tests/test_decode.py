"""Recognition: the n-gram estimate, the graph (HLG), the beam search, scoring, `mkgraph`,
`decode` under 1 and 2 real MPI ranks, `eval --graph`, and the bad inputs they meet."""
import json
import math
import os
import random

import numpy as np
import pytest

from conftest import REPO, run_mpi
from hpcsgd import cli
from hpcsgd.data import archive
from hpcsgd.decode import lm, mkgraph, recognize, score, search

DEMO = os.path.join(REPO, "data_prep", "demo", "so762")
SYMBOLS = ["SIL", "A", "B", "C"]
# a hand-checkable word list: AB and BA share phones in two orders, C and SEA are homophones
# (each gets its own #k), A is a prefix of AB (a #k too)
LEXICON = "AB A B\nBA B A\nC C\nSEA C\nA A\n"
TRAIN = {   # utterance: (words, phone per segment, frames per segment)
    "u1": ("AB C", "SIL A B SIL C SIL", (4, 3, 5, 3, 4, 6)),
    "u2": ("BA", "SIL B A SIL", (3, 4, 4, 3)),
    "u3": ("AB", "A B", (3, 3)),
    "u4": ("SEA AB", "SIL C A B SIL", (5, 3, 3, 4, 5)),
    "u5": ("A BA", "A SIL B A", (3, 3, 3, 3)),
    "u6": ("C", "C SIL", (4, 3)),
}


def write_spelled_archive(out, utts, symbols=SYMBOLS, dim=4, seed=0):
    """One shard whose frame labels spell each utterance's phones (features are noise)."""
    rng = np.random.default_rng(seed)
    labels, offsets, ids = [], [0], []
    for utt, (_, phones, lengths) in utts.items():
        frames = np.repeat([symbols.index(p) for p in phones.split()], lengths)
        labels.append(frames)
        offsets.append(offsets[-1] + len(frames))
        ids.append(utt)
    labels = np.concatenate(labels).astype(np.int32)
    feats = rng.normal(size=(len(labels), dim)).astype(np.float32)
    stats = np.zeros((1, 2, dim + 1))
    stats[0, 0, :dim], stats[0, 0, dim] = feats.sum(0), len(feats)
    stats[0, 1, :dim] = (feats.astype(np.float64) ** 2).sum(0)
    attrs = dict(format_version=archive.FORMAT_VERSION, feature_type="fbank", feature_dim=dim,
                 num_labels=len(symbols), label_inventory_hash=archive.inventory_hash(symbols),
                 sample_rate=16000, frame_shift_ms=10.0, frame_length_ms=25.0,
                 extractor_config="{}")
    os.makedirs(out, exist_ok=True)
    archive.write_shard(os.path.join(out, archive.shard_name(0)), feats, labels, offsets, ids,
                        np.zeros(len(ids), np.int32), ["spk"], stats,
                        np.bincount(labels, minlength=len(symbols)), attrs)
    archive.atomic_write_text(os.path.join(out, archive.LABELS_NAME),
                              archive.inventory_text(symbols))
    archive.write_index(out)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The spelled archive, its text and lexicon, and its three graphs."""
    root = tmp_path_factory.mktemp("tiny")
    arch = write_spelled_archive(str(root / "archive"), TRAIN)
    text, lex = str(root / "text"), str(root / "lexicon.txt")
    with open(text, "w") as f:
        f.writelines(f"{utt} {words}\n" for utt, (words, _, _) in TRAIN.items())
    with open(lex, "w") as f:
        f.write(LEXICON)
    graphs = {}
    for kind in ("phones", "words", "digits"):
        graphs[kind] = str(root / kind)
        extra = [] if kind == "phones" else ["--text", text, "--lexicon", lex]
        assert cli.main(["mkgraph", arch, graphs[kind], "--kind", kind, *extra]) == 0
    return {"archive": arch, "text": text, "lexicon": lex, **graphs}


def spelled_scores(phones, lengths, states=3, peak=0.0, floor=-20.0):
    """A decoder score matrix whose frames spell `phones` (a peak at the frame's phone)."""
    frames = np.repeat([SYMBOLS.index(p) for p in phones.split()], lengths)
    logpost = np.full((len(frames), len(SYMBOLS)), floor, np.float32)
    logpost[np.arange(len(frames)), frames] = peak
    return search.scaled_loglikelihoods(logpost, np.zeros(len(SYMBOLS), np.float32), 1.0, 0.0,
                                        states)


def decode_tokens(graph_dir, scores, alignment=False):
    graph = search.Graph(graph_dir)
    words, final, phones = search.Decoder(graph).decode(scores)
    tokens = [graph.words[w] for w in words]
    return (tokens, final, phones) if alignment else (tokens, final)


def levenshtein(ref, hyp):
    """Plain dynamic programming, independent of kaldialign."""
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        prev, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            prev, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, prev + (r != h))
    return row[-1]


# --- the n-gram estimate ----------------------------------------------------------------------

@pytest.mark.parametrize("order", [1, 2, 3])
def test_kneser_ney_is_a_distribution_after_every_history(order, tmp_path):
    rng = random.Random(order)
    words = "the cat sat on a mat and dog ran".split()
    sentences = [[rng.choice(words[:6]) for _ in range(rng.randint(0, 7))] for _ in range(60)]
    sentences.append(["dog", "ran"])      # words seen once only
    model = lm.estimate(sentences, order)
    histories = [()] + [g for n in range(1, order) for g in model["ngrams"][n]
                        if g[-1] != lm.EOS]
    for h in histories:
        total = sum(10 ** lm.logprob(model["ngrams"], h + (w,)) for w in model["vocab"])
        assert abs(total - 1.0) < 1e-9, (h, total)
    path = str(tmp_path / "lm.arpa")
    with open(path, "w") as f:
        f.write(lm.arpa_text(model))
    again = lm.read_arpa(path)      # 7 decimals of log10: a relative 2e-7 per probability
    ppl, oov = lm.perplexity(model, sentences)
    assert oov == 0 and abs(lm.perplexity(again, sentences)[0] / ppl - 1) < 1e-5


def test_kneser_ney_bigram_by_hand():
    """<s> a b </s>, <s> a </s>, <s> b </s>: bigram counts-of-counts n1 = 3, n2 = 2 give
    D2 = 3/7; unigram continuation counts a 1, b 2, </s> 2 give D1 = 1/5, so p1 = (a 0.2,
    b 0.4, </s> 0.4); p(b | a) = (1 - 3/7) / 2 + (3/7 * 2/2) * 0.4 = 3.2/7, and the unseen
    p(a | a) = gamma(a) p1(a) = 3/7 * 0.2."""
    model = lm.estimate([["a", "b"], ["a"], ["b"]], 2)
    p = lambda *g: 10 ** lm.logprob(model["ngrams"], g)   # noqa: E731
    assert p("a") == pytest.approx(0.2) and p("b") == pytest.approx(0.4)
    assert p("a", "b") == pytest.approx(3.2 / 7)
    assert p("a", "a") == pytest.approx(0.6 / 7)
    assert model["ngrams"][1][(lm.BOS,)][0] == lm.LOG10_ZERO


def test_an_arpa_of_ones_own_gives_the_same_graph(tiny, tmp_path):
    """--lm FILE reads an ARPA made elsewhere: the estimated one, given back, is the same G."""
    out = str(tmp_path / "own")
    assert cli.main(["mkgraph", tiny["archive"], out, "--kind", "words", "--text", tiny["text"],
                     "--lexicon", tiny["lexicon"], "--lm",
                     os.path.join(tiny["words"], "lm.arpa")]) == 0
    mine, theirs = (json.load(open(os.path.join(d, "graph.json"))) for d in (out, tiny["words"]))
    assert (mine["hlg_states"], mine["hlg_arcs"]) == (theirs["hlg_states"], theirs["hlg_arcs"])
    assert mine["lm_ngrams"] == theirs["lm_ngrams"] and mine["lm"].endswith("lm.arpa")
    tokens, _ = decode_tokens(out, spelled_scores("SIL B A SIL", (3, 3, 3, 3)))
    assert tokens == ["BA"]


# --- the graph and the search -----------------------------------------------------------------

def test_a_spelled_phone_sequence_is_recognized_and_durations_are_at_least_three(tiny):
    lengths = (4, 3, 3, 5, 3)
    tokens, final, phones = decode_tokens(tiny["phones"], spelled_scores("SIL A B C SIL", lengths),
                                          alignment=True)
    assert final and tokens == ["SIL", "A", "B", "C", "SIL"]
    np.testing.assert_array_equal(phones, np.repeat([0, 1, 2, 3, 0], lengths))
    # a B of 2 frames takes a third from a neighbour (3 states, at least a frame each) ...
    tokens, final, phones = decode_tokens(tiny["phones"], spelled_scores("A B C", (4, 2, 4)),
                                          alignment=True)
    assert final and tokens == ["A", "B", "C"] and np.sum(phones == 2) == 3
    # ... and a B of one frame is not worth two wrong frames: gone
    tokens, final = decode_tokens(tiny["phones"], spelled_scores("A B A", (4, 1, 4)))
    assert final and tokens == ["A"]
    # two frames reach no final state (every path is at least one phone of 3 frames)
    _, final = decode_tokens(tiny["phones"], spelled_scores("A", (2,)))
    assert not final


def test_words_come_from_the_lexicon_and_the_lm_picks_among_homophones(tiny):
    lexicon = open(os.path.join(tiny["words"], "lexicon.txt")).read().split("\n")
    assert "AB A B" in lexicon and "SEA C" in lexicon
    tokens, final = decode_tokens(tiny["words"], spelled_scores("SIL B A SIL", (3, 3, 3, 3)))
    assert final and tokens == ["BA"]
    tokens, _ = decode_tokens(tiny["words"], spelled_scores("A B SIL C", (3, 3, 3, 3)))
    assert tokens == ["AB", "C"]          # after AB the bigram has seen C, never SEA
    tokens, _ = decode_tokens(tiny["words"], spelled_scores("C A B", (3, 3, 3)))
    assert tokens == ["SEA", "AB"]        # and <s> SEA AB, never <s> C AB
    # the digits grammar: one word per utterance, whatever the frames spell
    tokens, final = decode_tokens(tiny["digits"], spelled_scores("A B C", (3, 3, 3)))
    assert final and len(tokens) == 1


def test_error_counts_equal_an_independent_edit_distance(tiny):
    graph = search.Graph(tiny["phones"])
    decoder = search.Decoder(graph)
    rng = np.random.default_rng(0)
    ref = "SIL A B C A B SIL C A SIL".split()
    lengths = rng.integers(3, 8, len(ref))
    clean = spelled_scores(" ".join(ref), lengths)
    assert [graph.words[w] for w in decoder.decode(clean)[0]] == ref
    for noise in (2.0, 6.0, 12.0):
        words, _, _ = decoder.decode(clean + rng.normal(0, noise, clean.shape).astype(np.float32))
        hyp = [graph.words[w] for w in words]
        ins, dels, sub, n, _, wrong = score.counts(ref, hyp)
        assert ins + dels + sub == levenshtein(ref, hyp) and n == len(ref)
        assert ins - dels == len(hyp) - len(ref) and wrong == (hyp != ref)
    # the bootstrap: an interval around the error rate, and a perfect system beats a noisy one
    refs = [ref] * 40
    noisy = [ref[:3] + ["X"] + ref[4:] if i % 2 else ref[1:] for i in range(38)] + [[], []]
    (low, high), better = score.bootstrap(refs, noisy, refs)
    assert low < 100 * 58 / 400 < high and better == 1.0      # 38 errors + 2 x 10 deleted
    assert score.bootstrap(refs, refs) == (0.0, 0.0)
    line = score.kaldi_lines("WER", np.array([10, 20, 93, 1000, 156, 71]))
    assert line == "%WER 12.30 [ 123 / 1000, 10 ins, 20 del, 93 sub ]\n%SER 45.51 [ 71 / 156 ]"


def test_tuning_ranks_by_errors_and_keeps_the_defaults_on_a_tie(tiny):
    graph = search.Graph(tiny["phones"])
    decoder = search.Decoder(graph)
    lengths = (3, 4, 3, 5, 3)
    frames = np.repeat([SYMBOLS.index(p) for p in "SIL A B C SIL".split()], lengths)
    logpost = np.full((len(frames), len(SYMBOLS)), np.log(1e-4), np.float32)
    logpost[np.arange(len(frames)), frames] = np.log(1 - 3e-4)
    refs = {"u": ["A", "B", "C"]}
    priors = np.log(np.full(len(SYMBOLS), 0.25, np.float32))
    table, held_out = recognize.tune(decoder, [("u", logpost)], priors, refs,
                                     default=(0.2, 0.5, 0.0))
    assert held_out is None          # no folds: nothing held out
    assert [score.error_rate(c) for _, _, _, c in table] == sorted(
        score.error_rate(c) for _, _, _, c in table)
    assert score.error_rate(table[0][3]) == 0 and table[0][:3] == (0.2, 0.5, 0.0)
    assert {p for _, _, p, _ in table} == {0.0}     # a hybrid graph keeps its penalty
    # below an acoustic scale of 0.083 the phone LM drowns these frames: decoded worse
    worse = {a for a, _, _, c in table if score.error_rate(c) > 0}
    assert 0.05 in worse and max(worse) < 0.1


# --- bad input ------------------------------------------------------------------------------

def test_a_word_without_a_pronunciation_is_counted_and_left_out(tiny, tmp_path, capsys):
    text = str(tmp_path / "text")
    with open(text, "w") as f:
        f.writelines(f"{utt} {words}{' QZXJWV' if utt == 'u2' else ''}\n"
                     if utt != "u6" else "u6\n" for utt, (words, _, _) in TRAIN.items())
    out = str(tmp_path / "g")
    assert cli.main(["mkgraph", tiny["archive"], out, "--kind", "words", "--text", text,
                     "--lexicon", tiny["lexicon"]]) == 0
    printed = capsys.readouterr().out
    assert "1 without (1 of the transcripts' tokens" in printed
    assert "1 training utterances with an empty transcript skipped" in printed
    assert open(os.path.join(out, "oov.txt")).read() == "QZXJWV\n"
    assert "QZXJWV" not in search.Graph(out).words


@pytest.mark.parametrize("case", ["unknown_phone", "no_text", "missing_transcript",
                                  "other_labels", "no_graph"])
def test_bad_input_is_a_clear_error(case, tiny, tmp_path, capsys):
    if case == "unknown_phone":
        lex = str(tmp_path / "lex")
        with open(lex, "w") as f:
            f.write("AB A B\nBA B Q\n")
        args = ["mkgraph", tiny["archive"], str(tmp_path / "g"), "--kind", "words",
                "--text", tiny["text"], "--lexicon", lex]
        want = "lex:2: word 'BA' uses phone 'Q'"
    elif case == "no_text":
        args = ["mkgraph", tiny["archive"], str(tmp_path / "g"), "--kind", "words"]
        want = "--kind words needs --text"
    elif case == "missing_transcript":
        text = str(tmp_path / "text")
        with open(text, "w") as f:
            f.write("u1 AB C\n")
        args = ["mkgraph", tiny["archive"], str(tmp_path / "g"), "--kind", "words",
                "--text", text]
        want = "no transcript for 5 of the archive's 6 utterances (first: u2)"
    elif case == "other_labels":
        other = write_spelled_archive(str(tmp_path / "other"), {"x": ("", "SIL X", (3, 3))},
                                      symbols=["SIL", "X"])
        graph = search.Graph(tiny["phones"])
        with pytest.raises(Exception) as err:
            graph.check_archive(archive.read_index(other), other)
        assert "differs from the graph's phone table" in str(err.value)
        return
    else:
        args = ["decode", "run", "--data", tiny["archive"], "--graph", str(tmp_path / "none")]
        want = "no graph.json (make the graph with `hpcsgd mkgraph"
    assert cli.main(args) == 2
    assert want in capsys.readouterr().err
    assert not os.path.exists(os.path.join(str(tmp_path / "g"), "graph.json"))


# --- real speech, real ranks ----------------------------------------------------------------

@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The bundled so762 demo: an archive, a small DNN trained on its 32 training speakers,
    and the phone and word graphs of its training utterances."""
    root = tmp_path_factory.mktemp("demo")
    arch, run = str(root / "archive"), str(root / "run")
    env = {"OMP_NUM_THREADS": "1"}
    proc = run_mpi(1, ["-m", "hpcsgd.cli", "prep", DEMO, arch, "--alignments",
                       os.path.join(DEMO, "phones.ctm"), "--labels",
                       os.path.join(DEMO, "labels.txt"), "--cv-speakers", "8"], env=env)
    assert proc.returncode == 0, proc.stderr
    proc = run_mpi(1, ["-m", "hpcsgd.cli", "train", f"data.train={arch}/train", "data.cv=",
                       f"train.run_dir={run}", "model.hidden=[256, 256]", "train.epochs=3",
                       "optim.lr=0.001", "train.log_every_frames=100000",
                       "train.tensorboard=false"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    graphs = {}
    for kind in ("phones", "words"):
        graphs[kind] = str(root / f"graph_{kind}")
        extra = [] if kind == "phones" else ["--text", os.path.join(DEMO, "text")]
        assert cli.main(["mkgraph", f"{arch}/train", graphs[kind], "--kind", kind,
                         *extra]) == 0
    return {"archive": arch, "run": run, **graphs, "root": str(root)}


def test_decode_on_two_ranks_equals_one_and_beats_no_acoustics(demo):
    outs = {}
    for ranks in (1, 2):
        outs[ranks] = os.path.join(demo["root"], f"decode_{ranks}")
        proc = run_mpi(ranks, ["-m", "mpi4py", "-m", "hpcsgd.cli", "decode", demo["run"],
                               "--data", f"{demo['archive']}/cv", "--graph", demo["phones"],
                               "--out", outs[ranks], "--tune"], timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "%PER " in proc.stdout and "real-time factor per core" in proc.stdout
        assert "<- best" in proc.stdout and "95% confidence interval" in proc.stdout
    hyps = [open(os.path.join(outs[k], "hyp.txt")).read() for k in (1, 2)]
    cv = archive.read_index(f"{demo['archive']}/cv")["total_utterances"]
    assert hyps[0] == hyps[1] and hyps[0].count("\n") == cv       # every CV utterance once
    result = json.load(open(os.path.join(outs[2], "result.json")))
    assert result["ranks"] == 2 and result["utterances"] == cv and result["not_final"] == 0
    # the grid's counts summed over the ranks: the same table, the same choice, at 1 and 2
    tables = [json.load(open(os.path.join(outs[k], "result.json")))["tuning"] for k in (1, 2)]
    assert tables[0] == tables[1] and len(tables[0]) == 24
    # the same graph with the acoustic model switched off (scale 0): only the LM's best guess
    silent = run_mpi(1, ["-m", "hpcsgd.cli", "decode", demo["run"], "--data",
                         f"{demo['archive']}/cv", "--graph", demo["phones"], "--out",
                         os.path.join(demo["root"], "decode_lm_only"), "--acoustic-scale", "0"])
    lm_only = json.load(open(os.path.join(demo["root"], "decode_lm_only", "result.json")))
    assert silent.returncode == 0 and lm_only["error_rate"] >= 95.0
    assert result["error_rate"] < lm_only["error_rate"] - 20.0, (result, lm_only)
    # per_utt.txt adds up to the scoring line
    per_utt = np.loadtxt(os.path.join(outs[2], "per_utt.txt"), usecols=(1, 2, 3, 4), dtype=int)
    assert per_utt[:, :3].sum() == result["errors"] and per_utt[:, 3].sum() == result["ref_tokens"]


def test_eval_with_a_graph_reports_frames_and_words_in_one(demo, tmp_path, capsys):
    out = str(tmp_path / "eval.json")
    assert cli.main(["eval", demo["run"], "--data", f"{demo['archive']}/cv", "--graph",
                     demo["words"], "--json", out]) == 0
    printed = capsys.readouterr().out
    assert "frame accuracy" in printed and "%WER " in printed
    result = json.load(open(out))
    dec = result["decode"]
    assert 0 < result["frame_accuracy"] < 1 and dec["metric"] == "WER"
    cv = {utt for utt, _, _ in mkgraph.archive_alignments(f"{demo['archive']}/cv")[1]}
    assert dec["ref_tokens"] == sum(len(line.split()) - 1 for line in open(
        os.path.join(DEMO, "text")) if line.split()[0] in cv)
    assert dec["utterances"] == len(cv)
    # references missing for two utterances: decoded, not scored, counted
    text = str(tmp_path / "text")
    drop = sorted(cv)[:2]
    with open(text, "w") as f:
        f.writelines(line for line in open(os.path.join(DEMO, "text"))
                     if line.split()[0] not in drop)
    assert cli.main(["decode", demo["run"], "--data", f"{demo['archive']}/cv", "--graph",
                     demo["words"], "--text", text, "--out", str(tmp_path / "dec")]) == 0
    assert "2 without a reference (not scored)" in capsys.readouterr().out
    partial = json.load(open(tmp_path / "dec" / "result.json"))
    assert partial["utterances"] == len(cv) - 2 and partial["no_reference"] == 2
    assert math.isfinite(dec["error_rate"]) and dec["error_rate"] > 0


def test_nbest_lists_of_real_speech_through_the_phone_and_word_graphs(demo, tmp_path):
    """`decode --nbest 5` of the demo DNN's CV utterances through its HLGs: the lattice's best
    is the best path's (hyp.txt) on every utterance, each list at most 5 distinct
    hypotheses, ranked, scores falling; a phone list holds no SIL (hypotheses that differ
    only in their silences are one). The report gives both searches' times. The word graph
    with both searches at beam 6 and no max-active: at the defaults the best path's
    max-active 1000 pruned the cheaper path on 2 of the 40 (docs/decode.md#n-best-lists),
    and the lattice search (beam 8) takes a minute."""
    for kind, extra in (("phones", []), ("words", ["--beam", "6", "--max-active", "100000"])):
        out = str(tmp_path / kind)
        proc = run_mpi(1, ["-m", "hpcsgd.cli", "decode", demo["run"], "--data",
                           f"{demo['archive']}/cv", "--graph", demo[kind], "--nbest", "5",
                           *extra, "--out", out], timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "0 utterance(s) whose lattice's best differs from hyp.txt" in proc.stdout
        assert json.load(open(os.path.join(out, "result.json")))["nbest_beam"] == \
            (8.0 if kind == "phones" else 6.0)      # never wider than the best path's
        assert "search" in proc.stdout.split("nbest.txt:")[1].split("\n")[0]
        best = dict(line.rstrip("\n").partition(" ")[::2]
                    for line in open(os.path.join(out, "hyp.txt")))
        lists = {}
        for line in open(os.path.join(out, "nbest.txt")):
            key, sc, *words = line.split()
            utt, rank = key.rsplit("-", 1)
            lists.setdefault(utt, []).append((int(rank), float(sc), " ".join(words)))
        assert set(lists) == set(best)
        for utt, entries in lists.items():
            assert [r for r, _, _ in entries] == list(range(1, len(entries) + 1))
            assert len(entries) <= 5 and len({w for _, _, w in entries}) == len(entries)
            assert all(a[1] >= b[1] for a, b in zip(entries, entries[1:]))
            assert entries[0][2] == best[utt]
            assert kind != "phones" or all(mkgraph.SIL not in w.split() for _, _, w in entries)
        # real speech through a bigram: the lattices hold alternatives
        assert sum(len(e) for e in lists.values()) > 3 * len(lists)


def test_the_default_out_dir_of_two_archives_of_one_name_differs(tmp_path):
    """Decoding one run on runs/so762/archive/cv and then runs/ls/archive/cv: the second
    decode goes to GRAPH_ls_archive_cv... rather than over the first's files; the same
    archive again reuses its directory (a result.json of before archive_path: its archive)."""
    from hpcsgd.decode.decode import default_out
    run = tmp_path / "run"
    run.mkdir()
    first, second = tmp_path / "so762" / "cv", tmp_path / "ls" / "cv"
    for a in (first, second):
        a.mkdir(parents=True)
    out1 = default_out(str(run), "greedy", str(first))
    assert out1 == str(run / "decode" / "greedy_cv")
    os.makedirs(out1)
    with open(os.path.join(out1, "result.json"), "w") as f:
        json.dump({"archive": str(first)}, f)       # written before archive_path
    assert default_out(str(run), "greedy", str(first)) == out1
    out2 = default_out(str(run), "greedy", str(second))
    assert out2 == str(run / "decode" / "greedy_ls_cv")
    os.makedirs(out2)
    with open(os.path.join(out2, "result.json"), "w") as f:
        json.dump({"archive": "elsewhere", "archive_path": str(second)}, f)
    assert default_out(str(run), "greedy", str(second)) == out2
    assert default_out(str(run), "greedy", str(first)) == out1
