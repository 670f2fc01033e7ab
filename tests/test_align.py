"""CTC forced alignment (hpcsgd/decode/kernels_align.py, hpcsgd/decode/align.py): the float64
reference against every path of small cases, the Numba kernel against the reference, and
`hpcsgd align` end to end on a CTC model trained on the bundled so762 demo corpus, its CTM read
back by `hpcsgd prep --alignments` as frame labels."""
import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, run_train
from hpcsgd.decode import align
from hpcsgd.decode.kernels_align import NO_PATH, ctc_viterbi, ctc_viterbi_reference


def collapse(path, blank=0):
    """A frame path -> the tokens it emits (repeats merged, blanks dropped)."""
    out, prev = [], blank
    for k in path:
        if k != blank and k != prev:
            out.append(int(k))
        prev = k
    return out


def brute_force(lp, ids):
    """(the best score, the set of best paths) over every label sequence of len(lp) frames
    that collapses to ids: CTC's paths, enumerated."""
    T, V = lp.shape
    best, paths = -np.inf, set()
    for path in itertools.product(range(V), repeat=T):
        if collapse(path) != list(ids):
            continue
        score = float(np.sum(lp[np.arange(T), path], dtype=np.float64))
        if score > best + 1e-12:
            best, paths = score, {path}
        elif abs(score - best) <= 1e-12:
            paths.add(path)
    return best, paths


def random_lp(rng, T, V):
    z = rng.standard_normal((T, V)) * 2
    return (z - np.log(np.exp(z).sum(1, keepdims=True))).astype(np.float32)


@pytest.mark.parametrize("ids", [[1], [1, 2], [2, 2], [1, 2, 1], [3, 3, 3], []])
def test_reference_finds_the_best_of_every_path(ids):
    rng = np.random.default_rng(len(ids) * 7 + sum(ids))
    for T in range(1, 7):
        lp = random_lp(rng, T, 4)
        best, paths = brute_force(lp, ids)
        path, score = ctc_viterbi_reference(lp, ids)
        if best == -np.inf:        # too few frames for the tokens and their repeats
            assert score == -np.inf and (path == NO_PATH).all()
            continue
        # the sum along its path in float64 of the float32 inputs: exact up to the order
        assert score == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert tuple(path.tolist()) in paths and collapse(path) == list(ids)


def test_kernel_equals_the_reference():
    """The same recursion in float64 with the same tie order: the same path and score, bit for
    bit, on random log-posteriors of realistic sizes; repeats, ties and an infeasible case."""
    rng = np.random.default_rng(5)
    for T, U, V in ((1, 1, 3), (50, 10, 8), (200, 60, 40), (400, 100, 257), (12, 6, 3)):
        lp = random_lp(rng, T, V)
        ids = rng.integers(1, V, U)
        if T == 12:
            ids[:] = 1            # six equal tokens need 11 frames: feasible, one path fits
        want = ctc_viterbi_reference(lp, ids)
        got = ctc_viterbi(lp, ids.astype(np.int64), 0)
        np.testing.assert_array_equal(got[0], want[0])
        assert got[1] == want[1]
    flat = np.full((6, 3), np.log(1 / 3), np.float32)          # every path ties
    for ids in ([1, 2], [2, 2]):
        np.testing.assert_array_equal(ctc_viterbi(flat, np.array(ids), 0)[0],
                                      ctc_viterbi_reference(flat, ids)[0])
    path, score = ctc_viterbi(flat[:2], np.array([1, 1]), 0)   # 1 _ 1 needs 3 frames
    assert score == -np.inf and (path == NO_PATH).all()


def test_segments_are_runs_or_cover_every_frame():
    path = np.array([0, 0, 3, 3, 0, 5, 0, 0, 3, 0, 0])
    assert align.segments(path, 0, False) == [(3, 2, 4), (5, 5, 6), (3, 8, 9)]
    assert align.segments(path, 0, True) == [(0, 0, 2), (3, 2, 5), (5, 5, 8), (3, 8, 9),
                                             (0, 9, 11)]
    assert align.segments(np.array([4, 0, 4]), 0, True) == [(4, 0, 2), (4, 2, 3)]
    assert align.segments(np.array([0, 0]), 0, True) == [(0, 0, 2)]


