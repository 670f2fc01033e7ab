"""data.cmvn_scope: each speaker's statistics, the training archive's summed (global), or each
utterance's own; every loader (frames, chunks, whole utterances, inference) normalises a
frame as a float64 reference does, within float32's rounding of (x + shift) * scale."""
import numpy as np
import pytest

from conftest import make_archive
from hpcsgd import config
from hpcsgd.data import cmvn as norm
from hpcsgd.data.loader import FrameLoader, iter_utterances
from hpcsgd.data.sequences import SequenceLoader
from hpcsgd.data.utterances import UtteranceLoader
from hpcsgd.errors import UserError

EPS32 = np.finfo(np.float32).eps


def reference(x, stats):
    """(x - mean) / std in float64 from Kaldi stats (2, D+1), variance floored as hpcsgd's."""
    count = stats[0, -1]
    mean = stats[0, :-1] / count
    var = np.maximum(stats[1, :-1] / count - mean * mean, 1e-10)
    return (x.astype(np.float64) - mean) / np.sqrt(var), mean, 1 / np.sqrt(var)


def stats_of(x):
    x = x.astype(np.float64)
    return np.stack([np.append(x.sum(0), len(x)), np.append((x * x).sum(0), 0.0)])


def assert_normalised(got, x, stats):
    """got = float32 (x + shift) * scale with shift and scale float32 roundings of the float64
    -mean and 1/std: each of the three roundings and the two ops is within eps32 relative,
    of |x| + |mean| before the scale."""
    want, mean, scale = reference(x, stats)
    bound = 4 * EPS32 * (np.abs(x) + np.abs(mean)) * scale + 1e-30
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_utterance_rows_read_in_spans_equal_whole_utterances():
    """Each utterance's own statistics, read about `span` frames at a time (whole utterances,
    one at least), against the float64 reference of its frames."""
    rng = np.random.default_rng(4)
    lengths = rng.integers(1, 40, 17)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    feats = rng.normal(-7, 3, (offsets[-1], 5)).astype(np.float32)
    for span in (1, 30, 1 << 20):
        shift, scale = norm.utterance_rows("meanvar", feats, offsets, span=span)
        for u in range(len(lengths)):
            x = feats[offsets[u]:offsets[u + 1]]
            assert_normalised((x + shift[u]) * scale[u], x, stats_of(x))
    shift, scale = norm.utterance_rows("mean", feats, offsets)
    np.testing.assert_array_equal(scale, 1)
    np.testing.assert_allclose(-shift[3], feats[offsets[3]:offsets[4]].mean(0), rtol=1e-6)


@pytest.fixture(scope="module")
def archives(tmp_path_factory):
    """A training and a CV archive (different statistics), each shard's frames known."""
    base = tmp_path_factory.mktemp("cmvn_scope")
    train, cv = str(base / "train"), str(base / "cv")
    return (train, make_archive(train, num_shards=2, utts_per_shard=6, seed=3)), \
        (cv, make_archive(cv, num_shards=1, utts_per_shard=5, seed=9))


def frames_by_id(archive_dir, cmvn):
    """{global frame id: its normalised features} from a whole FrameLoader epoch without
    splicing, the ids from the same epoch unnormalised (the order does not depend on CMVN)."""
    out = []
    for how in ("none", cmvn):
        loader = FrameLoader(archive_dir, 0, 1, context=0, cmvn=how, seed=1, max_batch=97,
                             block_frames=300, buffer_frames=900)
        loader.start_epoch(0)
        xs = []
        while loader.remaining:
            xs.append(loader.next_batch(97)[0].copy())
        loader.close()
        out.append(np.concatenate(xs))
    return out[0][:, 0].astype(np.int64), out[1]


def expected(shards, scope, total):
    """Per shard, per utterance: (its raw frames, the stats it is normalised with)."""
    for s, (feats, _labels, offsets, utt_spk, stats) in enumerate(shards):
        for u in range(len(offsets) - 1):
            x = feats[offsets[u]:offsets[u + 1]]
            which = {"speaker": stats[utt_spk[u]], "global": total,
                     "utterance": stats_of(x)}[scope]
            yield s, u, offsets[u], x, which


@pytest.mark.parametrize("scope", ["speaker", "global", "utterance"])
def test_every_loader_normalises_as_the_reference(archives, scope):
    """The CV archive read as training's CV is: its frames under the scope, the global one
    being the *training* archive's summed statistics (kept in the checkpoint); the frame
    loader, the chunk loader, the utterance loader and inference (iter_utterances) alike."""
    (train, train_shards), (cv, cv_shards) = archives
    total = sum(st.sum(axis=0) for *_, st in train_shards)
    meta = {"cmvn": "meanvar", "cmvn_scope": scope,
            "cmvn_stats": total.tolist() if scope == "global" else None}
    want = list(expected(cv_shards, scope, total))
    ids, x = frames_by_id(cv, meta)
    by_id = dict(zip(ids.tolist(), range(len(ids))))
    for s, u, first, raw, stats in want:
        rows = [by_id[s * 1_000_000 + first + t] for t in range(len(raw))]
        assert_normalised(x[rows], raw, stats)
    got = {utt: f for utt, f, _ in iter_utterances(cv, cmvn=meta, shuffle=False)}
    loader = UtteranceLoader(cv, tokens=None, cmvn=meta, prefetch=False)
    padded = {}
    for utts, xb, targets in loader.eval_batches(4000):
        nb = len(utts)
        for b, utt in enumerate(utts):
            padded[utt] = xb.reshape(-1, nb, xb.shape[1])[:targets.frames[b], b]
    chunks = SequenceLoader(cv, chunk=1000, cmvn=meta, max_batch=1000, block_frames=300,
                            buffer_frames=900, prefetch=False)
    buf = chunks._load_buffer(0, (1, 0, 0, chunks.plan_for(1).rank_blocks(0, 0)))
    for s, u, first, raw, stats in want:
        utt = f"s{s}u{u}"
        assert_normalised(got[utt], raw, stats)
        np.testing.assert_array_equal(padded[utt], got[utt])   # the same rows, applied alike
    # chunks of 1000 frames hold whole utterances: each is one of inference's, bit for bit
    found = set()
    for start, length in buf.table[:, :2]:
        rows = buf.feats[start:start + length]
        found |= {utt for utt, f in got.items() if len(f) == length and np.array_equal(f, rows)}
    assert found == set(got)


def test_config_keeps_the_training_archive_statistics(archives):
    (train, train_shards), _ = archives
    cfg = {"data.cmvn": "meanvar", "data.cmvn_scope": "global", "data.train": train}
    meta = norm.of_config(cfg)
    np.testing.assert_array_equal(np.array(meta["cmvn_stats"]),
                                  sum(st.sum(axis=0) for *_, st in train_shards))
    assert norm.of_config({**cfg, "data.cmvn_scope": "utterance"})["cmvn_stats"] is None


def test_bad_scopes_are_named(archives):
    (train, _), _ = archives
    with pytest.raises(UserError, match="cmvn_scope global without the training archive"):
        FrameLoader(train, cmvn={"cmvn": "meanvar", "cmvn_scope": "global"})
    with pytest.raises(UserError, match="cmvn_scope must be one of speaker, global, utterance"):
        UtteranceLoader(train, tokens=None, cmvn={"cmvn": "meanvar", "cmvn_scope": "stream"})
    with pytest.raises(UserError, match="data.cmvn_scope"):
        config.load(None, ["data.train=x", "data.cmvn_scope=stream"])
