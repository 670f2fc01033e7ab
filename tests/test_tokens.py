"""hpcsgd prep's transcripts and token sequences (data_prep/tokens.py) on the bundled real
speech: phones are the decoder's references, chars spell the text, text-only corpora (phones
from CMUdict), BPE learnt from the training speakers only and deterministically, speed
perturbation, and --token-inventory."""
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import soundfile as sf

from data_prep import features, tokens
from data_prep.split import split_speakers
from hpcsgd.cli import main
from hpcsgd.data import archive
from hpcsgd.data.inspect import check_archive
from hpcsgd.decode import lexicon, mkgraph

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "data_prep", "demo")
SO, FSDD = os.path.join(DEMO, "so762"), os.path.join(DEMO, "fsdd")
FSDD_SPEAKERS = ["george", "jackson", "lucas", "nicolas"]


@pytest.fixture(autouse=True)
def _not_in_an_array_task(monkeypatch):
    """--shard-index defaults to $SLURM_ARRAY_TASK_ID: keep a CI job's value out of these tests."""
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)


def prep(*argv):
    return main(["prep", *map(str, argv)])


def by_utt(archive_dir, kind=None):
    """{utt: token symbols of `kind`} (or {utt: transcript} without a kind) over all shards."""
    out = {}
    symbols = archive.read_tokens(str(archive_dir), kind) if kind else None
    for entry in archive.read_index(str(archive_dir))["shards"]:
        path = os.path.join(archive_dir, entry["file"])
        utts = archive.read_shard_meta(path)["utt_ids"]
        if kind is None:
            out.update(zip(utts, archive.read_shard_text(path)))
            continue
        ids, offsets = archive.read_shard_tokens(path, kind)
        for u, utt in enumerate(utts):
            out[utt] = [symbols[i] for i in ids[offsets[u]:offsets[u + 1]]]
    return out


def frames_by_utt(archive_dir):
    out = {}
    for entry in archive.read_index(str(archive_dir))["shards"]:
        meta = archive.read_shard_meta(os.path.join(archive_dir, entry["file"]))
        out.update(zip(meta["utt_ids"], np.diff(meta["utt_offsets"]).tolist()))
    return out


def read_text_file(path):
    with open(path) as f:
        return {p[0]: " ".join(p[1:]) for p in (line.split() for line in f) if p}


def copy_data_dir(src, dst, text_edits=None):
    """A data directory reading src's audio (absolute paths) with its text lines edited:
    {utt: new words, or None to drop the line}."""
    os.makedirs(dst)
    for name in ("utt2spk", "wav.scp", "text"):
        lines = open(os.path.join(src, name)).read().splitlines()
        if name == "wav.scp":
            lines = [f"{u} {os.path.join(src, p)}" for u, p in (line.split() for line in lines)]
        if name == "text":
            edits = text_edits or {}
            lines = [line if line.split()[0] not in edits else
                     f"{line.split()[0]} {edits[line.split()[0]]}".rstrip()
                     for line in lines if edits.get(line.split()[0], "") is not None]
        with open(os.path.join(dst, name), "w") as f:
            f.write("\n".join(lines) + "\n")
    return dst


# ---------------------------------------------------------------- alignments + text (so762)

@pytest.fixture(scope="module")
def so762(tmp_path_factory):
    out = tmp_path_factory.mktemp("so762") / "archive"
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SLURM_ARRAY_TASK_ID", raising=False)
        assert prep(SO, out, "--alignments", f"{SO}/phones.ctm", "--labels", f"{SO}/labels.txt",
                    "--cv-speakers", 8, "--num-shards", 2, "--jobs", 2) == 0
    return out


@pytest.mark.parametrize("part", ["train", "cv"])
def test_phones_are_the_decoders_references(so762, part):
    """Default kinds with alignments and text: phones and chars. Phone tokens are, utterance by
    utterance, what the decoder scores hybrids against (mkgraph's segments + phone_sequence)."""
    index = archive.read_index(str(so762 / part))
    assert sorted(index["tokens"]) == ["chars", "phones"] and index["frame_labels"]
    labels = archive.read_inventory(so762 / part / "labels.txt")
    assert archive.read_tokens(str(so762 / part), "phones") == \
        ["<blk>"] + [s for s in labels if s != "SIL"]
    symbols, utts = mkgraph.archive_alignments(str(so762 / part))
    phones = by_utt(so762 / part, "phones")
    assert len(utts) == len(phones) == index["total_utterances"]
    for utt, ids, _ in utts:
        assert phones[utt] == mkgraph.phone_sequence(symbols, ids, keep_sil=False), utt
    assert index["tokens"]["phones"]["total_tokens"] == sum(len(p) for p in phones.values())


