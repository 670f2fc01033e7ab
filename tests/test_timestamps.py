"""Word and phone timestamps from CTC emissions (hpcsgd/decode/timestamps.py) and `hpcsgd decode
--ctm --ref-ctm` end to end on a stand-in model whose posteriors spell known frames."""
import json
import os

import numpy as np
import pytest

from hpcsgd import cli
from hpcsgd.data import archive
from hpcsgd.decode import ctc, timestamps
from test_decode_ctc import CHARS, TRAIN, char_tokens, posteriors, spell, tiny  # noqa: F401

BLK, SPACE, WS = archive.BLANK, ctc.SPACE, ctc.WORD_START


def test_runs_are_the_non_blank_stretches_of_the_path():
    path = [0, 1, 1, 0, 0, 2, 1, 1, 0, 1]
    assert timestamps.token_runs(path) == [(1, 1, 2), (2, 5, 5), (1, 6, 7), (1, 9, 9)]
    assert timestamps.token_runs([]) == [] and timestamps.token_runs([0, 0]) == []
    # the runs' tokens are exactly what greedy search emits
    logpost = np.log(np.eye(3)[path] * 0.9 + 0.05)
    assert [k for k, _, _ in timestamps.token_runs(logpost.argmax(1))] == \
        ctc.greedy_search(logpost).tolist()
    assert timestamps.emission_runs([4, 2], [3, 7]) == [(4, 3, 3), (2, 7, 7)]


def test_words_span_the_runs_that_spell_them():
    chars = [BLK, SPACE, "A", "B", "C"]
    runs = [(2, 1, 2), (3, 4, 5), (1, 7, 8), (4, 10, 11)]         # A B <space> C
    assert timestamps.word_spans(["AB", "C"], runs, chars, "chars") == [("AB", 1, 5), ("C", 10, 11)]
    # through a word graph a chars model may run two words together without <space>
    runs = [(2, 1, 1), (3, 3, 3), (4, 6, 6)]
    assert timestamps.word_spans(["AB", "C"], runs, chars, "chars") == [("AB", 1, 3), ("C", 6, 6)]
    bpe = [BLK, f"{WS}A", "B", f"{WS}", "C"]
    runs = [(1, 0, 0), (2, 2, 3), (3, 6, 6), (4, 8, 8)]          # ▁A B ▁ C
    assert timestamps.word_spans(["AB", "C"], runs, bpe, "bpe") == [("AB", 0, 3), ("C", 6, 8)]
    phones = [BLK, "AE", "B", "S", "IY"]
    runs = [(1, 0, 1), (2, 3, 3), (3, 5, 5), (4, 7, 9)]
    assert timestamps.word_spans(["AE", "B", "S", "IY"], runs, phones, "phones") == \
        [("AE", 0, 1), ("B", 3, 3), ("S", 5, 5), ("IY", 7, 9)]
    prons = {"A": [("AE",)], "AB": [("AE", "B")], "SEE": [("S", "IY")]}   # a word graph's lexicon
    assert timestamps.word_spans(["AB", "SEE"], runs, phones, "phones", prons) == \
        [("AB", 0, 3), ("SEE", 5, 9)]
    with pytest.raises(ValueError, match="spell 'ABC', not the words 'AB D'"):
        timestamps.word_spans(["AB", "D"], [(2, 0, 0), (3, 1, 1), (4, 2, 2)], chars, "chars")
    with pytest.raises(ValueError, match="no pronunciation of 'SEE'"):
        timestamps.word_spans(["AB", "SEE"], runs[:3], phones, "phones", prons)


def test_ctm_lines_and_start_errors_of_the_words_recognised():
    assert timestamps.ctm_lines("u1", [("AB", 1, 5), ("C", 10, 11)], 0.02) == \
        "u1 1 0.020 0.100 AB\nu1 1 0.200 0.040 C\n"
    hyp = {"u": [("A", 0.10), ("X", 0.50), ("C", 0.90)], "v": [("D", 0.0)]}
    ref = {"u": [("A", 0.13), ("B", 0.40), ("C", 1.00)], "v": [("E", 0.0)]}
    errors = timestamps.start_errors(hyp, ref)          # A and C: X is a substitution
    np.testing.assert_allclose(sorted(errors), [0.03, 0.10], atol=1e-12)
    summary = timestamps.timing_summary(errors)
    assert summary["words"] == 2 and summary["median_ms"] == pytest.approx(65.0)
    # an insertion shifts no reference word onto another
    hyp = {"u": [("Z", 0.0), ("A", 0.12), ("C", 1.0)]}
    np.testing.assert_allclose(sorted(timestamps.start_errors(hyp, ref)), [0.0, 0.01], atol=1e-12)


def test_decode_writes_the_ctm_and_scores_it(tiny, tmp_path, monkeypatch, capsys):  # noqa: F811
    """`decode --greedy --ctm --ref-ctm` on posteriors that spell each utterance's characters,
    two frames per token and a blank after each (test_decode_ctc.spell), at stride 2."""
    from hpcsgd import model_io, outputs
    meta = {"model": {"type": "ctc", "encoder": ["stack 2"]}, "path": "stand-in",
            "tokens": {"kind": "chars", "inventory_hash": archive.inventory_hash(CHARS),
                       "symbols": CHARS}}
    spelled = {utt: posteriors(CHARS, spell(char_tokens(words))) for utt, words in TRAIN.items()}
    monkeypatch.setattr(model_io, "load_model", lambda *a, **k: (None, None, meta))
    monkeypatch.setattr(model_io, "check_archive", lambda *a: None)
    monkeypatch.setattr(outputs, "ctc_posteriors",
                        lambda *a, **k: ([(u, spelled[u]) for u in TRAIN], 0.01), raising=False)
    ref = tmp_path / "ref.ctm"      # u1 "AB C": AB at 0.02 s, C at 0.20 s; u6 "AB" at 0.02 s
    ref.write_text("u1 1 0.05 0.2 AB\nu1 1 0.20 0.1 C\nu6 1 0.00 0.3 AB\n")
    out = str(tmp_path / "greedy")
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--greedy", "--ctm",
                     "--ref-ctm", str(ref), "--out", out]) == 0
    printed = capsys.readouterr().out
    ctm = open(os.path.join(out, "hyp.ctm")).read().splitlines()
    assert "u1 1 0.020 0.100 AB" in ctm and "u1 1 0.200 0.040 C" in ctm
    assert len(ctm) == sum(len(w.split()) for w in TRAIN.values())
    timing = json.load(open(os.path.join(out, "result.json")))["timing"]
    assert timing["words"] == 3 and timing["median_ms"] == pytest.approx(20.0)
    assert "start error against" in printed and "median 20 ms" in printed
    # a hybrid model has no emissions to time
    meta["model"] = {"type": "dnn"}
    assert cli.main(["decode", "stand-in", "--data", tiny["archive"], "--graph", tiny["phones"],
                     "--ctm"]) == 2
    assert "--ctm: word times from CTC or RNN-T emissions" in capsys.readouterr().err
