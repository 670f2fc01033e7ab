"""hpcsgd prep on LibriSpeech's own layout (data_prep/librispeech.py), on the bundled subset of
Mini LibriSpeech (data_prep/demo/librispeech: 6 training speakers x 4 utterances)."""
import os
import shutil

import h5py
import numpy as np
import pytest
import soundfile as sf

from data_prep import features, librispeech
from hpcsgd.cli import main
from hpcsgd.data import archive

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(REPO, "data_prep", "demo", "librispeech")
SUBSET = os.path.join(ROOT, "train-clean-5")
SPEAKERS = ["118", "163", "460", "1737", "7859", "8629"]
GENDER = {"118": "m", "163": "m", "460": "m", "1737": "f", "7859": "f", "8629": "m"}


@pytest.fixture(autouse=True)
def _not_in_an_array_task(monkeypatch):
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)


def prep(*argv):
    return main(["prep", *map(str, argv)])


def transcripts(subset):
    out = {}
    for dirpath, _, names in os.walk(subset):
        for name in names:
            if name.endswith(librispeech.TRANS_SUFFIX):
                with open(os.path.join(dirpath, name)) as f:
                    out.update((p[0], p[1:]) for p in (line.split() for line in f) if p)
    return out


def shard_contents(arch, kind=None):
    """{utt: spk, gender, feats, text, tokens (of `kind`)} over an archive's shards."""
    utts = {}
    for entry in archive.read_index(str(arch))["shards"]:
        path = arch / entry["file"]
        meta = archive.read_shard_meta(path)
        text = archive.read_shard_text(path)
        with h5py.File(path, "r") as f:
            feats = f["feats"][()]
        ids, offsets = archive.read_shard_tokens(path, kind) if kind else (None, None)
        for u, utt in enumerate(meta["utt_ids"]):
            a, b = meta["utt_offsets"][u:u + 2]
            utts[utt] = {"spk": meta["spk_ids"][meta["utt_spk"][u]],
                         "gender": meta["spk_gender"][meta["utt_spk"][u]],
                         "feats": feats[a:b], "text": text[u],
                         "tokens": None if ids is None else ids[offsets[u]:offsets[u + 1]]}
    return utts


def test_the_bundled_subset_is_librispeech_as_on_disk():
    assert librispeech.is_subset(SUBSET) and not librispeech.is_subset(ROOT)
    utts, problems, text = librispeech.read_subset(SUBSET)
    assert problems == [] and len(utts) == 24
    assert sorted({u["spk"] for u in utts.values()}, key=int) == SPEAKERS
    assert text == transcripts(SUBSET)
    assert text["1737-146161-0007"] == "KNIT TWO TOGETHER TWICE".split()
    assert librispeech.read_genders(SUBSET) == GENDER      # SPEAKERS.TXT of the parent


def test_prep_reads_the_layout_with_speaker_lists(tmp_path, capsys):
    keep, cv = tmp_path / "keep.txt", tmp_path / "cv.txt"
    keep.write_text("118\n163\n460\n1737\n")
    cv.write_text("1737\n")
    out = tmp_path / "ls"
    assert prep(SUBSET, out, "--tokens", "bpe,chars", "--bpe-size", 40, "--speakers",
                f"{keep},{cv}", "--cv-speakers", cv, "--jobs", 1) == 0
    train, held = shard_contents(out / "train"), shard_contents(out / "cv")
    assert {u["spk"] for u in train.values()} == {"118", "163", "460"}
    assert {u["spk"] for u in held.values()} == {"1737"}
    assert len(train) == 12 and len(held) == 4
    lines = transcripts(SUBSET)
    for utt, u in {**train, **held}.items():
        assert u["gender"] == GENDER[u["spk"]] and u["text"] == " ".join(lines[utt])
    # the features of one file are its audio's fbank, stored unchanged
    utt = "1737-146161-0009"
    path = os.path.join(SUBSET, "1737", "146161", f"{utt}.flac")
    samples, rate = sf.read(path, dtype="float32")
    want = features.compute(features.extractor_config("fbank", 40, 13, 16000),
                            features.read_audio(utt, path, 0.0, -1.0, rate), utt)
    assert len(want) == features.num_frames(len(samples), rate)
    np.testing.assert_array_equal(held[utt]["feats"], want)
    index = archive.read_index(str(out / "cv"))
    assert index["tokens"]["bpe"]["num_tokens"] == 41   # 40 pieces learnt from train, + blank