def test_chars_spell_the_text_and_share_the_training_inventory(so762):
    text = read_text_file(f"{SO}/text")
    train_text = by_utt(so762 / "train")
    inventory = archive.read_tokens(str(so762 / "train"), "chars")
    assert inventory == ["<blk>", "<space>"] + sorted({c for t in train_text.values() for c in t
                                                      if c != " "})
    for part in ("train", "cv"):   # both archives: the training speakers' inventory
        assert archive.read_tokens(str(so762 / part), "chars") == inventory
        stored = by_utt(so762 / part)
        for utt, chars in by_utt(so762 / part, "chars").items():
            assert stored[utt] == text[utt]
            assert "".join(" " if c == "<space>" else c for c in chars) == text[utt]
    problems, summary = check_archive(str(so762 / "cv"))
    assert problems == [] and summary["texts"] == (40, 0)
    assert summary["tokens"]["chars"]["too_short"] == 0


# ---------------------------------------------------------------- text only

def test_text_only_corpus_phones_from_cmudict(tmp_path, capsys):
    out = tmp_path / "so"
    assert prep(SO, out, "--labels", f"{SO}/labels.txt", "--num-shards", 2, "--jobs", 2) == 0
    assert "phones (39 + blank, from the lexicon: 0 words without" in capsys.readouterr().out
    index = archive.read_index(str(out))
    assert not index["frame_labels"] and index["has_text"]
    assert sorted(index["tokens"]) == ["chars", "phones"]
    assert index["total_utterances"] == 200
    for entry in index["shards"]:
        with h5py.File(out / entry["file"], "r") as f:
            assert "labels" not in f and f["label_counts"][()].tolist() == [0] * 40
    text = read_text_file(f"{SO}/text")
    labels = archive.read_inventory(f"{SO}/labels.txt")
    prons, lacking = lexicon.pronunciations(sorted({w for t in text.values() for w in t.split()}),
                                            labels)
    assert lacking == []
    for utt, phones in by_utt(out, "phones").items():
        assert phones == [p for w in text[utt].split() for p in prons[w][0] if p != "SIL"], utt
    assert main(["inspect", str(out)]) == 0
    assert "no frame labels" in capsys.readouterr().out


def test_text_only_without_labels_and_nothing_to_learn_from(tmp_path, capsys):
    out = tmp_path / "fs"
    assert prep(FSDD, out, "--sample-rate", 8000, "--jobs", 1) == 0
    index = archive.read_index(str(out))
    assert sorted(index["tokens"]) == ["chars"] and index["num_labels"] == 0
    assert (out / "labels.txt").read_text() == ""
    assert check_archive(str(out))[0] == []
    data = copy_data_dir(FSDD, tmp_path / "notext")
    os.unlink(data / "text")
    assert prep(data, tmp_path / "x", "--sample-rate", 8000) == 2
    assert f"{data}: no `text`" in capsys.readouterr().err
    assert prep(data, tmp_path / "x", "--alignments", f"{FSDD}/phn", "--tokens", "chars") == 2
    assert f"{data}/text does not exist" in capsys.readouterr().err


# ---------------------------------------------------------------- bpe

