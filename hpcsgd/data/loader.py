"""Minibatches for the trainer: rank-disjoint, shuffled, spliced and CMVN-normalised frames.

The data path of one rank in one epoch:

  index.json --plan--> blocks (fixed frame ranges inside shards, from the index alone)
     --permute(seed, epoch), deal every K-th block to rank r--> this rank's blocks
     --group into RAM buffers of <= buffer_frames--> read feats (+C context frames) and labels,
       apply per-speaker CMVN, permute the buffer's frames (seed, epoch, rank, buffer)
     --concatenate--> this rank's frame *stream* for the epoch
     --splice +-C frames (Numba) on demand--> minibatch (x, y)

Because the plan needs only index.json, every rank knows every rank's frame count without
communicating (`rank_frames`), and a rank's position is one number: the frame offset into its
stream. Resume = rebuild the same stream and start at the saved offset; a change of minibatch
size mid-epoch (automatic minibatch-size selection) just reads a different count next time.

A background thread loads the next buffer while the trainer computes; splicing happens in the
caller's thread into one preallocated output, so a returned batch is valid until the next call.
"""
import os
import queue
import threading

import numpy as np

from hpcsgd.data import BLOCK_FRAMES, BUFFER_FRAMES, archive
from hpcsgd.data import cmvn as norm
from hpcsgd.data.splice import apply_cmvn, splice_gather
from hpcsgd.errors import UserError


def _rng(seed, *keys):
    """One independent generator per (seed, epoch, rank, buffer ...) tuple."""
    return np.random.default_rng([seed, *keys])


def local_batch_size(global_batch, rank, world):
    """This rank's share of a global minibatch: the first N mod K ranks take one more frame."""
    return global_batch // world + (1 if rank < global_batch % world else 0)


