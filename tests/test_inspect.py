"""hpcsgd inspect: a good archive passes with a summary; each kind of broken archive fails,
naming the file at fault (truncated/corrupt shard, missing shard, differing feature dimension,
NaN/Inf features, labels out of range, index counts that disagree with the shards, token
inventories, bpe.model and token ids); a format 1 archive still passes."""
import json
import os
import shutil

import h5py
import numpy as np
import pytest

from hpcsgd.cli import main
from hpcsgd.data import archive
from hpcsgd.data.inspect import check_archive
from hpcsgd.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "data_prep", "demo", "fsdd")


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = tmp_path_factory.mktemp("arch") / "fsdd"
    with pytest.MonkeyPatch.context() as mp:  # --shard-index defaults to $SLURM_ARRAY_TASK_ID
        mp.delenv("SLURM_ARRAY_TASK_ID", raising=False)
        assert main(["prep", DEMO, str(out), "--alignments", f"{DEMO}/phn", "--labels",
                     f"{DEMO}/labels.txt", "--sample-rate", "8000", "--num-shards", "3",
                     "--jobs", "1"]) == 0
    return out


@pytest.fixture
def arch(good, tmp_path):
    copy = tmp_path / "a"
    shutil.copytree(good, copy)
    return copy


def inspect(path, capsys, *extra):
    rc = main(["inspect", str(path), *extra])
    return rc, capsys.readouterr().out


def test_good_archive_summary(arch, capsys):
    rc, out = inspect(arch, capsys)
    assert rc == 0 and out.rstrip().endswith("OK")
    assert "3 shards" in out and "40 utterances" in out and "4 speakers" in out
    assert "fbank dim 40, 8000 Hz" in out and "SIL" in out and "%" in out
    assert inspect(arch, capsys, "--no-values")[0] == 0


def test_truncated_shard(arch, capsys):
    path = arch / "shard-00001.h5"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    rc, out = inspect(arch, capsys)
    assert rc == 1 and "shard-00001.h5: cannot open shard" in out and "INVALID" in out


def test_corrupt_shard(arch, capsys):
    path = arch / "shard-00002.h5"
    data = bytearray(path.read_bytes())
    data[:64] = b"\0" * 64  # HDF5 superblock gone
    path.write_bytes(bytes(data))
    rc, out = inspect(arch, capsys)
    assert rc == 1 and "shard-00002.h5" in out


def test_index_names_missing_shard(arch, capsys):
    os.unlink(arch / "shard-00000.h5")
    rc, out = inspect(arch, capsys)
    assert rc == 1 and "names shard shard-00000.h5, which does not exist" in out
    with pytest.raises(UserError, match="shard-00000.h5"):
        archive.read_index(str(arch))


def extras(path, attrs):
    """A shard's tokens and text, as write_shard takes them back."""
    tokens = {k: archive.read_shard_tokens(str(path), k) for k in json.loads(attrs["tokens"])}
    return {"tokens": tokens or None, "text": archive.read_shard_text(str(path))}


def test_feature_dim_differs_between_shards(arch, capsys):
    meta = archive.read_shard_meta(str(arch / "shard-00001.h5"))
    attrs = dict(meta["attrs"], feature_dim=13)
    n = meta["num_frames"]
    archive.write_shard(str(arch / "shard-00001.h5"), np.zeros((n, 13), np.float32),
                        np.zeros(n, np.int32), meta["utt_offsets"], meta["utt_ids"], meta["utt_spk"],
                        meta["spk_ids"], np.zeros((len(meta["spk_ids"]), 2, 14)),
                        np.bincount(np.zeros(n, np.int64), minlength=attrs["num_labels"]), attrs,
                        **extras(arch / "shard-00001.h5", attrs))
    rc, out = inspect(arch, capsys)
    assert rc == 1 and "shard-00001.h5: feature_dim=13 differs" in out
    with pytest.raises(UserError, match="feature_dim"):
        archive.write_index(str(arch))


def rewrite(path, **changes):
    """Rewrite a shard with some datasets replaced (through the real writer)."""
    meta = archive.read_shard_meta(str(path))
    with h5py.File(path, "r") as f:
        feats, labels = f["feats"][()], f["labels"][()] if "labels" in f else None
    d = dict(feats=feats, labels=labels, counts=meta["label_counts"])
    d.update(changes)
    d.setdefault("extras", extras(path, meta["attrs"]))
    archive.write_shard(str(path), d["feats"], d["labels"], meta["utt_offsets"], meta["utt_ids"],
                        meta["utt_spk"], meta["spk_ids"], meta["cmvn_stats"], d["counts"],
                        d.get("attrs", meta["attrs"]), **d["extras"])
    return meta


def test_nan_features_named_by_utterance(arch, capsys):
    meta = archive.read_shard_meta(str(arch / "shard-00000.h5"))
    with h5py.File(arch / "shard-00000.h5", "r") as f:
        feats = f["feats"][()]
    a = meta["utt_offsets"][3]
    feats[a + 1, 5] = np.inf
    rewrite(arch / "shard-00000.h5", feats=feats)
    rc, out = inspect(arch, capsys)
    assert rc == 1 and f"NaN/Inf feature in utterance {meta['utt_ids'][3]}" in out
    assert inspect(arch, capsys, "--no-values")[0] == 0  # metadata-only mode skips the value scan


def test_label_out_of_range(arch, capsys):
    with h5py.File(arch / "shard-00002.h5", "r") as f:
        labels = f["labels"][()]
    labels[7] = 40
    rewrite(arch / "shard-00002.h5", labels=labels)
    rc, out = inspect(arch, capsys)
    assert rc == 1 and "shard-00002.h5: label 40 at frame 7 outside 0..39" in out


