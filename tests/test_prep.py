"""hpcsgd prep: features vs a stored kaldi-native-fbank reference, the frame-label convention,
sharding by speaker, the bundled demo corpora end to end, and every kind of bad input."""
import os
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
import soundfile as sf

from data_prep import features, kaldi_dir
from data_prep.kaldi_dir import BadUtterance
from data_prep.split import deal_speakers, split_speakers
from hpcsgd.cli import main
from hpcsgd.data import archive
from hpcsgd.data.inspect import check_archive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "data_prep", "demo")
SHARED = os.path.join(os.path.dirname(REPO), "shared", "data")  # ../shared beside the repo (CI too)
REF_UTT = "000010011"


@pytest.fixture(autouse=True)
def _not_in_an_array_task(monkeypatch):
    """--shard-index defaults to $SLURM_ARRAY_TASK_ID: keep a CI job's value out of these tests."""
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)


def prep(*argv):
    return main(["prep", *map(str, argv)])


# ---------------------------------------------------------------- features

def test_fbank_matches_stored_reference():
    """tests/data/fbank40_000010011.npy: computed once by calling kaldi_native_fbank directly
    (FbankOptions: dither 0, 40 bins, snip_edges, povey, 16 kHz) on the bundled FLAC * 32768."""
    config = features.extractor_config("fbank", 40, 13, 16000)
    samples = features.read_audio(REF_UTT, os.path.join(DEMO, "so762", "flac", f"{REF_UTT}.flac"),
                                  0.0, -1.0, 16000)
    feats = features.compute(config, samples, REF_UTT)
    ref = np.load(os.path.join(REPO, "tests", "data", f"fbank40_{REF_UTT}.npy"))
    assert feats.shape == ref.shape == (1 + (len(samples) - 400) // 160, 40)
    np.testing.assert_allclose(feats, ref, rtol=0, atol=1e-4)
    assert np.isfinite(feats).all()
    assert np.array_equal(feats, features.compute(config, samples, REF_UTT))  # dither 0: deterministic
    assert samples.max() > 1.0  # int16 range, as Kaldi reads PCM


def test_mfcc_and_frame_counts():
    rng = np.random.default_rng(0)
    for sr, n in ((16000, 16000), (8000, 4003), (16000, 400), (16000, 559)):
        x = rng.normal(0, 1000, n).astype(np.float32)
        for kind, dim in (("fbank", 40), ("mfcc", 13)):
            f = features.compute(features.extractor_config(kind, 40, 13, sr), x)
            assert f.shape == (features.num_frames(n, sr), dim)
            assert f.shape[0] == 1 + (n - sr * 25 // 1000) // (sr // 100)
            assert np.isfinite(f).all()
    with pytest.raises(BadUtterance, match="shorter than one"):
        features.compute(features.extractor_config(), np.zeros(399, np.float32), "u1")


# ---------------------------------------------------------------- frame labels

IDS = {s: i for i, s in enumerate(["SIL", "A", "B"])}


def labels(entry, n, tol=3, fmt="ctm"):
    return kaldi_dir.frame_labels("u1", fmt, entry, IDS, n, 0.01, tol).tolist()


def test_ctm_written_by_kaldi_inverts_exactly():
    rng = np.random.default_rng(1)
    frames = np.repeat(rng.integers(0, 3, 30), rng.integers(1, 9, 30))
    # Kaldi's CTM from a frame alignment: start = first frame * shift, dur = frames * shift
    segs, start = [], 0
    for run_end in list(np.flatnonzero(np.diff(frames)) + 1) + [len(frames)]:
        segs.append((start * 0.01, start * 0.01 + (run_end - start) * 0.01, "SIL A B".split()[frames[start]]))
        start = run_end
    assert labels(segs, len(frames)) == frames.tolist()


def test_frame_labels_as_time_segments_map_back_to_the_same_frames():
    """Speed perturbation divides an alignment's times by f; a frame alignment goes through its
    runs in seconds, which the segment convention maps back exactly."""
    rng = np.random.default_rng(2)
    frames = ["SIL A B".split()[k] for k in np.repeat(rng.integers(0, 3, 40), rng.integers(1, 7, 40))]
    segs = kaldi_dir.time_segments("frames", frames, 0.01)
    assert all(a < b for a, b, _ in segs) and segs[-1][1] == pytest.approx(len(frames) * 0.01)
    assert labels(segs, len(frames)) == labels(frames, len(frames), fmt="frames")


def test_segment_convention_rounding_gaps_overlaps_tolerance():
    assert labels([(0.0, 0.02, "SIL"), (0.02, 0.05, "A")], 5) == [0, 0, 1, 1, 1]
    assert labels([(0.0, 0.024, "SIL"), (0.024, 0.05, "A")], 5) == [0, 0, 1, 1, 1]  # 2.4 -> 2
    assert labels([(0.0, 0.035, "SIL"), (0.035, 0.05, "A")], 5) == [0, 0, 0, 0, 1]  # half up: 3.5 -> 4
    assert labels([(0.0, 0.02, "SIL"), (0.04, 0.05, "A")], 5) == [0, 0, 0, 0, 1]    # gap 2: previous
    assert labels([(0.02, 0.05, "A")], 5) == [1, 1, 1, 1, 1]                       # leading gap
    assert labels([(0.0, 0.03, "SIL"), (0.02, 0.05, "A")], 5) == [0, 0, 0, 1, 1]    # overlap: earlier wins
    assert labels([(0.0, 0.05, "A")], 7) == [1] * 7                                # pad with last label
    assert labels([(0.0, 0.05, "A")], 3) == [1] * 3                                # truncate
    with pytest.raises(BadUtterance, match="gap of 4 frames"):
        labels([(0.0, 0.02, "SIL"), (0.06, 0.08, "A")], 8)
    with pytest.raises(BadUtterance, match="overlaps"):
        labels([(0.0, 0.06, "SIL"), (0.01, 0.08, "A")], 8)
    with pytest.raises(BadUtterance, match="features have 10 frames, alignment has 5"):
        labels([(0.0, 0.05, "A")], 10)
    with pytest.raises(BadUtterance, match="'Q'"):
        labels([(0.0, 0.05, "Q")], 5)
    assert labels(["A", "B", "B"], 4, fmt="frames") == [1, 2, 2, 2]


# ---------------------------------------------------------------- speaker partitions

def test_split_and_deal_by_speaker():
    spk = [f"s{i:02d}" for i in range(20)]
    train, cv = split_speakers(spk, 4, seed=3)
    assert len(cv) == 4 and not set(train) & set(cv) and sorted(train + cv) == spk
    assert split_speakers(reversed(spk), 4, seed=3) == (train, cv)
    assert split_speakers(spk, 4, seed=4) != (train, cv)
    weights = {s: 10 + i * 7 % 13 for i, s in enumerate(spk)}
    shards = deal_speakers(weights, 3)
    assert sorted(s for sh in shards for s in sh) == spk
    loads = [sum(weights[s] for s in sh) for sh in shards]
    assert max(loads) - min(loads) <= max(weights.values())
    assert deal_speakers(weights, 3) == shards


# ---------------------------------------------------------------- the bundled demo, end to end

def read_all(path):
    """Every dataset of a shard by its path (tokens/chars/ids ...)."""
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()])
                     if isinstance(obj, h5py.Dataset) else None)
    return out