def test_bpe_learns_from_training_speakers_only_and_deterministically(tmp_path, capsys):
    cv = split_speakers(FSDD_SPEAKERS, 1, 0)[1][0]
    train = [s for s in FSDD_SPEAKERS if s != cv][0]
    args = ["--alignments", f"{FSDD}/phn", "--sample-rate", 8000, "--cv-speakers", 1,
            "--tokens", "chars,bpe", "--bpe-size", 24, "--jobs", 1, "--max-bad-fraction", 0.1]

    def run(name, edits):
        data = copy_data_dir(FSDD, tmp_path / f"data_{name}", edits)
        assert prep(data, tmp_path / name, *args) == 0
        return tmp_path / name, capsys.readouterr()

    a, _ = run("a", {})
    # held-out text: a word only there (TEN), and a character the training text never had (L)
    b, printed = run("b", {f"2_{cv}_0": "TEN TWO", f"1_{cv}_0": "ELEVEN"})
    assert f"1_{cv}_0: character 'L' (in 'ELEVEN') is not in the chars inventory" in printed.err
    assert "unknown token 1" in printed.out
    # two runs with the same training text: the same bytes (deterministic, and blind to cv)
    for name in (archive.BPE_MODEL, "tokens_bpe.txt", "tokens_chars.txt"):
        assert (a / "train" / name).read_bytes() == (b / "train" / name).read_bytes()
        assert (a / "cv" / name).read_bytes() == (a / "train" / name).read_bytes()
    assert by_utt(a / "train", "bpe") == by_utt(b / "train", "bpe")
    assert by_utt(b / "cv")[f"2_{cv}_0"] == "TEN TWO" and f"1_{cv}_0" not in by_utt(b / "cv")
    # the same edit in the training text does change the model
    c, _ = run("c", {f"2_{train}_0": "TEN TWO TEN TEN TEN"})
    assert (c / "train" / archive.BPE_MODEL).read_bytes() != \
        (a / "train" / archive.BPE_MODEL).read_bytes()
    # pieces + 1 decode back to the transcript; inventory = <blk> + the pieces in id order
    sp = tokens.bpe_processor((a / "train" / archive.BPE_MODEL).read_bytes())
    assert archive.read_tokens(str(a / "train"), "bpe") == \
        ["<blk>"] + [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    text = by_utt(a / "cv")
    for utt, pieces in by_utt(a / "cv", "bpe").items():
        assert sp.decode([sp.piece_to_id(p) for p in pieces]) == text[utt]
    assert check_archive(str(a / "cv"))[0] == []
    # a later test set takes the inventories (and bpe.model) of the trained model's archive
    assert prep(FSDD, tmp_path / "test", "--sample-rate", 8000, "--jobs", 1,
                "--token-inventory", a / "train") == 0
    assert "from " + str(a / "train") in capsys.readouterr().out
    for name in (archive.BPE_MODEL, "tokens_bpe.txt", "tokens_chars.txt"):
        assert (tmp_path / "test" / name).read_bytes() == (a / "train" / name).read_bytes()
    assert sorted(archive.read_index(str(tmp_path / "test"))["tokens"]) == ["bpe", "chars"]
    # a size the text cannot give is named with the limit
    assert prep(FSDD, tmp_path / "big", "--sample-rate", 8000, "--tokens", "bpe") == 2
    assert "--bpe-size 256" in capsys.readouterr().err


# ---------------------------------------------------------------- speed perturbation

def test_perturb_speed_resamples():
    """f = 1.1: a tenth faster, so 1/1.1 of the samples and a 440 Hz tone at 484 Hz."""
    sr = 16000
    x = (1000 * np.sin(2 * np.pi * 440 * np.arange(sr) / sr)).astype(np.float32)
    for f in (0.9, 1.1):
        y = features.perturb_speed(x, f, sr)
        assert abs(len(y) - len(x) / f) <= 1 and y.dtype == np.float32
        peak = np.argmax(np.abs(np.fft.rfft(y[1000:-1000] * np.hanning(len(y) - 2000))))
        assert abs(peak * sr / (len(y) - 2000) - 440 * f) < 3
        assert np.array_equal(y, features.perturb_speed(x, f, sr))


def test_speed_perturbation_triples_training_only(tmp_path):
    args = ["--alignments", f"{FSDD}/phn", "--sample-rate", 8000, "--cv-speakers", 1,
            "--jobs", 2, "--max-bad-fraction", 0.2]
    assert prep(FSDD, tmp_path / "plain", *args) == 0
    assert prep(FSDD, tmp_path / "sp", *args, "--speed-perturb", "0.9,1.0,1.1") == 0
    plain, sp = frames_by_utt(tmp_path / "plain" / "train"), frames_by_utt(tmp_path / "sp" / "train")
    assert len(sp) == 3 * len(plain) and sorted(plain) == sorted(u for u in sp if u in plain)
    index = archive.read_index(str(tmp_path / "sp" / "train"))
    speakers = {s for e in index["shards"]
                for s in archive.read_shard_meta(tmp_path / "sp" / "train" / e["file"])["spk_ids"]}
    assert {s for s in speakers if s.startswith("sp0.9-")} == {"sp0.9-" + s for s in speakers
                                                                if not s.startswith("sp")}
    texts, phones = by_utt(tmp_path / "sp" / "train"), by_utt(tmp_path / "sp" / "train", "phones")
    for utt, frames in plain.items():
        assert sp[utt] == frames
        for f in (0.9, 1.1):
            copy = f"sp{f:g}-{utt}"
            # durations from frame counts (snip_edges: (T - 1) shifts + a 2.5-shift window):
            # the copy's within a frame of the original's / f, up to the original's remainder
            assert abs((sp[copy] + 1.5) - (frames + 1.5) / f) < max(1, 1 / f), copy
            assert texts[copy] == texts[utt] and phones[copy] == phones[utt]
    # the held-out speaker is untouched: the same utterances and features as without
    a, b = tmp_path / "plain" / "cv" / "shard-00000.h5", tmp_path / "sp" / "cv" / "shard-00000.h5"
    with h5py.File(a, "r") as fa, h5py.File(b, "r") as fb:
        assert np.array_equal(fa["feats"][()], fb["feats"][()])
        assert fa["utt_ids"][()].tolist() == fb["utt_ids"][()].tolist()
    assert check_archive(str(tmp_path / "sp" / "train"))[0] == []


def test_speed_copies_frame_labels_follow_the_times(tmp_path):
    """A copy's frame labels are the original's segments at times / f: the same phone runs,
    each about 1/f as long (the last one also absorbs the end's length tolerance)."""
    assert prep(FSDD, tmp_path / "sp", "--alignments", f"{FSDD}/phn", "--sample-rate", 8000,
                "--speed-perturb", "0.9", "--tokens", "none", "--jobs", 1,
                "--max-bad-fraction", 0.1) == 0
    path = tmp_path / "sp" / "shard-00000.h5"
    meta = archive.read_shard_meta(path)
    with h5py.File(path, "r") as f:
        labels = f["labels"][()]
        assert "tokens" not in f
    offsets = meta["utt_offsets"]
    runs = {u: mkgraph.segments(labels[offsets[i]:offsets[i + 1]])
            for i, u in enumerate(meta["utt_ids"])}
    for utt in meta["utt_ids"]:
        if utt.startswith("sp"):
            (ids, lengths), (ids0, lengths0) = runs[utt], runs[utt[len("sp0.9-"):]]
            assert ids.tolist() == ids0.tolist()
            assert np.all(np.abs(lengths - lengths0 / 0.9)[:-1] <= 1), utt


# ---------------------------------------------------------------- the decoder's code stays light

def test_prep_imports_no_fst_library():
    code = ("import sys, data_prep.prep; "
            "assert not [m for m in sys.modules if m.startswith(('kaldifst', 'kaldilm'))]")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_tokens_concatenate_and_encoders():
    ids, offsets = tokens.concatenate([[3, 1], [], [2]])
    assert ids.tolist() == [3, 1, 2] and offsets.tolist() == [0, 2, 2, 3]
    assert ids.dtype == np.int32 and offsets.dtype == np.int64
    inventory = tokens.char_inventory(["ab c", "ca"])
    assert inventory == ["<blk>", "<space>", "a", "b", "c"]
    table = {s: i for i, s in enumerate(inventory)}
    assert tokens.chars("u", ["ab", "c"], table) == [2, 3, 1, 4]
    # two equal phones either side of a silence stay two tokens (the references' rule)
    symbols = ["SIL", "A", "B"]
    table = {s: i for i, s in enumerate(tokens.phone_inventory(symbols))}
    assert tokens.phones_of_labels("u", np.array([0, 1, 1, 0, 1, 2, 2, 0]), symbols, table) == \
        [1, 1, 2]


def test_missing_data_dir_text_line_is_stored_empty_without_text_tokens(tmp_path, capsys):
    data = copy_data_dir(FSDD, tmp_path / "data", {"0_george_0": None})
    assert prep(data, tmp_path / "o", "--alignments", f"{FSDD}/phn", "--sample-rate", 8000,
                "--tokens", "phones", "--jobs", 1) == 0
    assert "1 utterances have no line" in capsys.readouterr().out
    assert by_utt(tmp_path / "o")["0_george_0"] == ""


def test_speed_copy_of_a_segments_cut(tmp_path):
    """A copy of an utterance cut by `segments` resamples the cut, not the recording."""
    data = copy_data_dir(FSDD, tmp_path / "data")
    rec = os.path.join(FSDD, "flac", "0_george_0.flac")
    n = sf.info(rec).frames
    (data / "segments").write_text(f"cut 0_george_0 0.0 {n / 2 / 8000}\n")
    (data / "utt2spk").write_text("cut george\n")
    (data / "text").write_text("cut ZERO\n")
    assert prep(data, tmp_path / "o", "--sample-rate", 8000, "--speed-perturb", "1.1",
                "--jobs", 1) == 0
    frames = frames_by_utt(tmp_path / "o")
    assert frames["cut"] == features.num_frames(n // 2, 8000)
    assert abs(frames["sp1.1-cut"] - features.num_frames(round(n / 2 / 1.1), 8000)) <= 1