def test_index_counts_disagree_with_shards(arch, capsys):
    index = json.loads((arch / "index.json").read_text())
    index["shards"][1]["frames"] += 5
    index["total_utterances"] += 1
    (arch / "index.json").write_text(json.dumps(index))
    rc, out = inspect(arch, capsys)
    assert rc == 1 and "shard-00001.h5: has" in out and "total_utterances" in out


def test_speaker_in_two_shards_and_no_index(arch, capsys):
    shutil.copy(arch / "shard-00000.h5", arch / "shard-00003.h5")
    os.unlink(arch / "index.json")
    problems, summary = check_archive(str(arch))
    text = "\n".join(problems)
    assert "no index.json" in text and "also in shard-00000.h5" in text
    assert summary is not None and summary["shards"] == 4


# ---------------------------------------------------------------- format 1, tokens

def test_format1_archive_still_passes(tmp_path, capsys):
    """An archive as hpcsgd wrote it before format 2: no frame_labels/has_text/tokens
    attributes in the shards or keys in the index. It reads as frame labels, no tokens."""
    from conftest import make_archive
    make_archive(str(tmp_path), num_shards=2)
    for name in ("shard-00000.h5", "shard-00001.h5"):
        with h5py.File(tmp_path / name, "a") as f:
            for key in ("frame_labels", "has_text", "tokens"):
                del f.attrs[key]
            f.attrs["format_version"] = 1
    index = json.loads((tmp_path / "index.json").read_text())
    for key in ("frame_labels", "has_text", "tokens"):
        del index[key]
    for entry in index["shards"]:
        del entry["tokens"]
    index["format_version"] = 1
    (tmp_path / "index.json").write_text(json.dumps(index))
    rc, out = inspect(tmp_path, capsys)
    assert rc == 0 and "labels: 5 (5 seen)" in out and "tokens" not in out and "text:" not in out
    assert archive.read_index(str(tmp_path))["tokens"] == {}


@pytest.fixture
def tokenized(tmp_path):
    from conftest import make_archive
    make_archive(str(tmp_path), num_shards=2, token_kinds=("phones", "bpe"), text=True,
                 frame_labels=False)
    return tmp_path


def test_token_archive_summary(tokenized, capsys):
    rc, out = inspect(tokenized, capsys)
    assert rc == 0, out
    assert "no frame labels" in out and "text: 24 transcripts (0 empty)" in out
    assert "tokens phones: inventory 8 (blank included)" in out and "tokens bpe:" in out
    assert "frames per token min" in out and "too short for CTC 0" in out


TOKEN_BREAKS = {
    # name: (what to break, text naming it)
    "inventory missing": (lambda a: os.unlink(a / "tokens_phones.txt"), "tokens_phones.txt: missing"),
    "inventory changed": (lambda a: (a / "tokens_phones.txt").write_text("<blk> 0\nX 1\n"),
                          "tokens_phones.txt: does not match the shards' phones inventory_hash"),
    "no blank": (lambda a: (a / "tokens_phones.txt").write_text(
        (a / "tokens_phones.txt").read_text().replace("<blk> 0", "blank 0")), "id 0 must be the blank"),
    "bpe model missing": (lambda a: os.unlink(a / "bpe.model"), "bpe.model: missing"),
    "bpe model corrupt": (lambda a: (a / "bpe.model").write_bytes(b"junk"),
                          "bpe.model: not a sentencepiece model"),
    "total tokens": (lambda a: _edit_index(a, lambda i: i["tokens"]["bpe"].update(total_tokens=1)),
                     "bpe total_tokens 1 but the shards hold"),
    "token out of range": (lambda a: _bad_token(a / "shard-00001.h5"),
                           "utterance s1u2 has phones token 8 outside 1..7"),
}


def _edit_index(arch, fn):
    index = json.loads((arch / "index.json").read_text())
    fn(index)
    (arch / "index.json").write_text(json.dumps(index))


def _bad_token(path):
    meta = archive.read_shard_meta(str(path))
    with h5py.File(path, "r") as f:
        feats = f["feats"][()]
    more = extras(path, meta["attrs"])
    ids, offsets = more["tokens"]["phones"]
    ids[offsets[2]] = 8
    rewrite(path, feats=feats, labels=None, extras=more)


@pytest.mark.parametrize("case", sorted(TOKEN_BREAKS))
def test_token_problems_are_named(tokenized, capsys, case):
    breaker, culprit = TOKEN_BREAKS[case]
    breaker(tokenized)
    rc, out = inspect(tokenized, capsys)
    assert rc == 1 and culprit in out, out


def test_ctc_feasibility_counts_repeated_neighbours(monkeypatch):
    """CTC needs a blank between equal neighbours: T >= tokens + repeats."""
    from hpcsgd.data import inspect as inspect_module
    ids, offsets = np.array([1, 1, 2, 3, 3, 3, 4], np.int32), np.array([0, 3, 3, 7])
    monkeypatch.setattr(archive, "read_shard_tokens", lambda path, kind: (ids, offsets))
    meta = {"utt_offsets": np.array([0, 4, 9, 14]), "utt_ids": ["a", "b", "c"]}
    stats = inspect_module.token_stats("shard", "phones", meta)
    # a: 3 tokens + 1 repeat in 4 frames fits; b: none; c: 4 tokens + 2 repeats in 5 does not
    assert stats["too_short"] == 1 and stats["empty"] == 1 and stats["longest"] == 4
    assert stats["min_ratio"] == 5 / 4 and stats["tightest"] == "c" and stats["total"] == 7