def test_demo_corpora_prep_and_inspect(tmp_path, capsys):
    so = tmp_path / "so762"
    assert prep(f"{DEMO}/so762", so, "--alignments", f"{DEMO}/so762/phones.ctm",
                "--labels", f"{DEMO}/so762/labels.txt", "--num-shards", 3, "--jobs", 2) == 0
    out = capsys.readouterr().out
    assert "utterances/s" in out and "real-time factor" in out
    problems, summary = check_archive(str(so))
    assert problems == [] and summary["utterances"] == 200 and summary["speakers"] == 40
    assert main(["inspect", str(so)]) == 0
    assert "SIL" in capsys.readouterr().out
    index = archive.read_index(str(so))
    assert len(index["shards"]) == 3 and index["feature_dim"] == 40
    spk_seen = set()
    for entry in index["shards"]:
        d = read_all(so / entry["file"])
        spk = [s.decode() for s in d["spk_ids"]]
        assert not spk_seen & set(spk)  # a speaker lives in exactly one shard
        spk_seen |= set(spk)
        for i in range(len(spk)):       # Kaldi CMVN stats recomputed from the stored features
            rows = np.concatenate([d["feats"][a:b] for u, (a, b) in
                                   enumerate(zip(d["utt_offsets"][:-1], d["utt_offsets"][1:]))
                                   if d["utt_spk"][u] == i]).astype(np.float64)
            np.testing.assert_allclose(d["cmvn_stats"][i, 0, :40], rows.sum(0), rtol=1e-9)
            np.testing.assert_allclose(d["cmvn_stats"][i, 1, :40], (rows ** 2).sum(0), rtol=1e-9)
            assert d["cmvn_stats"][i, 0, 40] == len(rows) and d["cmvn_stats"][i, 1, 40] == 0
        assert np.array_equal(d["label_counts"], np.bincount(d["labels"], minlength=40))
    # the reference utterance's features are stored unchanged
    meta = {e["file"]: archive.read_shard_meta(so / e["file"]) for e in index["shards"]}
    name = next(n for n, m in meta.items() if REF_UTT in m["utt_ids"])
    u = meta[name]["utt_ids"].index(REF_UTT)
    a, b = meta[name]["utt_offsets"][u:u + 2]
    ref = np.load(os.path.join(REPO, "tests", "data", f"fbank40_{REF_UTT}.npy"))
    np.testing.assert_allclose(read_all(so / name)["feats"][a:b], ref, atol=1e-4)

    fs = tmp_path / "fsdd"
    assert prep(f"{DEMO}/fsdd", fs, "--alignments", f"{DEMO}/fsdd/phn", "--labels",
                f"{DEMO}/fsdd/labels.txt", "--sample-rate", 8000, "--num-shards", 2, "--jobs", 1) == 0
    captured = capsys.readouterr()
    assert "6_george_19" in captured.err and "6_nicolas_5" in captured.err
    assert "no alignment 2 (total 2 of 42)" in captured.out
    problems, summary = check_archive(str(fs))
    assert problems == [] and summary["utterances"] == 40 and summary["speakers"] == 4
    assert summary["sample_rate"] == 8000


