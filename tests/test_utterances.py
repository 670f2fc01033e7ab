"""hpcsgd.data.utterances: whole-utterance batches bucketed by length, dealt over data ranks.

Every kept utterance exactly once per epoch, batches within their frame and padding budget,
parts sorted longest first and balanced across ranks, the same epoch from the same seed and a
different one from another epoch, a resume from the offsets giving the same batches (also at
another number of ranks: the rest of the epoch, each utterance once), double buffering's
halves, SpecAugment drawn per utterance, the length limit, the targets equal to the archive's
tokens and the features to the archive's frames."""
import os

import numpy as np
import pytest

from conftest import make_archive
from hpcsgd.data import archive
from hpcsgd.data.utterances import PAD_SLACK, SpecAugment, UtteranceLoader, snake
from hpcsgd.errors import UserError


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = tmp_path_factory.mktemp("utt") / "a"
    make_archive(str(out), num_shards=3, utts_per_shard=20, dim=3, min_len=20, max_len=300,
                 token_kinds=("phones",), num_tokens=9)
    return str(out)


def _epoch(arch, world, minibatch=1500, epoch=0, seed=3, offsets=None, **kw):
    """Every step of an epoch as [per-rank (utterance ids, frames, x, targets)], all ranks'
    loaders stepping together from the offsets (default: the epoch's start)."""
    loaders = [UtteranceLoader(arch, r, world, seed=seed, minibatch=minibatch, prefetch=r == 0,
                               **kw) for r in range(world)]
    offsets = np.zeros(world, np.int64) if offsets is None else np.array(offsets, np.int64)
    total = loaders[0].epoch_frames(epoch).sum()
    for loader in loaders:
        loader.resume(epoch, offsets)
    steps = []
    while offsets.sum() < total:
        takes = [loader.take(minibatch, offsets) for loader in loaders]
        assert all(np.array_equal(t, takes[0]) for t in takes)   # every rank knows every rank's
        step = []
        for r, loader in enumerate(loaders):
            part = loader._groups[0]
            x, targets = loader.next_batch(int(takes[0][r]))
            step.append(([loader.utt_ids[u] for u in part], takes[0][r], x.copy(), targets))
        steps.append(step)
        offsets = offsets + takes[0]
    for loader in loaders:
        loader.close()
    return steps, loaders[0]


def test_an_epoch_trains_every_utterance_once_in_budget(arch):
    steps, loader = _epoch(arch, 2)
    names = [u for step in steps for part in step for u in part[0]]
    assert sorted(names) == sorted(loader.utt_ids) and len(set(names)) == len(names)
    longest = int(loader.lengths.max())
    for step in steps:
        frames = [int(loader.lengths[loader.utt_ids.index(u)]) for part in step for u in part[0]]
        assert sum(frames) <= 1500 or len(frames) == 1
        assert len(frames) * max(frames) <= PAD_SLACK * 1500 or len(frames) == 1
        counts = [len(part[0]) for part in step]
        assert max(counts) - min(counts) <= 1                      # snake: balanced counts
        for names_r, n, x, targets in step:
            lengths = targets.frames
            assert np.all(np.diff(lengths) <= 0) and lengths.sum() == n   # longest first
            assert len(x) == (lengths[0] if len(lengths) else 0) * len(lengths)
            assert len(x) <= loader.max_rows and len(x) <= PAD_SLACK * 1500 / 2 + longest


def test_batches_hold_the_archives_frames_tokens_and_zero_padding(arch):
    steps, loader = _epoch(arch, 1, cmvn="none")
    index = archive.read_index(arch)
    shards = [os.path.join(arch, s["file"]) for s in index["shards"]]
    feats = {}
    for s, path in enumerate(shards):
        meta = archive.read_shard_meta(path)
        ids, offsets = archive.read_shard_tokens(path, "phones")
        with archive.open_shard(path) as f:
            data = f["feats"][()]
        for u, utt in enumerate(meta["utt_ids"]):
            a, b = meta["utt_offsets"][u], meta["utt_offsets"][u + 1]
            feats[utt] = (data[a:b], ids[offsets[u]:offsets[u + 1]])
    for step in steps:
        names, _, x, targets = step[0]
        nb, steps_ = len(names), int(targets.frames[0])
        x_tb = x.reshape(steps_, nb, -1)
        for b, utt in enumerate(names):
            frames, tokens = feats[utt]
            assert np.array_equal(x_tb[:len(frames), b], frames)    # cmvn none: as stored
            assert not x_tb[len(frames):, b].any()                  # zero padding
            got = targets.ids[targets.offsets[b]:targets.offsets[b + 1]]
            assert np.array_equal(got, tokens)


def test_epochs_are_deterministic_and_differ(arch):
    one, _ = _epoch(arch, 2, epoch=1)
    two, _ = _epoch(arch, 2, epoch=1)
    other, _ = _epoch(arch, 2, epoch=2)
    names = lambda steps: [tuple(p[0]) for s in steps for p in s]   # noqa: E731
    assert names(one) == names(two)
    assert all(np.array_equal(a[2], b[2]) for s, t in zip(one, two) for a, b in zip(s, t))
    assert names(one) != names(other)


