"""hpcsgd inspect: a good archive passes with a summary; each kind of broken archive fails,
naming the file at fault (truncated/corrupt shard, missing shard, differing feature dimension,
NaN/Inf features, labels out of range, index counts that disagree with the shards)."""
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


def test_feature_dim_differs_between_shards(arch, capsys):
    meta = archive.read_shard_meta(str(arch / "shard-00001.h5"))
    attrs = dict(meta["attrs"], feature_dim=13)
    n = meta["num_frames"]
    archive.write_shard(str(arch / "shard-00001.h5"), np.zeros((n, 13), np.float32),
                        np.zeros(n, np.int32), meta["utt_offsets"], meta["utt_ids"], meta["utt_spk"],
                        meta["spk_ids"], np.zeros((len(meta["spk_ids"]), 2, 14)),
                        np.bincount(np.zeros(n, np.int64), minlength=attrs["num_labels"]), attrs)
    rc, out = inspect(arch, capsys)
    assert rc == 1 and "shard-00001.h5: feature_dim=13 differs" in out
    with pytest.raises(UserError, match="feature_dim"):
        archive.write_index(str(arch))


def rewrite(path, **changes):
    """Rewrite a shard with some datasets replaced (through the real writer)."""
    meta = archive.read_shard_meta(str(path))
    with h5py.File(path, "r") as f:
        feats, labels = f["feats"][()], f["labels"][()]
    d = dict(feats=feats, labels=labels, counts=meta["label_counts"])
    d.update(changes)
    archive.write_shard(str(path), d["feats"], d["labels"], meta["utt_offsets"], meta["utt_ids"],
                        meta["utt_spk"], meta["spk_ids"], meta["cmvn_stats"], d["counts"], meta["attrs"])
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