def test_cv_split_and_array_tasks_match_local_run(tmp_path, capsys):
    args = [f"{DEMO}/fsdd", "--alignments", f"{DEMO}/fsdd/phn", "--sample-rate", 8000,
            "--cv-speakers", 1, "--seed", 7, "--num-shards", 2, "--jobs", 1]
    local, array = tmp_path / "local", tmp_path / "array"
    assert prep(args[0], local, *args[1:]) == 0
    for i in (0, 1):  # one Slurm array task per shard, then the index step
        assert prep(args[0], array, *args[1:], "--shard-index", i) == 0
    assert not os.path.exists(array / "train" / "index.json")
    assert prep("--write-index", array) == 0
    for part in ("train", "cv"):
        a, b = archive.read_index(str(local / part)), archive.read_index(str(array / part))
        assert [s["frames"] for s in a["shards"]] == [s["frames"] for s in b["shards"]]
        for s in a["shards"]:
            assert np.array_equal(read_all(local / part / s["file"])["feats"],
                                  read_all(array / part / s["file"])["feats"])
        assert check_archive(str(local / part))[0] == []
    spk = lambda p: {s for e in archive.read_index(str(p))["shards"]
                     for s in archive.read_shard_meta(p / e["file"])["spk_ids"]}
    assert len(spk(local / "cv")) == 1 and not spk(local / "cv") & spk(local / "train")
    # labels.txt built from the alignments (no --labels): sorted symbols
    symbols = archive.read_inventory(local / "train" / "labels.txt")
    assert symbols == sorted(symbols) and "SIL" in symbols
    # the index step refuses while a shard is missing
    os.unlink(array / "train" / "shard-00001.h5")
    assert prep("--write-index", array) == 2
    assert "shard-00001.h5" in capsys.readouterr().err


