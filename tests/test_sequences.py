"""The sequence loader: chunk windows, coverage over ranks, time-major layout, edges, order,
exact resume, re-deals in whole chunks, CMVN, prefetch."""
import numpy as np
import pytest

from hpcsgd.data.loader import redeal
from hpcsgd.data.sequences import SequenceLoader, fill_sequence, utterance_chunks
from hpcsgd.data.splice import cmvn_from_stats
from hpcsgd.errors import UserError

CHUNK, LEFT, RIGHT = 50, 3, 2
STEPS = LEFT + CHUNK + RIGHT
KW = dict(chunk=CHUNK, left_context=LEFT, right_context=RIGHT, cmvn="none",
          block_frames=500, buffer_frames=1500)


def open_loader(archive_dir, rank=0, world=1, seed=7, batch_chunks=7, **kw):
    return SequenceLoader(archive_dir, rank, world, seed=seed, max_batch=batch_chunks * STEPS,
                          **dict(KW, **kw))


def stream(archive_dir, epoch=0, rank=0, world=1, seed=7, offset=0, batch_chunks=7, deal=None,
           **kw):
    """All chunks of one rank's epoch as (x (T, chunks, D), y (T, chunks)), copied."""
    loader = open_loader(archive_dir, rank, world, seed, batch_chunks, **kw)
    loader.start_epoch(epoch, offset, deal)
    xs, ys = [], []
    while True:
        x, y = loader.next_batch(batch_chunks * CHUNK)
        if len(y) == 0:
            break
        assert x.flags.c_contiguous and x.dtype == np.float32 and y.dtype == np.int32
        xs.append(x.reshape(STEPS, len(y) // STEPS, x.shape[1]).copy())   # row t*B + b
        ys.append(y.reshape(STEPS, len(y) // STEPS).copy())
    loader.close()
    return np.concatenate(xs, axis=1), np.concatenate(ys, axis=1)


def frame_ids(x):
    return x[..., 0].astype(np.int64)


def expected_chunk(shards, labelled_ids):
    """The rows a chunk must have, from its labelled frames alone: (ids (T,), labels (T,))."""
    shard = labelled_ids[0] // 1_000_000
    feats, labels, offsets, *_ = shards[shard]
    first = labelled_ids % 1_000_000
    utt = np.searchsorted(offsets, first[0], side="right") - 1
    begin, length = offsets[utt], offsets[utt + 1] - offsets[utt]
    window, lo, hi = utterance_chunks(length, CHUNK)[(first[0] - begin) // CHUNK]
    frame = window - LEFT + np.arange(STEPS)
    rows = begin + np.clip(frame, 0, length - 1)
    want_y = np.where((frame >= lo) & (frame < hi), labels[rows], -1)
    return shard * 1_000_000 + rows, want_y


def test_utterance_chunks_short_exact_multiple_and_remainder():
    np.testing.assert_array_equal(utterance_chunks(7, 10), [[0, 0, 7]])      # L < chunk
    np.testing.assert_array_equal(utterance_chunks(10, 10), [[0, 0, 10]])    # L == chunk
    np.testing.assert_array_equal(utterance_chunks(30, 10),                  # L = 3 chunks
                                  [[0, 0, 10], [10, 10, 20], [20, 20, 30]])
    np.testing.assert_array_equal(utterance_chunks(34, 10),                  # last one shifted
                                  [[0, 0, 10], [10, 10, 20], [20, 20, 30], [24, 30, 34]])
    assert utterance_chunks(34, 10).dtype == np.int64


def test_fill_sequence_pads_with_edge_frames_and_masks_context():
    feats = np.arange(7, dtype=np.float32)[:, None] * [1, 10]
    labels = np.arange(100, 107, dtype=np.int32)
    x, y = np.full((10 + 3, 2), np.nan, np.float32), np.zeros(13, np.int32)
    fill_sequence(feats, labels, 0, 0, 7, 10, 2, 1, x, y)     # L < chunk: both edges padded
    want = np.clip(np.arange(-2, 11), 0, 6)
    np.testing.assert_array_equal(x, feats[want])
    np.testing.assert_array_equal(y, np.where((np.arange(-2, 11) >= 0) & (np.arange(-2, 11) < 7),
                                              labels[want], -1))
    with pytest.raises(ValueError):
        fill_sequence(feats, labels, 0, 0, 7, 10, 2, 2, x, y)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_ranks_label_every_frame_once_with_their_own_utterance(small_archive, world):
    out, shards = small_archive
    seen = []
    for rank in range(world):
        x, y = stream(out, epoch=1, rank=rank, world=world)
        ids = frame_ids(x)
        for b in range(ids.shape[1]):
            labelled = ids[y[:, b] >= 0, b]
            assert 1 <= len(labelled) <= CHUNK
            want_ids, want_y = expected_chunk(shards, labelled)
            # every row: a frame of the chunk's utterance, consecutive, clamped at its edges
            np.testing.assert_array_equal(ids[:, b], want_ids)
            np.testing.assert_array_equal(y[:, b], want_y)
            assert np.all(y[:LEFT, b] == -1) and np.all(y[LEFT + CHUNK:, b] == -1)
        seen.append(ids[y >= 0])
    seen = np.concatenate(seen)
    total = sum(len(s[1]) for s in shards)
    assert len(seen) == total and len(np.unique(seen)) == total   # once, in one rank


def test_order_per_seed_and_epoch(small_archive):
    out, _ = small_archive
    a, _ = stream(out, epoch=0)
    b, _ = stream(out, epoch=0)
    c, _ = stream(out, epoch=1)
    d, _ = stream(out, epoch=0, seed=8)
    np.testing.assert_array_equal(a, b)
    first = lambda x: frame_ids(x)[LEFT]   # noqa: E731  each chunk's first window frame
    assert not np.array_equal(first(a), first(c)) and not np.array_equal(first(a), first(d))
    assert sorted(first(a)) == sorted(first(c))
    # within a buffer chunks are shuffled: an utterance's chunks rarely follow each other
    assert np.mean(np.diff(first(a)) == CHUNK) < 0.3


def test_resume_at_a_chunk_offset_is_exact_and_units_are_checked(small_archive):
    out, _ = small_archive
    full_x, full_y = stream(out, epoch=2)
    x, y = stream(out, epoch=2, offset=3 * CHUNK)
    np.testing.assert_array_equal(x, full_x[:, 3:])
    np.testing.assert_array_equal(y, full_y[:, 3:])
    loader = open_loader(out)
    with pytest.raises(UserError, match=f"offset {3 * CHUNK + 1}"):
        loader.start_epoch(2, 3 * CHUNK + 1)
    loader.start_epoch(2, 0)
    with pytest.raises(ValueError, match="whole chunks"):
        loader.next_batch(CHUNK + 1)
    with pytest.raises(ValueError, match="max_batch"):
        loader.next_batch(8 * CHUNK)      # 8 chunks x STEPS rows > max_batch
    x, y = loader.next_batch(2 * CHUNK)
    assert x.shape == (2 * STEPS, 4) and y.shape == (2 * STEPS,)
    assert loader.position == {"epoch": 2, "offset": 2 * CHUNK}
    loader.close()
    with pytest.raises(UserError, match="max_batch"):
        SequenceLoader(out, max_batch=STEPS - 1, **KW)


def test_epoch_frames_are_chunk_slots_and_agree_across_ranks(small_archive):
    out, shards = small_archive
    chunks = sum(len(utterance_chunks(L, CHUNK)) for s in shards for L in np.diff(s[2]))
    views = [open_loader(out, r, 3).epoch_frames(4) for r in range(3)]
    for view in views[1:]:
        np.testing.assert_array_equal(view, views[0])
    assert views[0].sum() == chunks * CHUNK and np.all(views[0] % CHUNK == 0)
    for r in range(3):
        _, y = stream(out, epoch=4, rank=r, world=3)
        assert y.shape[1] * CHUNK == views[0][r]


def test_a_re_dealt_epoch_labels_every_unread_frame_once(small_archive):
    """2 ranks read part of an epoch, the rest goes to 3 (as hpcsgd/state.py re-deals)."""
    out, shards = small_archive
    epoch, seen, offsets = 3, [], [3 * CHUNK, 5 * CHUNK]
    for r, offset in enumerate(offsets):
        x, y = stream(out, epoch=epoch, rank=r, world=2)
        seen.append(frame_ids(x)[:, :offset // CHUNK][y[:, :offset // CHUNK] >= 0])
    new = [open_loader(out, r, 3) for r in range(3)]
    standard = new[0].plan_for(2).rank_frames(epoch)
    np.testing.assert_array_equal(standard, open_loader(out, 0, 2).epoch_frames(epoch))
    deal = redeal(None, offsets, 3, standard, unit=CHUNK)
    frames = new[0].epoch_frames(epoch, deal)
    assert np.all(frames % CHUNK == 0) and frames.max() - frames.min() <= CHUNK
    assert frames.sum() == standard.sum() - sum(offsets)
    for r in range(3):
        x, y = stream(out, epoch=epoch, rank=r, world=3, deal=deal)
        assert y.shape[1] * CHUNK == frames[r]
        seen.append(frame_ids(x)[y >= 0])
    seen = np.concatenate(seen)
    total = sum(len(s[1]) for s in shards)
    assert len(seen) == total and len(np.unique(seen)) == total
    with pytest.raises(UserError, match="cuts chunks"):
        new[0].start_epoch(epoch, 0, redeal(None, offsets, 3, standard))   # unit 1: cut


def test_cmvn_is_the_frame_loaders_per_speaker_normalisation(small_archive):
    out, shards = small_archive
    raw, y = stream(out, epoch=1)
    norm, y_norm = stream(out, epoch=1, cmvn="meanvar")
    np.testing.assert_array_equal(y, y_norm)
    ids = frame_ids(raw)
    for shard_no, (feats, _l, offsets, utt_spk, stats) in enumerate(shards):
        mine = ids // 1_000_000 == shard_no
        frames = ids[mine] % 1_000_000
        spk = utt_spk[np.searchsorted(offsets, frames, side="right") - 1]
        shift, scale = cmvn_from_stats(stats, True)
        np.testing.assert_allclose(norm[mine], (feats[frames] + shift[spk]) * scale[spk],
                                   rtol=1e-5, atol=1e-5)


def test_prefetch_on_and_off_give_the_same_stream(small_archive):
    out, _ = small_archive
    a = stream(out, epoch=5, world=2, rank=1, prefetch=True)
    b = stream(out, epoch=5, world=2, rank=1, prefetch=False)
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])


def test_attributes_match_the_frame_loaders_interface(small_archive):
    out, _ = small_archive
    loader = open_loader(out, 1, 2, cmvn="meanvar")
    assert (loader.rank, loader.world, loader.seed, loader.context) == (1, 2, 7, 0)
    assert loader.input_dim == loader.feature_dim == 4 and loader.num_labels == 5
    assert (loader.chunk, loader.unit, loader.steps) == (CHUNK, CHUNK, STEPS)
    assert loader.max_batch == 7 * STEPS
    with pytest.raises(UserError):
        SequenceLoader(out, chunk=0)
    with pytest.raises(UserError):
        SequenceLoader(out, left_context=-1)