def hpcsgd(*argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "hpcsgd.cli", *argv], capture_output=True,
                          text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def ctc_run(demo_tokens, tmp_path_factory):
    """A phone CTC model (stack 3, a BLSTM) trained briefly on the demo archive: its
    posteriors are a real model's, whatever it has learnt."""
    run = str(tmp_path_factory.mktemp("align") / "run")
    proc = run_train(1, [f"data.train={demo_tokens}/train", "model.type=ctc",
                         "model.encoder=[stack 3, blstm 32]", "train.minibatch=4000",
                         "train.epochs=1", "optim.type=adam", "optim.lr=1e-6",
                         "optim.momentum_tc=0", "schedule.type=constant",
                         f"train.run_dir={run}"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


def test_align_writes_the_references_on_the_models_best_paths(ctc_run, demo_tokens, tmp_path):
    """`hpcsgd align` = the reference Viterbi on `hpcsgd infer`'s log-posteriors of the same
    model: every utterance's CTM spells its reference tokens, at the model's 30 ms frames; with
    --fill the CTM covers every frame, and prep reads it back as the archive's frame labels."""
    import h5py
    from hpcsgd.decode import mkgraph
    cv = f"{demo_tokens}/cv"
    runs_ctm, fill_ctm = str(tmp_path / "runs.ctm"), str(tmp_path / "fill.ctm")
    for ctm, extra in ((runs_ctm, []), (fill_ctm, ["--fill"])):
        proc = hpcsgd("align", ctc_run, "--data", cv, "--ctm", ctm, *extra)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    symbols, refs = mkgraph.archive_tokens(cv, "phones")
    assert f"align: {len(refs)} of {len(refs)} utterances" in proc.stdout
    proc = hpcsgd("infer", ctc_run, "--data", cv, "--out", str(tmp_path / "lp"), "--output",
                  "logpost", "--format", "hdf5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with h5py.File(tmp_path / "lp.h5") as f:
        values, offsets = f["values"][:], f["utt_offsets"][:]
        utts = [u.decode() if isinstance(u, bytes) else u for u in f["utt_ids"][:]]
    lines = {}
    for ctm in (runs_ctm, fill_ctm):
        for line in open(ctm):
            utt, _, start, dur, sym = line.split()
            lines.setdefault((ctm, utt), []).append((round(float(start) / 0.03),
                                                     round(float(dur) / 0.03), sym))
    assert sorted(utts) == sorted(utt for utt, _ in refs)
    for utt, ids in refs:
        u = utts.index(utt)
        lp = values[offsets[u]:offsets[u + 1]]
        path, _ = ctc_viterbi_reference(lp, ids)
        runs = [(a, b - a, symbols[k]) for k, a, b in align.segments(path, 0, False)]
        assert lines[(runs_ctm, utt)] == runs
        assert [s for *_, s in runs] == [symbols[i] for i in ids]
        filled = lines[(fill_ctm, utt)]
        assert filled[0][0] == 0 and sum(d for _, d, _ in filled) == len(lp)
        assert all(a + d == b for (a, d, _), (b, _, _) in zip(filled, filled[1:]))
        assert [s for *_, s in filled if s != "<blk>"] == [symbols[i] for i in ids]
    # the filled CTM as frame labels: prep the demo corpus's CV speakers with it
    demo = os.path.join(REPO, "data_prep", "demo", "so762")
    out = str(tmp_path / "relabelled")
    proc = hpcsgd("prep", demo, out, "--alignments", fill_ctm, "--cv-speakers", "8",
                  "--tokens", "phones", "--num-shards", "1", "--jobs", "1",
                  "--max-bad-fraction", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    index = json.load(open(os.path.join(out, "cv", "index.json")))
    assert index["frame_labels"] and index["total_utterances"] == len(refs)
    assert index["num_labels"] == len({line.split()[4] for line in open(fill_ctm)})


def test_align_refuses_what_it_cannot_align(ctc_run, demo_tokens, tmp_path):
    proc = hpcsgd("align", ctc_run, "--data", f"{demo_tokens}/cv", "--ctm",
                  str(tmp_path / "no" / "such.ctm"))
    assert proc.returncode == 2 and "no directory" in proc.stderr, proc.stderr
    hybrid = str(tmp_path / "hybrid")
    proc = run_train(1, [f"data.train={demo_tokens}/train", "model.hidden=[16]",
                         "train.epochs=1", "train.stop_after_frames=2000",
                         f"train.run_dir={hybrid}"], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = hpcsgd("align", hybrid, "--data", f"{demo_tokens}/cv", "--ctm", str(tmp_path / "h"))
    assert proc.returncode == 2 and "is a dnn model" in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "h")