# ---------------------------------------------------------------- bad input, generated corpora

def make_corpus(root, n=20, sr=16000, seconds=0.5, fmt="frames"):
    """n utterances of noise, 2 speakers, frame-label ('frames' or 'ctm') alignments."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "wav").mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    wav, spk, ali = [], [], []
    for i in range(n):
        utt = f"spk{i % 2}-u{i:02d}"
        x = rng.normal(0, 0.1, int(sr * seconds)).astype(np.float32)
        sf.write(root / "wav" / f"{utt}.wav", x, sr, subtype="PCM_16")
        wav.append(f"{utt} wav/{utt}.wav")
        spk.append(f"{utt} spk{i % 2}")
        t = features.num_frames(len(x), sr)
        if fmt == "frames":
            ali.append(f"{utt} " + " ".join(["SIL"] * (t // 2) + ["A"] * (t - t // 2)))
        else:
            ali += [f"{utt} 1 0.00 {t // 2 / 100:.2f} SIL", f"{utt} 1 {t // 2 / 100:.2f} "
                    f"{(t - t // 2) / 100:.2f} A"]
    (root / "wav.scp").write_text("\n".join(wav) + "\n")
    (root / "utt2spk").write_text("\n".join(spk) + "\n")
    (root / "ali.txt").write_text("\n".join(ali) + "\n")
    (root / "labels.txt").write_text("SIL 0\nA 1\nB 2\n")
    return root


def run_bad(tmp_path, capsys, *extra, fraction=None):
    out = tmp_path / "out"
    argv = [tmp_path / "data", out, "--alignments", tmp_path / "data" / "ali.txt", "--labels",
            tmp_path / "data" / "labels.txt", "--jobs", 1, *extra]
    if fraction is not None:
        argv += ["--max-bad-fraction", fraction]
    rc = prep(*argv)
    captured = capsys.readouterr()
    return rc, captured.out + captured.err, out


BAD_CASES = {
    # name: (how to break utterance spk0-u04, reason printed, text naming the culprit)
    "missing audio": (lambda d: os.unlink(d / "wav" / "spk0-u04.wav"), "unreadable audio",
                      "spk0-u04.wav: no such file"),
    "unreadable audio": (lambda d: (d / "wav" / "spk0-u04.wav").write_bytes(b"RIFF garbage" * 10),
                         "unreadable audio", "spk0-u04"),
    # not libsndfile's "Format not recognised", and not "no such file" for a directory
    "empty file": (lambda d: (d / "wav" / "spk0-u04.wav").write_bytes(b""), "empty audio",
                   "spk0-u04.wav: empty file (0 bytes)"),
    "directory": (lambda d: (os.unlink(d / "wav" / "spk0-u04.wav"),
                             os.mkdir(d / "wav" / "spk0-u04.wav")), "unreadable audio",
                  "spk0-u04.wav: a directory, not an audio file"),
    "sample rate": (lambda d: sf.write(d / "wav" / "spk0-u04.wav", np.zeros(4000), 8000),
                    "sample rate", "sample rate 8000 Hz, expected --sample-rate 16000"),
    "empty audio": (lambda d: sf.write(d / "wav" / "spk0-u04.wav", np.zeros(0), 16000),
                    "empty audio", "spk0-u04: 0 samples"),
    "short audio": (lambda d: sf.write(d / "wav" / "spk0-u04.wav", np.zeros(300), 16000),
                    "empty audio", "spk0-u04: 300 samples"),
    "no alignment": (lambda d: _edit(d / "ali.txt", lambda l: not l.startswith("spk0-u04")),
                     "no alignment", "spk0-u04"),
    "unknown label": (lambda d: _edit(d / "ali.txt", lambda l: l.replace("spk0-u04 SIL", "spk0-u04 ZZ")),
                      "unknown label", "spk0-u04: label 'ZZ'"),
    "length mismatch": (lambda d: _edit(d / "ali.txt", lambda l: l + " A A A A A A" if
                                        l.startswith("spk0-u04") else l),
                        "length mismatch", "spk0-u04: features have 48 frames, alignment has 54"),
    "NaN/Inf features": (lambda d: sf.write(d / "wav" / "spk0-u04.wav",
                                            np.full(8000, np.nan, np.float32), 16000, subtype="FLOAT"),
                         "NaN/Inf features", "spk0-u04: NaN/Inf"),
}


def _edit(path, fn):
    lines = path.read_text().splitlines()
    out = []
    for line in lines:
        r = fn(line)
        if r is True:
            out.append(line)
        elif r:
            out.append(r)
    path.write_text("\n".join(out) + "\n")


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_utterance_is_skipped_named_and_counted(tmp_path, capsys, case):
    breaker, reason, culprit = BAD_CASES[case]
    data = make_corpus(tmp_path / "data")
    breaker(data)
    rc, text, out = run_bad(tmp_path, capsys, fraction=0.1)  # 1 of 20 bad: tolerated
    assert rc == 0, text
    assert culprit in text and f"{reason} 1 (total 1 of 20)" in text
    assert check_archive(str(out))[1]["utterances"] == 19
    rc, text, out = run_bad(tmp_path, capsys, fraction=0.01)  # now too many: fail, no index
    assert rc == 2 and "more than --max-bad-fraction" in text
    assert not os.path.exists(out / "index.json")


def write_text(data, n=20):
    """Transcripts of make_corpus's utterances, two letters A and B."""
    words = lambda i: " ".join(["AB"] + ["BA", "ABBA"] * (i % 3))   # noqa: E731
    (data / "text").write_text("".join(f"spk{i % 2}-u{i:02d} {words(i)}\n" for i in range(n)))
    (data / "lexicon.txt").write_text("AB A B\nBA B A\nABBA A B B A\n")


