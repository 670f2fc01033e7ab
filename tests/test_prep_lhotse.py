"""hpcsgd prep on lhotse manifests (data_prep/lhotse_manifests.py), written here as lhotse's
LibriSpeech recipe writes them for the bundled subset of Mini LibriSpeech: the archive equals
the one prep makes from the LibriSpeech layout itself."""
import gzip
import json
import os
import re

import numpy as np
import pytest
import soundfile as sf

from data_prep import librispeech, lhotse_manifests
from hpcsgd.errors import UserError
from test_prep_librispeech import GENDER, SUBSET, prep, shard_contents


def write_manifests(where, subset=SUBSET, part="train-clean-5", absolute=True):
    """librispeech_{recordings,supervisions}_<part>.jsonl.gz for every FLAC file of `subset`
    (one recording and one supervision each: start 0, the whole file, its transcript)."""
    utts, _, text = librispeech.read_subset(subset)
    os.makedirs(where, exist_ok=True)
    recs, sups = [], []
    for utt, info in utts.items():
        frames, rate = sf.info(info["path"]).frames, sf.info(info["path"]).samplerate
        path = info["path"] if absolute else os.path.relpath(info["path"])
        recs.append({"id": utt, "sources": [{"type": "file", "channels": [0], "source": path}],
                     "sampling_rate": rate, "num_samples": frames, "duration": frames / rate,
                     "channel_ids": [0]})
        sups.append({"id": utt, "recording_id": utt, "start": 0.0, "duration": frames / rate,
                     "channel": 0, "text": " ".join(text[utt]), "language": "English",
                     "speaker": info["spk"], "gender": GENDER[info["spk"]].upper()})
    names = {}
    for kind, items in (("recordings", recs), ("supervisions", sups)):
        names[kind] = os.path.join(where, f"librispeech_{kind}_{part}.jsonl.gz")
        with gzip.open(names[kind], "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
    return names


def test_manifests_give_the_archive_of_the_layout(tmp_path):
    """The same utterances, speakers, genders, transcripts, BPE tokens and features, bit for
    bit, from the manifests (relative source paths, as lhotse writes them, and the supervisions
    file named) as from the LibriSpeech directory; the directory form of DATA too."""
    names = write_manifests(tmp_path / "manifests", absolute=False)
    keep = tmp_path / "keep.txt"
    keep.write_text("118\n1737\n7859\n")
    common = ["--tokens", "bpe,chars", "--bpe-size", 30, "--speakers", keep, "--jobs", 1]
    assert prep(SUBSET, tmp_path / "layout", *common) == 0
    assert prep(names["supervisions"], tmp_path / "lhotse", *common) == 0
    assert prep(tmp_path / "manifests", tmp_path / "lhotse_dir", *common) == 0
    want = shard_contents(tmp_path / "layout", "bpe")
    assert len(want) == 12
    for out in ("lhotse", "lhotse_dir"):
        got = shard_contents(tmp_path / out, "bpe")
        assert sorted(got) == sorted(want)
        for utt, u in want.items():
            assert (got[utt]["spk"], got[utt]["gender"], got[utt]["text"]) == \
                (u["spk"], u["gender"], u["text"])
            np.testing.assert_array_equal(got[utt]["tokens"], u["tokens"])
            np.testing.assert_array_equal(got[utt]["feats"], u["feats"])


def r0_id(names):
    """The first recording's id."""
    with gzip.open(names["recordings"], "rt") as f:
        return json.loads(f.readline())["id"]


def edit(path, change):
    with gzip.open(path, "rt") as f:
        items = [json.loads(line) for line in f]
    items = change(items)
    with gzip.open(path, "wt") as f:
        f.writelines((item if isinstance(item, str) else json.dumps(item)) + "\n"
                     for item in items)


def test_what_cannot_be_read_is_named(tmp_path, capsys):
    names = write_manifests(tmp_path / "m")
    sups, recs = names["supervisions"], names["recordings"]
    # a supervision of a recording the manifest lacks, one without a speaker: skipped, named
    edit(sups, lambda items: items + [{**items[0], "id": "orphan", "recording_id": "nowhere"},
                                      {**items[1], "id": "nobody", "speaker": None}])
    assert prep(sups, tmp_path / "a", "--tokens", "chars", "--jobs", 1,
                "--max-bad-fraction", 0.2) == 0
    err = capsys.readouterr().err
    assert "orphan: recording nowhere is not in" in err and "nobody has no speaker" in err
    # fatal: a URL source, two channels, a broken line, a repeated id, no recordings beside
    url = {"type": "url", "channels": [0], "source": "https://example.org/a.flac"}
    for change, message in (
            (lambda r: [{**r[0], "sources": [url]}] + r[1:], "a 'url' source; hpcsgd reads files"),
            (lambda r: [{**r[0], "sources": [{**r[0]["sources"][0], "channels": [0, 1]}]}]
             + r[1:], "channels [0, 1]; hpcsgd reads single-channel files"),
            (lambda r: r[:3] + ["{not json"], ":4: not a JSON line"),
            (lambda r: r + [r[0]], f"recording {r0_id(names)} repeated")):
        bad = write_manifests(tmp_path / "bad")
        edit(bad["recordings"], change)
        with pytest.raises(UserError, match=re.escape(message)):
            lhotse_manifests.read_manifests(lhotse_manifests.manifest_pair(bad["supervisions"]))
    os.remove(recs)
    assert prep(sups, tmp_path / "b", "--tokens", "chars") == 2
    assert "its recordings manifest" in capsys.readouterr().err
    spk = tmp_path / "spk.txt"
    spk.write_text("118\n19\n")
    names = write_manifests(tmp_path / "c")
    assert prep(names["supervisions"], tmp_path / "d", "--speakers", spk, "--tokens", "chars") == 2
    assert "--speakers: 1 speakers are not in" in capsys.readouterr().err
