"""The loader: coverage, determinism, per-epoch order, exact resume, splicing edges, CMVN."""
import os

import numpy as np
import pytest

from conftest import REPO, make_archive, run_mpi
from hpcsgd.data.loader import FrameLoader, Plan, iter_utterances, local_batch_size
from hpcsgd.data.splice import (apply_cmvn, apply_cmvn_reference, cmvn_from_stats,
                                splice_gather, splice_reference)
from hpcsgd.errors import UserError

CONTEXT = 2


def stream(archive_dir, epoch=0, batch=64, rank=0, world=1, seed=7, offset=0, **kw):
    """All (x, y) of one rank's epoch, copied (loader batches are views)."""
    kw = dict(dict(context=CONTEXT, cmvn="none", block_frames=500, buffer_frames=1500), **kw)
    loader = FrameLoader(archive_dir, rank, world, seed=seed, max_batch=batch, **kw)
    loader.start_epoch(epoch, offset)
    xs, ys = [], []
    while True:
        x, y = loader.next_batch(batch)
        if len(y) == 0:
            break
        xs.append(x.copy())
        ys.append(y.copy())
    loader.close()
    return np.concatenate(xs), np.concatenate(ys)


def centre_ids(x, dim=4):
    return x[:, CONTEXT * dim].astype(np.int64)


def test_splice_kernel_matches_reference():
    rng = np.random.default_rng(1)
    feats = rng.normal(size=(50, 3)).astype(np.float32)
    src = np.arange(5, 45)
    lo = np.where(src < 20, 5, 20)           # two utterances: rows 5..19 and 20..44
    hi = np.where(src < 20, 19, 44)
    order = rng.permutation(len(src))
    out = np.empty((len(order), 5 * 3), np.float32)
    splice_gather(feats, src, lo, hi, order, 2, out)
    np.testing.assert_array_equal(out, splice_reference(feats, src, lo, hi, order, 2))
    # the first frame of an utterance repeats itself for the left context (Kaldi's rule)
    first = np.flatnonzero(src[order] == 20)[0]
    np.testing.assert_array_equal(out[first, :9].reshape(3, 3), feats[[20, 20, 20]])


def test_cmvn_kernel_matches_reference():
    rng = np.random.default_rng(2)
    feats = rng.normal(size=(30, 4)).astype(np.float32)
    spk = rng.integers(0, 3, 30).astype(np.int32)
    shift = rng.normal(size=(3, 4)).astype(np.float32)
    scale = rng.uniform(0.5, 2, (3, 4)).astype(np.float32)
    want = apply_cmvn_reference(feats, spk, shift, scale)
    apply_cmvn(feats, spk, shift, scale)
    np.testing.assert_allclose(feats, want, rtol=1e-6)


def test_every_frame_once_and_labels_follow_frames(small_archive):
    out, shards = small_archive
    x, y = stream(out)
    ids = centre_ids(x)
    total = sum(len(s[1]) for s in shards)
    assert len(ids) == total and len(np.unique(ids)) == total
    for shard_no, (feats, labels, *_rest) in enumerate(shards):
        mask = ids // 1_000_000 == shard_no
        np.testing.assert_array_equal(y[mask], labels[ids[mask] % 1_000_000])


def test_deterministic_per_seed_and_different_per_epoch(small_archive):
    out, _ = small_archive
    a, _ = stream(out, epoch=0)
    b, _ = stream(out, epoch=0)
    np.testing.assert_array_equal(a, b)
    c, _ = stream(out, epoch=1)
    d, _ = stream(out, epoch=0, seed=8)
    assert not np.array_equal(centre_ids(a), centre_ids(c))
    assert not np.array_equal(centre_ids(a), centre_ids(d))
    assert sorted(centre_ids(a)) == sorted(centre_ids(c))