HELD_OUT = split_speakers(["spk0", "spk1"], 1, 0)[1][0]   # the speaker --cv-speakers 1 holds out
HELD_UTT = f"{HELD_OUT}-u0{4 if HELD_OUT == 'spk0' else 5}"

TEXT_CASES = {
    # name: (how to break one utterance's text, options, reason printed, text naming the culprit)
    "no transcript": (lambda d: _edit(d / "text", lambda l: not l.startswith("spk0-u04")),
                      ["--tokens", "chars"], "no transcript", "spk0-u04: no transcript in"),
    "empty transcript": (lambda d: _edit(d / "text", lambda l: "spk0-u04" if
                                         l.startswith("spk0-u04") else l),
                         ["--tokens", "phones,chars"], "empty transcript",
                         "spk0-u04: empty transcript in"),
    "unknown character": (lambda d: _edit(d / "text", lambda l: l + " AQB" if
                                          l.startswith(HELD_UTT) else l),
                          ["--tokens", "chars", "--cv-speakers", 1], "unknown token",
                          f"{HELD_UTT}: character 'Q' (in 'AQB') is not in the chars inventory"),
    "unknown piece": (lambda d: _edit(d / "text", lambda l: l + " AQB" if
                                      l.startswith(HELD_UTT) else l),
                      ["--tokens", "bpe", "--bpe-size", 8, "--cv-speakers", 1], "unknown token",
                      f"{HELD_UTT}: 'Q' is not in the bpe pieces"),
    "no pronunciation": (lambda d: _edit(d / "text", lambda l: l + " QQ" if
                                         l.startswith("spk0-u04") else l),
                         ["--lexicon", "LEXICON", "--tokens", "phones"], "no pronunciation",
                         "spk0-u04: word 'QQ' has no pronunciation"),
}