def test_resume_from_offsets_gives_the_same_batches_also_at_another_world(arch):
    """A resume after 3 steps at 2 ranks gives the remaining steps bit for bit; at 3 ranks
    (state.load's redeal: only the frames trained count) the same global batches, each
    utterance once, dealt over three."""
    full, loader = _epoch(arch, 2)
    done = np.sum([[p[1] for p in step] for step in full[:3]], axis=0)
    rest, _ = _epoch(arch, 2, offsets=done)
    assert len(rest) == len(full) - 3
    for s, t in zip(full[3:], rest):
        for a, b in zip(s, t):
            assert a[0] == b[0] and np.array_equal(a[2], b[2])
    _, offsets = loader.redeal(None, done.tolist(), 3, 0)
    three, _ = _epoch(arch, 3, offsets=offsets)
    assert [sorted(u for p in s for u in p[0]) for s in three] == \
        [sorted(u for p in s for u in p[0]) for s in full[3:]]


def test_minibatch_may_change_between_steps(arch):
    """The automatic minibatch size: a step at another size from the same offsets takes the
    next utterances of the same order; the epoch still trains each once."""
    loaders = [UtteranceLoader(arch, r, 2, seed=3, minibatch=1500, max_minibatch=3000,
                               prefetch=False) for r in range(2)]
    offsets, seen = np.zeros(2, np.int64), []
    total = loaders[0].epoch_frames(0).sum()
    for loader in loaders:
        loader.resume(0, offsets)
    k = 0
    while offsets.sum() < total:
        size = (1500, 600, 3000)[k % 3]
        take = [loader.take(size, offsets) for loader in loaders][0]
        for r, loader in enumerate(loaders):
            seen += [loader.utt_ids[u] for u in loader._groups[0]]
            loader.next_batch(int(take[r]))
        offsets, k = offsets + take, k + 1
    assert sorted(seen) == sorted(loaders[0].utt_ids)


def test_halves_split_each_part_into_two_sorted_halves(arch):
    loader = UtteranceLoader(arch, 1, 2, seed=3, minibatch=2000, prefetch=False)
    loader.resume(0, [0, 0])
    take = loader.take(2000, [0, 0])
    part = loader._groups[0].copy()
    first, second = loader.halves(take)
    assert np.array_equal(first + second, take)
    x1, t1 = loader.next_batch(int(first[1]))
    x2, t2 = loader.next_batch(int(second[1]))
    assert np.array_equal(np.sort(np.concatenate([t1.frames, t2.frames])),
                          np.sort(loader.lengths[part]))
    assert np.all(np.diff(t1.frames) <= 0) and np.all(np.diff(t2.frames) <= 0)


def test_snake_deal():
    assert snake(7, 3).tolist() == [0, 1, 2, 2, 1, 0, 0]
    assert snake(2, 4).tolist() == [0, 1]


def test_specaugment_is_drawn_per_utterance_and_epoch(arch):
    """The same masks whatever batch an utterance is in (another minibatch size, another
    rank count) and the same on a resume; other masks in another epoch; masked values 0."""
    spec = SpecAugment(2, 2, 2, 10, 0.2)
    plain, _ = _epoch(arch, 1, minibatch=1500)
    masked, _ = _epoch(arch, 1, minibatch=1500, spec=spec)
    other, _ = _epoch(arch, 2, minibatch=700, spec=spec)

    def rows(steps):
        out = {}
        for step in steps:
            for names, _, x, targets in step:
                nb, T = len(names), int(targets.frames[0]) if len(names) else 0
                for b, utt in enumerate(names):
                    out[utt] = x.reshape(T, nb, -1)[:targets.frames[b], b]
        return out
    a, b, c = rows(plain), rows(masked), rows(other)
    changed = 0
    for utt in a:
        assert np.array_equal(b[utt], c[utt])
        diff = a[utt] != b[utt]
        assert np.all(b[utt][diff] == 0)
        changed += diff.any()
    assert changed > len(a) // 2
    later, _ = _epoch(arch, 1, minibatch=1500, epoch=1, spec=spec)
    assert any(not np.array_equal(rows(later)[u], b[u]) and (rows(later)[u] == 0).any()
               for u in a)


def test_max_frames_leaves_out_and_names(arch):
    loader = UtteranceLoader(arch, 0, 1, minibatch=1500, max_frames=100, prefetch=False)
    long = [u for u, n in zip(loader.utt_ids, loader.lengths) if n > 100]
    assert sorted(u for u, _ in loader.dropped) == sorted(long) and long
    assert loader.frames_per_epoch == int(loader.lengths[loader.lengths <= 100].sum())
    with pytest.raises(UserError, match="no utterance"):
        UtteranceLoader(arch, 0, 1, max_frames=5, prefetch=False)
    with pytest.raises(UserError, match="no chars tokens"):
        UtteranceLoader(arch, 0, 1, tokens="chars", prefetch=False)


def test_eval_batches_cover_the_archive_once_over_ranks(arch):
    seen = []
    for rank in range(3):
        loader = UtteranceLoader(arch, rank, 3, minibatch=800, prefetch=False)
        for names, x, targets in loader.eval_batches(800):
            assert len(x) <= 800 and np.all(np.diff(targets.frames) <= 0)
            seen += names
    assert sorted(seen) == sorted(UtteranceLoader(arch, prefetch=False).utt_ids)