def test_tokens_phones_spelt_by_cmudict_without_labels(tmp_path, capsys):
    out = tmp_path / "ls"
    assert prep(SUBSET, out, "--tokens", "phones", "--jobs", 1, "--max-bad-fraction", 0.5) == 0
    symbols = archive.read_inventory(str(out / archive.LABELS_NAME))
    assert len(symbols) == 40 and symbols[0] == "SIL"
    inv = archive.read_tokens(str(out), "phones")
    assert inv[1:] == symbols[1:]                   # CMUdict's 39 phones, so762's order
    ids = shard_contents(out, "phones")["1737-146161-0007"]["tokens"]   # KNIT TWO TOGETHER TWICE
    assert [inv[i] for i in ids] == "N IH T T UW T AH G EH DH ER T W AY S".split()


def corrupt(tmp_path):
    data = tmp_path / "LibriSpeech" / "train-clean-5"
    shutil.copytree(SUBSET, data)
    return data


def test_bad_layout_named_per_utterance(tmp_path, capsys):
    data = corrupt(tmp_path)
    os.remove(data / "118" / "47824" / "118-47824.trans.txt")        # a chapter without its lines
    trans = data / "163" / "122947" / "163-122947.trans.txt"
    lines = trans.read_text().splitlines()
    trans.write_text("\n".join(lines[1:] + ["163-122947-0999 A LINE WITHOUT AUDIO"]) + "\n")
    rc = prep(data, tmp_path / "out", "--tokens", "chars", "--jobs", 1, "--max-bad-fraction", 0.5)
    err = capsys.readouterr().err
    assert rc == 0
    assert "118-47824-0026.flac: chapter" in err and "has no 118-47824.trans.txt" in err
    assert f"{lines[0].split()[0]}.flac: no line in {trans}" in err
    assert "163-122947-0999: in" in err and "has no 163-122947-0999.flac" in err
    index = archive.read_index(str(tmp_path / "out"))
    assert index["total_utterances"] == 24 - 4 - 1


def test_refusals_name_the_speaker_or_the_directory(tmp_path, capsys):
    missing = tmp_path / "spk.txt"
    missing.write_text("118\n19\n")          # 19 is a LibriSpeech speaker, not in the bundle
    assert prep(SUBSET, tmp_path / "a", "--speakers", missing, "--tokens", "chars") == 2
    assert "--speakers: 1 speakers are not in" in capsys.readouterr().err
    cv = tmp_path / "cv.txt"
    cv.write_text("163\n")
    keep = tmp_path / "keep.txt"
    keep.write_text("118\n460\n")
    assert prep(SUBSET, tmp_path / "b", "--speakers", keep, "--cv-speakers", cv,
                "--tokens", "chars") == 2
    assert "--cv-speakers" in (e := capsys.readouterr().err) and "163" in e and "--speakers" in e
    assert prep(ROOT, tmp_path / "c", "--tokens", "chars") == 2
    assert "neither a Kaldi data directory" in capsys.readouterr().err
    data = corrupt(tmp_path)      # a transcript file that is not LibriSpeech's: fatal, named
    trans = data / "460" / "172359" / "460-172359.trans.txt"
    first = trans.read_text().splitlines()[0]
    trans.write_text(trans.read_text() + first + "\n")
    assert prep(data, tmp_path / "d", "--tokens", "chars") == 2
    assert f"{trans}:5: duplicate utterance/recording id" in capsys.readouterr().err
    trans.write_text(trans.read_text().replace(first.split()[0], "460-999999-0000", 1))
    assert prep(data, tmp_path / "e", "--tokens", "chars") == 2
    assert "is not of this chapter (expected 460-172359-<n>)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "a") or not os.listdir(tmp_path / "a")