@pytest.mark.parametrize("case", sorted(TEXT_CASES))
def test_bad_transcript_is_skipped_named_and_counted(tmp_path, capsys, case):
    breaker, options, reason, culprit = TEXT_CASES[case]
    data = make_corpus(tmp_path / "data")
    write_text(data)
    breaker(data)
    options = [str(data / "lexicon.txt") if o == "LEXICON" else o for o in options]
    for fraction, ok in ((0.1, True), (0.01, False)):
        argv = [data, tmp_path / "out", "--labels", data / "labels.txt", "--jobs", 1,
                "--max-bad-fraction", fraction, *options]
        if "--lexicon" not in options:   # else a text-only corpus: phones from the lexicon
            argv += ["--alignments", data / "ali.txt"]
        rc = prep(*argv)
        captured = capsys.readouterr()
        text = captured.out + captured.err
        if ok:
            assert rc == 0, text
            assert culprit in text and f"{reason} 1 (total 1 of 20)" in text, text
        else:
            assert rc == 2 and "more than --max-bad-fraction" in text


@pytest.mark.parametrize("table", ["wav.scp", "utt2spk"])
def test_duplicate_ids_are_fatal(tmp_path, capsys, table):
    data = make_corpus(tmp_path / "data", n=4)
    with open(data / table, "a") as f:
        f.write("spk1-u01 x\n")
    rc, text, out = run_bad(tmp_path, capsys)
    assert rc == 2 and f"{table}:5: duplicate utterance/recording id 'spk1-u01'" in text
    assert not os.path.exists(out / "index.json")


def test_piped_wav_scp_rejected(tmp_path, capsys):
    data = make_corpus(tmp_path / "data", n=4)
    (data / "wav.scp").write_text((data / "wav.scp").read_text() + "spk0-u09 sox x.wav -t wav - |\n")
    rc, text, _ = run_bad(tmp_path, capsys)
    assert rc == 2 and "spk0-u09: piped command" in text


def test_out_that_would_write_into_the_input_is_refused(tmp_path, capsys):
    """OUT = DATA_DIR without --labels rewrote the corpus's labels.txt in another id order (a
    later --labels DATA_DIR/labels.txt then meant other classes): refused before anything is
    written, naming both paths; so are a symbolic link to DATA_DIR, a DATA_DIR that is
    OUT/train of --cv-speakers, and an input file in OUT under a name prep writes. An OUT
    inside DATA_DIR that overwrites nothing is fine."""
    data = make_corpus(tmp_path / "data", n=4)
    (data / "labels.txt").write_text("B 0\nA 1\nSIL 2\n")   # not the sorted order prep builds
    before = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    os.symlink(data, tmp_path / "link")
    (tmp_path / "outer").mkdir()
    os.symlink(data, tmp_path / "outer" / "train")   # OUT/train of --cv-speakers is DATA_DIR
    (tmp_path / "archive").mkdir()
    (tmp_path / "archive" / "labels.txt").write_text("SIL 0\nA 1\nB 2\n")
    refused = {   # OUT, options -> what the one-line error names
        "same": (data, [], [f"OUT {data} is the input DATA_DIR {data}"]),
        "link": (tmp_path / "link", [], [f"OUT {tmp_path / 'link'} is the input DATA_DIR"]),
        "dots": (data / "wav" / "..", [], ["is the input DATA_DIR"]),
        "cv part": (tmp_path / "outer", ["--cv-speakers", 1, "--labels", data / "labels.txt"],
                    [f"OUT {tmp_path / 'outer'}/train", f"is the input DATA_DIR {data}"]),
    }
    for case, (out, options, named) in refused.items():
        rc = prep(data, out, "--alignments", data / "ali.txt", "--jobs", 1, *options)
        err = capsys.readouterr().err
        assert rc == 2 and all(n in err for n in named) and len(err.splitlines()) == 1, (case, err)
        assert "never writes into its input" in err
    # the corpus is as it was: no file changed, none added
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file()} == before
    rc = prep(data, tmp_path / "archive", "--alignments", data / "ali.txt", "--labels",
              tmp_path / "archive" / "labels.txt", "--jobs", 1)
    err = capsys.readouterr().err
    labels = tmp_path / "archive" / "labels.txt"
    assert rc == 2 and f"would overwrite the input --labels {labels}" in err
    assert os.listdir(tmp_path / "archive") == ["labels.txt"]
    assert prep(data, data / "archive", "--alignments", data / "ali.txt", "--jobs", 1) == 0
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file() and "archive" not in
            p.parts} == before
    assert check_archive(str(data / "archive"))[0] == []