def test_shuffle_mixes_utterances_and_shards(small_archive):
    out, _ = small_archive
    x, _ = stream(out, buffer_frames=4000)
    first = centre_ids(x)[:200]
    # a 200-frame window of a shuffled stream draws from many utterances, not one run
    assert len(np.unique(first // 1000)) > 1 or np.all(np.diff(first) != 1)
    assert np.mean(np.diff(first) == 1) < 0.1


@pytest.mark.parametrize("prefetch", [True, False])
def test_resume_from_saved_position_is_exact(small_archive, prefetch):
    out, _ = small_archive
    full_x, full_y = stream(out, epoch=3, batch=100, prefetch=prefetch)
    loader = FrameLoader(out, 0, 1, context=CONTEXT, cmvn="meanvar", seed=7, max_batch=100,
                         block_frames=500, buffer_frames=1500, prefetch=prefetch)
    loader.start_epoch(3)
    seen = [loader.next_batch(100)[0].copy() for _ in range(23)]   # crosses buffer edges
    position = loader.position
    rest = []
    while loader.remaining:
        rest.append(loader.next_batch(100)[0].copy())
    loader.close()
    resumed = FrameLoader(out, 0, 1, context=CONTEXT, cmvn="meanvar", seed=7, max_batch=100,
                          block_frames=500, buffer_frames=1500, prefetch=prefetch)
    assert position == {"epoch": 3, "offset": 2300}
    resumed.start_epoch(position["epoch"], position["offset"])
    again = []
    while resumed.remaining:
        again.append(resumed.next_batch(100)[0].copy())
    resumed.close()
    np.testing.assert_array_equal(np.concatenate(rest), np.concatenate(again))
    assert len(np.concatenate(seen + rest)) == len(full_x)


def test_splicing_at_utterance_edges_uses_only_own_utterance(small_archive):
    out, shards = small_archive
    x, _ = stream(out, cmvn="none")
    dim = 4
    ids = centre_ids(x)
    for shard_no, (feats, _labels, offsets, *_rest) in enumerate(shards):
        mask = ids // 1_000_000 == shard_no
        frames = ids[mask] % 1_000_000
        utt = np.searchsorted(offsets, frames, side="right") - 1
        rows = np.clip(frames[:, None] + np.arange(-CONTEXT, CONTEXT + 1),
                       offsets[utt][:, None], offsets[utt + 1][:, None] - 1)
        np.testing.assert_array_equal(x[mask], feats[rows].reshape(len(frames), -1))
    assert x.shape[1] == (2 * CONTEXT + 1) * dim


def test_cmvn_per_speaker_zero_mean_unit_variance(small_archive):
    out, shards = small_archive
    x, _ = stream(out, cmvn="meanvar")
    raw, _ = stream(out, cmvn="none")
    ids = centre_ids(raw)
    centre = x[:, CONTEXT * 4:(CONTEXT + 1) * 4].astype(np.float64)
    for shard_no, (feats, _l, offsets, utt_spk, stats) in enumerate(shards):
        frames = ids[ids // 1_000_000 == shard_no] % 1_000_000
        spk = utt_spk[np.searchsorted(offsets, frames, side="right") - 1]
        norm = centre[ids // 1_000_000 == shard_no]
        for s in np.unique(spk):
            sel = norm[spk == s]
            np.testing.assert_allclose(sel.mean(0), 0, atol=1e-4)
            np.testing.assert_allclose(sel.std(0), 1, atol=1e-4)
        shift, scale = cmvn_from_stats(stats, True)
        want = (feats[frames] + shift[spk]) * scale[spk]
        np.testing.assert_allclose(norm, want, rtol=1e-5, atol=1e-5)
    mean_only, _ = stream(out, cmvn="mean")
    assert mean_only[:, CONTEXT * 4 + 1].std() > 1.5  # variance kept (std 2 in data)


def test_rank_frames_partition_and_batch_split(small_archive):
    out, shards = small_archive
    from hpcsgd.data.archive import read_index
    index = read_index(out)
    for world in (1, 2, 3, 4):
        plan = Plan(index, world, seed=7, block_frames=500, buffer_frames=1500)
        assert plan.rank_frames(0).sum() == index["total_frames"]
    assert [local_batch_size(10, r, 4) for r in range(4)] == [3, 3, 2, 2]


def test_utterance_iterator_covers_each_utterance_once(small_archive):
    out, shards = small_archive
    seen = {}
    for rank in range(3):
        for utt, feats, labels in iter_utterances(out, rank, 3, epoch=1, seed=7, cmvn="none",
                                                  block_frames=500):
            assert utt not in seen
            seen[utt] = (rank, feats, labels)
    assert len(seen) == sum(len(s[2]) - 1 for s in shards)
    feats, labels, offsets, *_ = shards[1]
    _, got, got_labels = seen["s1u4"]
    np.testing.assert_array_equal(got, feats[offsets[4]:offsets[5]])
    np.testing.assert_array_equal(got_labels, labels[offsets[4]:offsets[5]])


def test_bad_resume_offset_and_missing_index_are_clear_errors(small_archive, tmp_path):
    out, _ = small_archive
    loader = FrameLoader(out, 0, 2, context=CONTEXT, block_frames=500, buffer_frames=1500)
    with pytest.raises(UserError, match="offset"):
        loader.start_epoch(0, 10**9)
    with pytest.raises(UserError, match="index.json"):
        FrameLoader(str(tmp_path))


def test_corrupt_shard_read_names_the_file(tmp_path):
    out = str(tmp_path / "arch")
    make_archive(out, num_shards=1, utts_per_shard=4)
    path = os.path.join(out, "shard-00000.h5")
    size = os.path.getsize(path)
    with open(path, "r+b") as f:      # truncate: the typical half-copied file
        f.truncate(size // 2)
    loader = FrameLoader(out, 0, 1, context=CONTEXT, block_frames=100, buffer_frames=200)
    with pytest.raises(UserError, match="shard-00000.h5"):
        loader.start_epoch(0)
        loader.next_batch(10)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_ranks_cover_every_frame_exactly_once_under_mpiexec(small_archive, ranks):
    out, _ = small_archive
    proc = run_mpi(ranks, ["-m", "mpi4py", os.path.join(REPO, "tests/mpi/loader_ranks.py"),
                           out, "2"], timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK frames=" in proc.stdout


@pytest.mark.parametrize("worlds", [(2, 3, 2), (3, 1, 4), (1, 2, 2)])
def test_an_epoch_re_dealt_mid_way_trains_every_frame_once(small_archive, worlds):
    """K ranks read part of an epoch, the rest is re-dealt to K' ranks (redeal), they read
    part of it, it is re-dealt again: every frame of the epoch comes out exactly once, and
    every rank of a deal reads as many frames as the others (one more at most)."""
    from hpcsgd.data.loader import redeal
    path, _ = small_archive
    kw = dict(context=CONTEXT, cmvn="none", block_frames=500, buffer_frames=1500, seed=3,
              max_batch=97)
    epoch, seen, deal = 1, [], None
    first = worlds[0]
    loaders = [FrameLoader(path, r, first, **kw) for r in range(first)]
    standard = loaders[0].plan.rank_frames(epoch)
    for step, world in enumerate(worlds):
        if step:   # the rest of the epoch, dealt to `world` ranks
            deal = redeal(deal, offsets, world, standard)
            loaders = [FrameLoader(path, r, world, **kw) for r in range(world)]
            frames = loaders[0].epoch_frames(epoch, deal)
            assert frames.max() - frames.min() <= 1
        offsets = [0] * world
        for r, loader in enumerate(loaders):
            loader.start_epoch(epoch, 0, deal)
            budget = loader.remaining if step == len(worlds) - 1 else loader.remaining // 3
            while offsets[r] < budget:
                x, _ = loader.next_batch(min(97, budget - offsets[r]))
                seen.append(centre_ids(x))
                offsets[r] += len(x)
            loader.close()
    seen = np.concatenate(seen)
    total = FrameLoader(path, 0, 1, **kw).plan.rank_frames(epoch).sum()
    assert len(seen) == total and len(np.unique(seen)) == total


def test_a_re_dealt_stream_resumes_at_an_offset(small_archive):
    """A deal's stream started at a saved offset continues exactly where it stopped."""
    from hpcsgd.data.loader import redeal
    path, _ = small_archive
    kw = dict(context=CONTEXT, cmvn="none", block_frames=500, buffer_frames=1500, seed=3,
              max_batch=64)
    standard = FrameLoader(path, 0, 2, **kw).plan.rank_frames(0)
    deal = redeal(None, [100, 37], 3, standard)
    whole = FrameLoader(path, 1, 3, **kw)
    whole.start_epoch(0, 0, deal)
    ids = np.concatenate([centre_ids(whole.next_batch(64)[0]) for _ in range(5)])
    later = FrameLoader(path, 1, 3, **kw)
    later.start_epoch(0, 150, deal)
    np.testing.assert_array_equal(centre_ids(later.next_batch(64)[0]), ids[150:214])


def test_a_missing_archive_says_how_to_make_one(tmp_path):
    with pytest.raises(UserError, match=r"no such archive directory \(make it with `hpcsgd prep"):
        FrameLoader(str(tmp_path / "nowhere"))
    os.makedirs(tmp_path / "shards")
    open(tmp_path / "shards" / "shard-00000.h5", "w").close()
    with pytest.raises(UserError, match=r"the index step did not run: `hpcsgd prep --write-index"):
        FrameLoader(str(tmp_path / "shards"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(UserError, match=r"not an hpcsgd archive: make one with `hpcsgd prep"):
        FrameLoader(str(tmp_path / "empty"))