def batch_split(global_batch, world, unit=1):
    """Every data rank's share of a global minibatch (local_batch_size of each), as int64, in
    whole units of `unit` frames (1: frames; the sequence loader: chunks of `unit` slots, a
    remainder below one unit is not dealt)."""
    return unit * np.array([local_batch_size(global_batch // unit, r, world)
                            for r in range(world)], np.int64)


def redeal(deal, offsets, world, standard, unit=1):
    """An epoch dealt anew to `world` ranks mid-way, nothing trained twice or skipped: what
    every old rank has not yet read -- its segments from its offset on, in old rank order --
    is cut into `world` contiguous parts of as equal frames as possible (the first ranks one
    frame more). deal: the old deal, or None for the standard one, whose rank r reads
    [0, standard[r]) of its own plan's stream (standard: the old plan's rank_frames, of
    old_world = len(offsets) ranks). A segment is (plan world, plan rank, lo, hi). Returns
    the new deal: a list of `world` segment lists. Pure: every rank computes the same.
    unit: parts are cut in whole units (the loader's `unit`: 1 frame, or one chunk's slots);
    every segment bound and offset must then be a multiple of it."""
    old_world = len(offsets)
    if deal is None:
        deal = [[(old_world, r, 0, int(standard[r]))] for r in range(old_world)]
    rest = []   # every unread segment, in order
    for segs, offset in zip(deal, offsets):
        skip = int(offset)
        for plan_world, plan_rank, lo, hi in segs:
            done = min(skip, hi - lo)     # read already
            skip -= done
            if lo + done < hi:
                rest.append((plan_world, plan_rank, lo + done, hi))
    total = sum(hi - lo for *_, lo, hi in rest)
    if total % unit:
        raise ValueError(f"redeal: {total} unread frames are not whole units of {unit}")
    units = total // unit
    share = [unit * (units // world + (1 if r < units % world else 0)) for r in range(world)]
    new, k = [[] for _ in range(world)], 0
    for plan_world, plan_rank, lo, hi in rest:
        while lo < hi:
            while k < world and share[k] == 0:
                k += 1
            take = min(hi - lo, share[k])
            new[k].append((plan_world, plan_rank, lo, lo + take))
            share[k] -= take
            lo += take
    return new


def block_frames_of(blocks):
    """Frames of each block row (shard, begin, end)."""
    return blocks[:, 2] - blocks[:, 1]


class Plan:
    """Blocks of the archive and their assignment to ranks, computed from index.json only.

    units: block rows -> what each block adds to its rank's stream (default: its frames; the
    sequence loader: its chunks' frame slots); rank_frames counts in these units, while
    buffers are still grouped by frames (what they hold in RAM)."""

    def __init__(self, index, world, seed, block_frames=BLOCK_FRAMES, buffer_frames=BUFFER_FRAMES,
                 units=block_frames_of):
        if block_frames < 1 or buffer_frames < block_frames:
            raise UserError(f"loader: need 1 <= block_frames ({block_frames}) <= buffer_frames "
                            f"({buffer_frames})")
        self.index, self.world, self.seed = index, world, seed
        self.buffer_frames = buffer_frames
        blocks = []
        for s, shard in enumerate(index["shards"]):
            for start in range(0, shard["frames"], block_frames):
                blocks.append((s, start, min(start + block_frames, shard["frames"])))
        self.blocks = np.array(blocks, dtype=np.int64).reshape(-1, 3)
        if len(self.blocks) < world:
            raise UserError(f"{index['dir']}: {len(self.blocks)} blocks of {block_frames} frames "
                            f"cannot feed {world} ranks; use a smaller loader block size")
        self.units = units
        self.sizes = np.asarray(units(self.blocks), np.int64)

    def rank_blocks(self, epoch, rank):
        """Block rows of `rank` in epoch order: the epoch's permutation, every world-th entry."""
        order = _rng(self.seed, epoch).permutation(len(self.blocks))
        return self.blocks[order[rank::self.world]]

    def rank_frames(self, epoch):
        """Frames (stream units) each rank streams in `epoch` (identical on all ranks, no
        communication)."""
        order = _rng(self.seed, epoch).permutation(len(self.blocks))
        return np.array([int(self.sizes[order[r::self.world]].sum()) for r in range(self.world)])

    def rank_buffers(self, epoch, rank):
        """This rank's blocks grouped into consecutive buffers of <= buffer_frames frames."""
        buffers, current, frames = [], [], 0
        for block in self.rank_blocks(epoch, rank):
            size = int(block[2] - block[1])
            if current and frames + size > self.buffer_frames:
                buffers.append(np.array(current))
                current, frames = [], 0
            current.append(block)
            frames += size
        if current:
            buffers.append(np.array(current))
        return buffers


class Buffer:
    """One RAM buffer: normalised frames with context, labels, and the shuffled frame order.

    feats rows hold each block's frames plus up to C context frames each side (read from the
    shard, so splicing at a block edge sees the real neighbours); src/lo/hi give, per block
    frame, its row and its utterance's first and last row (splicing clamps there).
    """

    def __init__(self, feats, labels, src, lo, hi, order):
        self.feats, self.labels, self.src, self.lo, self.hi, self.order = \
            feats, labels, src, lo, hi, order

    def __len__(self):
        return len(self.order)


class FrameLoader:
    """Spliced, normalised, shuffled minibatches of one rank. See the module docstring.

    unit: the stream's accounting unit in frames (1 here; hpcsgd/data/sequences.py, a
    subclass, streams whole chunks). Subclasses change what a buffer holds (_load_buffer),
    what a block adds to the stream (_block_units) and how a batch is gathered (next_batch).
    """
    unit = 1

    def __init__(self, archive_dir, rank=0, world=1, context=5, cmvn="meanvar", seed=0,
                 max_batch=1024, block_frames=BLOCK_FRAMES, buffer_frames=BUFFER_FRAMES,
                 prefetch=True):
        norm.spec(cmvn)   # a bad kind or scope named before any file is read
        if not 0 <= rank < world:
            raise UserError(f"loader: rank {rank} outside world of {world}")
        self.index = archive.read_index(archive_dir)
        self.dir = self.index["dir"]
        self.rank, self.world, self.context, self.seed = rank, world, context, seed
        self.cmvn, self.prefetch = cmvn, prefetch
        self.feature_dim = int(self.index["feature_dim"])
        self.input_dim = (2 * context + 1) * self.feature_dim
        self.num_labels = int(self.index["num_labels"])
        # shard number -> (utt_offsets, each row's normaliser: its speaker's, or its
        # utterance's under data.cmvn_scope utterance, their shift and scale rows, path)
        self._meta = {}
        self.plan = Plan(self.index, world, seed, block_frames, buffer_frames, self._block_units)
        self.plan_block_frames, self._plans = block_frames, {}
        self.max_batch = int(max_batch)
        self._out_x = np.empty((max_batch, self.input_dim), np.float32)
        self._out_y = np.empty(max_batch, np.int32)
        self._epoch = None
        self._files = {}

    # --- reading one buffer -------------------------------------------------------------
    def _block_units(self, blocks):
        """What each block row adds to this loader's stream: its frames."""
        return block_frames_of(blocks)

    def _shard_meta(self, s):
        if s not in self._meta:
            path = os.path.join(self.dir, self.index["shards"][s]["file"])
            meta = archive.read_shard_meta(path)
            if meta["attrs"]["feature_dim"] != self.feature_dim:
                raise UserError(f"{path}: feature dim {meta['attrs']['feature_dim']} differs "
                                f"from the index ({self.feature_dim})")
            offsets = meta["utt_offsets"]
            rows = norm.speaker_rows(self.cmvn, meta["cmvn_stats"])
            owner = meta["utt_spk"]
            if rows is None:   # each utterance's own statistics: one pass over the shard
                with archive.open_shard(path) as f:
                    rows = norm.utterance_rows(self.cmvn, f["feats"], offsets)
                owner = np.arange(len(offsets) - 1)
            frame_spk = np.repeat(owner, np.diff(offsets)).astype(np.int32)
            self._meta[s] = (offsets, frame_spk, rows[0], rows[1], path)
        return self._meta[s]

    def _open(self, s, path):
        """Shard files stay open for the epoch; only the loading thread touches them."""
        if s not in self._files:
            self._files[s] = archive.open_shard(path)
        return self._files[s]

    def _load_buffer(self, epoch, job):
        """Read, normalise and shuffle one buffer (runs in the prefetch thread); job =
        (plan world, plan rank, buffer number, blocks, first, end): the buffer is that rank's
        under that plan, so its frame order is too."""
        _, plan_rank, number, blocks = job[:4]
        C = self.context
        frames = int((blocks[:, 2] - blocks[:, 1]).sum())
        rows = int(sum(min(self.index["shards"][s]["frames"], e + C) - max(0, b - C)
                       for s, b, e in blocks))
        feats = np.empty((rows, self.feature_dim), np.float32)
        labels = np.empty(frames, np.int32)
        src = np.empty(frames, np.int64)
        lo = np.empty(frames, np.int64)
        hi = np.empty(frames, np.int64)
        row, pos = 0, 0
        for s, begin, end in blocks:
            offsets, frame_spk, shift, scale, path = self._shard_meta(int(s))
            w0 = max(0, begin - C)
            w1 = min(len(frame_spk), end + C)
            f = self._open(int(s), path)
            try:
                f["feats"].read_direct(feats, np.s_[w0:w1], np.s_[row:row + w1 - w0])
                labels[pos:pos + end - begin] = f["labels"][begin:end]
            except (OSError, ValueError, KeyError) as err:
                raise UserError(f"{path}: cannot read frames {w0}..{w1} ({err}); "
                                f"truncated or corrupt shard?") from None
            window = feats[row:row + w1 - w0]
            apply_cmvn(window, frame_spk[w0:w1], shift, scale)
            n = end - begin
            frame = np.arange(begin, end)
            utt = np.searchsorted(offsets, frame, side="right") - 1
            src[pos:pos + n] = row + frame - w0
            lo[pos:pos + n] = row + np.maximum(offsets[utt], w0) - w0
            hi[pos:pos + n] = row + np.minimum(offsets[utt + 1], w1) - 1 - w0
            row += w1 - w0
            pos += n
        order = _rng(self.seed, epoch, plan_rank, number).permutation(frames)
        return Buffer(feats, labels, src, lo, hi, order)

    # --- the epoch stream ---------------------------------------------------------------
    def plan_for(self, world):
        """The block plan for `world` ranks (this loader's own, or another's for a re-dealt
        epoch: hpcsgd/data/loader.py, redeal)."""
        if world == self.world:
            return self.plan
        if world not in self._plans:
            self._plans[world] = Plan(self.index, world, self.seed, self.plan_block_frames,
                                      self.plan.buffer_frames, self._block_units)
        return self._plans[world]

    def segments(self, epoch, deal=None):
        """This rank's stream in `epoch` as segments (plan world, plan rank, lo, hi): the
        standard one, or its part of a deal (see redeal)."""
        if deal is not None:
            return [tuple(seg) for seg in deal[self.rank]]
        return [(self.world, self.rank, 0, int(self.plan.rank_frames(epoch)[self.rank]))]

    def epoch_frames(self, epoch, deal=None):
        """Frames every rank streams in `epoch` (the same on all ranks, no communication)."""
        if deal is None:
            return self.plan.rank_frames(epoch)
        return np.array([sum(hi - lo for _, _, lo, hi in segs) for segs in deal], np.int64)

    @property
    def frames_per_epoch(self):
        """Frames an epoch trains on (the linear schedule's length is epochs times this)."""
        return int(self.index["total_frames"])

    # --- the step's contract with the spine (the same calls as the utterance loader's) ----
    def resume(self, epoch, offsets, deal=None):
        """Start (or continue) `epoch` at this rank's offset among every data rank's."""
        self.start_epoch(epoch, int(offsets[self.rank]), deal)

    def take(self, minibatch, offsets, rank_frames):
        """The next step's frames on every data rank: its share of the global minibatch, in
        whole units, or what is left of its epoch."""
        return np.minimum(batch_split(minibatch, self.world, self.unit),
                          np.asarray(rank_frames) - np.asarray(offsets))

    def halves(self, take):
        """Double buffering's halves of a step: (take + 1) // 2 then the rest, in units."""
        first = (take // self.unit + 1) // 2 * self.unit
        return [first, take - first]

    def redeal(self, deal, offsets, world, epoch):
        """A checkpoint's position (the deal and offsets of len(offsets) ranks mid-epoch)
        for `world` ranks: the frames none has trained re-dealt (redeal); -> (deal, offsets)."""
        if not any(offsets):
            return None, [0] * world
        standard = self.plan_for(len(offsets)).rank_frames(epoch)
        return redeal(deal, offsets, world, standard, self.unit), [0] * world

    def start_epoch(self, epoch, offset=0, deal=None):
        """Begin streaming `epoch` at frame `offset` of this rank's stream (0, or a saved one);
        deal: the epoch re-dealt over this world (None: every rank its own plan's stream)."""
        self.close()
        jobs = []   # (plan world, plan rank, buffer number, blocks, first, end)
        for world, rank, lo, hi in self.segments(epoch, deal):
            at = 0
            for number, blocks in enumerate(self.plan_for(world).rank_buffers(epoch, rank)):
                size = int(self._block_units(blocks).sum())
                first, end = max(lo - at, 0), min(hi - at, size)
                if first < end:
                    jobs.append((world, rank, number, blocks, first, end))
                at += size
        total = sum(end - first for *_, first, end in jobs)
        if not 0 <= offset <= total:
            raise UserError(f"loader: saved offset {offset} outside epoch {epoch} of rank "
                            f"{self.rank} ({total} frames); was the archive or world size changed?")
        skipped = 0
        while jobs and skipped + jobs[0][5] - jobs[0][4] <= offset:   # whole buffers done
            skipped += jobs[0][5] - jobs[0][4]
            jobs.pop(0)
        if jobs:   # the first buffer starts at the resume point
            jobs[0] = jobs[0][:4] + (jobs[0][4] + offset - skipped, jobs[0][5])
        self._epoch = epoch
        self._total = total
        self._offset = offset
        self._current = None
        self._queue = queue.Queue(maxsize=1)   # one buffer ahead: memory stays at 2-3 buffers
        self._stop = threading.Event()
        if self.prefetch:
            self._thread = threading.Thread(target=self._producer, args=(epoch, jobs), daemon=True)
            self._thread.start()
        else:
            self._jobs = iter(jobs)
            self._thread = None

    def _producer(self, epoch, jobs):
        try:
            for job in jobs:
                if not self._put((self._load_buffer(epoch, job), job[4], job[5])):
                    return
            self._put(None)  # end of this rank's stream
        except BaseException as err:  # handed to the trainer's thread, raised there
            self._put(err)

    def _put(self, item):
        """Queue put that gives up when close() asks the thread to stop (never deadlocks)."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _next_buffer(self):
        """(buffer, first, end): the next buffer and the range of its order to stream."""
        if self._thread is None:
            job = next(self._jobs)
            return self._load_buffer(self._epoch, job), job[4], job[5]
        item = self._queue.get()   # waits only if the trainer outruns the prefetch thread
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise RuntimeError("loader: stream ended before `remaining` reached 0")
        return item

    @property
    def position(self):
        """What a checkpoint stores to resume this rank exactly."""
        return {"epoch": self._epoch, "offset": self._offset}

    @property
    def remaining(self):
        return self._total - self._offset

    def next_batch(self, n):
        """Up to n spliced frames: (x (m, input_dim) float32, y (m,) int32), m < n only at the
        end of the epoch (0 when exhausted). Views into one output buffer: valid until the
        next call."""
        if n > len(self._out_y):
            raise ValueError(f"batch of {n} frames exceeds the loader's max_batch {len(self._out_y)}")
        n = min(n, self.remaining)
        filled = 0
        while filled < n:
            if self._current is None:
                self._current, self._in_buffer, self._end = self._next_buffer()
            buf = self._current
            take = min(n - filled, self._end - self._in_buffer)
            order = buf.order[self._in_buffer:self._in_buffer + take]
            splice_gather(buf.feats, buf.src, buf.lo, buf.hi, order, self.context,
                          self._out_x[filled:filled + take])
            self._out_y[filled:filled + take] = buf.labels[order]
            self._in_buffer += take
            filled += take
            if self._in_buffer == self._end:
                self._current = None
        self._offset += n
        return self._out_x[:n], self._out_y[:n]

    def close(self):
        if getattr(self, "_thread", None) is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        for f in self._files.values():
            f.close()
        self._files = {}


def iter_utterances(archive_dir, rank=0, world=1, epoch=0, seed=0, cmvn="meanvar",
                    block_frames=BLOCK_FRAMES, shuffle=True):
    """Whole utterances for sequence models (LSTMs): (utt_id, feats (T, D), labels (T,)).

    Rank-disjoint by the same block plan: an utterance belongs to the block holding its first
    frame. Order: shuffled with (seed, epoch, rank), or archive order with shuffle=False
    (inference). CMVN applied.
    """
    index = archive.read_index(archive_dir)
    plan = Plan(index, world, seed, block_frames, max(block_frames, BUFFER_FRAMES))
    mine = []
    for s, begin, end in plan.rank_blocks(epoch, rank):
        path = os.path.join(index["dir"], index["shards"][s]["file"])
        offsets = archive.read_shard_meta(path)["utt_offsets"]
        first = np.searchsorted(offsets[:-1], begin, side="left")
        last = np.searchsorted(offsets[:-1], end, side="left")
        mine.extend((int(s), int(u)) for u in range(first, last))
    if shuffle:
        order = _rng(seed, epoch, rank).permutation(len(mine))
    else:
        order = sorted(range(len(mine)), key=lambda k: mine[k])
    metas = {}
    for k in order:
        s, u = mine[k]
        if s not in metas:
            path = os.path.join(index["dir"], index["shards"][s]["file"])
            meta = archive.read_shard_meta(path)
            metas[s] = (path, meta, norm.speaker_rows(cmvn, meta["cmvn_stats"]))
        path, meta, rows = metas[s]
        b, e = meta["utt_offsets"][u], meta["utt_offsets"][u + 1]
        with archive.open_shard(path) as f:
            feats = f["feats"][b:e]
            labels = f["labels"][b:e]
        yield meta["utt_ids"][u], norm.normalise(cmvn, feats, rows, meta["utt_spk"][u]), labels