def test_ctm_segments_file_and_built_numeric_inventory(tmp_path, capsys):
    data = make_corpus(tmp_path / "data", n=4, seconds=1.0, fmt="ctm")
    rc, text, out = run_bad(tmp_path, capsys)
    assert rc == 0, text
    # Kaldi `segments`: cut two utterances out of one recording
    (data / "segments").write_text("spk0-a spk0-u00 0.0 0.5\nspk0-b spk0-u00 0.5 -1\n")
    (data / "utt2spk").write_text("spk0-a spk0\nspk0-b spk0\n")
    (data / "ali.txt").write_text("spk0-a " + " ".join(["1"] * 48) + "\nspk0-b " +
                                  " ".join(["0"] * 20 + ["3"] * 28) + "\n")
    out2 = tmp_path / "seg"
    assert prep(data, out2, "--alignments", data / "ali.txt", "--jobs", 1) == 0
    assert archive.read_inventory(out2 / "labels.txt") == ["0", "1", "2", "3"]  # ids 0..max
    d = read_all(out2 / "shard-00000.h5")
    assert d["utt_offsets"].tolist() == [0, 48, 96]
    assert d["labels"][:48].tolist() == [1] * 48 and d["labels"][48:68].tolist() == [0] * 20
    assert d["label_counts"].tolist() == [20, 48, 0, 28]


# ---------------------------------------------------------------- killed midway

def test_sigkill_midway_leaves_no_partial_shard_or_index(tmp_path):
    full = os.path.join(SHARED, "so762_dev")
    src = full if os.path.isdir(full) else os.path.join(DEMO, "so762")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "hpcsgd.cli", "prep", src, str(out), "--alignments",
           os.path.join(src, "phones.ctm"), "--labels", os.path.join(src, "labels.txt"),
           "--num-shards", "8", "--jobs", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stdout:  # kill right after the first shard lands, while others are in flight
        if "wrote" in line:
            break
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    names = os.listdir(out)
    assert "index.json" not in names
    shards = [n for n in names if n.endswith(".h5")]
    assert 1 <= len(shards) < 8
    for n in shards:  # whatever has the final name is complete
        assert archive.validate_shard(str(out / n)) == []
    assert all(n.endswith((".h5", ".report.json", "labels.txt")) or n.startswith("tokens_") or
               ".tmp." in n for n in names)
    # a re-run cleans the stale temp files and completes
    cmd[cmd.index(src)] = os.path.join(DEMO, "so762")
    cmd[cmd.index("--alignments") + 1] = os.path.join(DEMO, "so762", "phones.ctm")
    subprocess.run(cmd, check=True, capture_output=True)
    assert not [n for n in os.listdir(out) if ".tmp." in n]
    assert check_archive(str(out))[0] == []


def test_ctrl_c_stops_the_workers_with_one_line_and_exit_130(tmp_path):
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) after the first shard:
    one line instead of the pool's ~34 lines of tracebacks, exit 130, no process of the
    group left, only complete files in OUT. 3000 copies of a bundled recording, 150 shards:
    about 30 s of work, so that a loaded machine's late delivery still interrupts it.
    With --jobs 1 the extraction runs in prep's own process, whose Ctrl-C must stay on."""
    handler = signal.getsignal(signal.SIGINT)
    small = make_corpus(tmp_path / "small", n=4)
    assert prep(small, tmp_path / "small_out", "--alignments", small / "ali.txt", "--jobs", 1) == 0
    assert signal.getsignal(signal.SIGINT) is handler
    flac = os.path.join(DEMO, "so762", "flac", f"{REF_UTT}.flac")
    data = tmp_path / "data"
    data.mkdir()
    utts = [f"spk{i % 150:03d}-u{i:04d}" for i in range(3000)]
    (data / "wav.scp").write_text("".join(f"{u} {flac}\n" for u in utts))
    (data / "utt2spk").write_text("".join(f"{u} {u[:6]}\n" for u in utts))
    (data / "text").write_text("".join(f"{u} A B\n" for u in utts))
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "hpcsgd.cli", "prep", str(data), str(out),
                             "--num-shards", "150", "--jobs", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, cwd=REPO,
                            # a job started in the background by a non-interactive shell ignores
                            # SIGINT, and an ignored signal stays ignored across exec: give prep
                            # a terminal's default, as an interactive shell does
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    for line in proc.stdout:
        if "wrote" in line:
            break
    os.killpg(proc.pid, signal.SIGINT)
    try:
        rest, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    assert proc.returncode == 130, rest + err
    assert err.splitlines() == [err.strip()] and "prep: interrupted" in err, err
    assert f"nothing half-written in {out}" in err
    with pytest.raises(ProcessLookupError):   # the workers ended with it
        os.killpg(proc.pid, 0)
    names = os.listdir(out)
    assert "index.json" not in names and not [n for n in names if ".tmp." in n]
    shards = [n for n in names if n.endswith(".h5")]
    assert 1 <= len(shards) < 150
    for n in shards:
        assert archive.validate_shard(str(out / n)) == []


@pytest.mark.skipif(not os.path.isdir(os.path.join(SHARED, "fsdd_dev")), reason="needs ../shared/data")
def test_full_fsdd_six_missing_alignments(tmp_path, capsys):
    src = os.path.join(SHARED, "fsdd_dev")
    assert prep(src, tmp_path / "fs", "--alignments", f"{src}/phn", "--labels", f"{src}/labels.txt",
                "--sample-rate", 8000, "--num-shards", 4, "--jobs", 2) == 0
    assert "no alignment 6 (total 6 of 2000)" in capsys.readouterr().out
    problems, summary = check_archive(str(tmp_path / "fs"), check_values=False)
    assert problems == [] and summary["utterances"] == 1994


def test_prep_sbatch_runs_array_tasks_then_index(tmp_path):
    """bash -n, then the script itself with stand-ins for srun/sbatch: 2 array tasks + index step."""
    path = os.path.join(REPO, "jobs", "prep.sbatch")
    subprocess.run(["bash", "-n", path], check=True)
    text = open(path).read()
    assert "#SBATCH --array=" in text and "afterok" in text and "--write-index" in text
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\nexec "$@"\n')
    (fake / "sbatch").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/sbatch.log\necho 123\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    venv = os.path.dirname(os.path.dirname(sys.executable))
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "VENV": venv,
           "DATA": os.path.join(DEMO, "fsdd"), "ALI": os.path.join(DEMO, "fsdd", "phn"),
           "OUT": str(tmp_path / "out"), "NUM_SHARDS": "2", "SAMPLE_RATE": "8000",
           "SLURM_CPUS_PER_TASK": "1"}
    env.pop("SLURM_ARRAY_TASK_ID", None)
    subprocess.run(["bash", path], env=env, check=True, cwd=tmp_path, capture_output=True)
    log = (tmp_path / "sbatch.log").read_text().splitlines()
    assert "--array=0-1" in log[0] and "--dependency=afterok:123" in log[1] and "STEP=index" in log[1]
    for i in ("0", "1"):
        subprocess.run(["bash", path], env={**env, "SLURM_ARRAY_TASK_ID": i}, check=True, cwd=tmp_path)
    assert not (tmp_path / "out" / "index.json").exists()
    subprocess.run(["bash", path], env={**env, "STEP": "index", "SLURM_ARRAY_TASK_ID": "0"},
                   check=True, cwd=tmp_path)
    assert check_archive(str(tmp_path / "out"))[0] == []
