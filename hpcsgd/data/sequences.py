"""Minibatches of fixed-length sequences for (Bi)LSTM training: utterances cut into chunks.

Chunks (Kaldi's nnet3 chunking, without overlap of the labelled parts):
  an utterance of L frames gives ceil(L / chunk) chunks; chunk j LABELS frames
  [j*chunk, min((j+1)*chunk, L)). Its window of `chunk` frames starts at
  min(j*chunk, max(L - chunk, 0)): the last chunk is shifted back to end at the utterance end,
  so its frames are real, and the frames it shares with chunk j-1 get label -1. When
  L < chunk the window starts at 0 and runs past the end. The sequence fed to the model is
  left_context + chunk + right_context = `steps` frames: the window with context around it.
  Positions outside [0, L) repeat the utterance's first/last frame (edge padding); context
  and padding frames have label -1. So every labelled frame of the archive is labelled in
  exactly one chunk per epoch, and a chunk labels between 1 and `chunk` frames.

The stream: SequenceLoader is a FrameLoader (hpcsgd/data/loader.py) whose stream unit is the
chunk. The same block plan is permuted per (seed, epoch) and dealt to ranks; an utterance
belongs to the block holding its first frame (as loader.iter_utterances) and is read whole,
so a buffer may hold frames past its blocks' ends. A rank's blocks are grouped into RAM
buffers, each buffer's chunks shuffled with (seed, epoch, plan rank, buffer): FrameLoader's
two-level shuffle, prefetch thread, deal and resume, unchanged.

Accounting: every chunk counts as `chunk` frame slots, labelled or not (unit = chunk), so
epoch_frames, position["offset"], remaining, deals and next_batch(n) are in slots, multiples
of chunk. Per-rank counts come from index.json and the shards' utt_offsets only: identical on
every rank without communication.

Batches are TIME-MAJOR: next_batch(n) returns B = n / chunk chunks as x (steps*B, D) and
y (steps*B,), row t*B + b = time step t of chunk b; views into preallocated buffers of
max_batch ROWS (valid until the next call).
"""
import numpy as np

from hpcsgd.data import BLOCK_FRAMES, BUFFER_FRAMES
from hpcsgd.data.loader import FrameLoader, _rng
from hpcsgd.data.splice import apply_cmvn
from hpcsgd.errors import UserError


def sequence_steps(data):
    """A sequence model's training sequence length (left context + chunk + right context)
    from the checkpoint's data meta; None for a frame model."""
    if "chunk" not in data:
        return None
    return data["left_context"] + data["chunk"] + data["right_context"]


def chunk_counts(lengths, chunk):
    """Chunks of each utterance of the given lengths: ceil(L / chunk)."""
    return -(-np.asarray(lengths, np.int64) // chunk)


def chunk_windows(lengths, chunk):
    """Every chunk of utterances of the given lengths, in utterance order: (utterance index,
    window start, label lo, label hi), four int64 arrays, positions within the utterance."""
    lengths = np.asarray(lengths, np.int64)
    counts = chunk_counts(lengths, chunk)
    utt = np.repeat(np.arange(len(lengths)), counts)
    j = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    length = lengths[utt]
    lo = j * chunk
    hi = np.minimum(lo + chunk, length)
    window = np.minimum(lo, np.maximum(length - chunk, 0))   # the last one ends at L if it can
    return utt, window, lo, hi


def utterance_chunks(length, chunk):
    """The chunks of one utterance of `length` frames: int64 (n_chunks, 3) rows of
    (window_start, label_lo, label_hi)."""
    _, window, lo, hi = chunk_windows([length], chunk)
    return np.stack([window, lo, hi], axis=1)


def gather_sequences(feats, labels, start, length, window, lo, hi, left, out_x, out_y):
    """Fill nb sequences at once, time-major: out_x (T, nb, D), out_y (T, nb) views.

    Sequence b is rows start[b] + clip(window[b] - left + t, 0, length[b] - 1) of feats
    (an utterance of length[b] frames starting at row start[b]); its label is labels of that
    row where window[b] - left + t lies in [lo[b], hi[b]), else -1."""
    steps = out_x.shape[0]
    frame = window - left + np.arange(steps)[:, None]     # (T, nb) position in the utterance
    row = start + np.clip(frame, 0, length - 1)            # edge padding
    np.take(feats, row, axis=0, out=out_x, mode="clip")    # indices are in range already
    np.take(labels, row, out=out_y, mode="clip")
    out_y[(frame < lo) | (frame >= hi)] = -1               # context, padding, labelled twice


def fill_sequence(feats, labels, window_start, label_lo, label_hi, chunk, left, right,
                  out_x, out_y):
    """One sequence of an utterance (feats (L, D), labels (L,)) into out_x (T, D) and
    out_y (T,), T = left + chunk + right; window and labelled range from utterance_chunks."""
    steps = left + chunk + right
    if len(out_x) != steps or len(out_y) != steps:
        raise ValueError(f"fill_sequence: outputs of {len(out_x)}, {len(out_y)} rows, "
                         f"need {steps}")
    one = np.zeros(1, np.int64)
    gather_sequences(feats, labels, one, one + len(feats), one + window_start, one + label_lo,
                     one + label_hi, left, out_x[:, None], out_y[:, None])


class ChunkBuffer:
    """One RAM buffer: its utterances' normalised frames and labels, one row per chunk in
    `table` (utterance start row, length, window start, label lo, label hi), and the shuffled
    chunk order."""

    def __init__(self, feats, labels, table, order):
        self.feats, self.labels, self.table, self.order = feats, labels, table, order

    def __len__(self):
        return len(self.order)


class SequenceLoader(FrameLoader):
    """Shuffled, normalised chunks of one rank, time-major. See the module docstring."""

    def __init__(self, archive_dir, rank=0, world=1, chunk=40, left_context=0, right_context=0,
                 cmvn="meanvar", seed=0, max_batch=1024, block_frames=BLOCK_FRAMES,
                 buffer_frames=BUFFER_FRAMES, prefetch=True):
        if int(chunk) != chunk or chunk < 1:
            raise UserError(f"sequence loader: chunk must be >= 1 frame, not {chunk!r}")
        if min(left_context, right_context) < 0:
            raise UserError(f"sequence loader: contexts must be >= 0, not left {left_context}, "
                            f"right {right_context}")
        self.chunk = self.unit = int(chunk)
        self.left_context, self.right_context = int(left_context), int(right_context)
        self.steps = self.left_context + self.chunk + self.right_context
        if max_batch < self.steps:
            raise UserError(f"sequence loader: max_batch {max_batch} rows cannot hold one "
                            f"sequence of {self.steps} steps (left context + chunk + right)")
        self._chunk_starts = {}   # shard -> chunks before each utterance (U+1,)
        super().__init__(archive_dir, rank, world, context=0, cmvn=cmvn, seed=seed,
                         max_batch=max_batch, block_frames=block_frames,
                         buffer_frames=buffer_frames, prefetch=prefetch)

    # --- what the plan counts: chunk slots of the utterances starting in a block ---------
    def _chunks_before(self, s):
        """Chunks of shard s's utterances before each utterance (and the total), cached."""
        if s not in self._chunk_starts:
            offsets = self._shard_meta(s)[0]
            counts = chunk_counts(np.diff(offsets), self.chunk)
            self._chunk_starts[s] = np.concatenate([[0], np.cumsum(counts)])
        return self._chunk_starts[s]

    def _block_units(self, blocks):
        """Frame slots each block adds to the stream: chunk x chunks of its utterances."""
        slots = np.zeros(len(blocks), np.int64)
        for s in np.unique(blocks[:, 0]):
            mine = blocks[:, 0] == s
            offsets = self._shard_meta(int(s))[0]
            first = np.searchsorted(offsets[:-1], blocks[mine, 1])   # utterances starting in
            last = np.searchsorted(offsets[:-1], blocks[mine, 2])    # [begin, end)
            before = self._chunks_before(int(s))
            slots[mine] = before[last] - before[first]
        return slots * self.chunk

    # --- reading one buffer (the prefetch thread) -----------------------------------------
    def _load_buffer(self, epoch, job):
        """Read the whole utterances starting in the job's blocks, normalise, cut into chunks
        and shuffle them. job = (plan world, plan rank, buffer number, blocks, first, end)."""
        _, plan_rank, number, blocks = job[:4]
        spans = []   # per block: shard, its first and past-last utterance, their frames
        for s, begin, end in blocks:
            offsets = self._shard_meta(int(s))[0]
            first, last = np.searchsorted(offsets[:-1], [begin, end])
            if first < last:
                spans.append((int(s), first, last, int(offsets[first]), int(offsets[last])))
        rows = sum(w1 - w0 for *_, w0, w1 in spans)
        feats = np.empty((rows, self.feature_dim), np.float32)
        labels = np.empty(rows, np.int32)
        starts, lengths = [], []
        row = 0
        for s, first, last, w0, w1 in spans:
            offsets, frame_spk, shift, scale, path = self._shard_meta(s)
            f = self._open(s, path)
            try:
                f["feats"].read_direct(feats, np.s_[w0:w1], np.s_[row:row + w1 - w0])
                f["labels"].read_direct(labels, np.s_[w0:w1], np.s_[row:row + w1 - w0])
            except (OSError, ValueError, KeyError) as err:
                raise UserError(f"{path}: cannot read frames {w0}..{w1} ({err}); "
                                f"truncated or corrupt shard?") from None
            apply_cmvn(feats[row:row + w1 - w0], frame_spk[w0:w1], shift, scale)
            starts.append(row + offsets[first:last] - w0)
            lengths.append(np.diff(offsets[first:last + 1]))
            row += w1 - w0
        starts = np.concatenate(starts) if starts else np.zeros(0, np.int64)
        lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        utt, window, lo, hi = chunk_windows(lengths, self.chunk)
        table = np.stack([starts[utt], lengths[utt], window, lo, hi], axis=1)
        order = _rng(self.seed, epoch, plan_rank, number).permutation(len(table))
        return ChunkBuffer(feats, labels, table, order)

    # --- the epoch stream -------------------------------------------------------------------
    def start_epoch(self, epoch, offset=0, deal=None):
        """FrameLoader.start_epoch, in frame slots: offset and deal bounds whole chunks."""
        if offset % self.chunk:
            raise UserError(f"sequence loader: resume offset {offset} is not a multiple of the "
                            f"chunk ({self.chunk} frame slots); was data.chunk changed?")
        if any(v % self.chunk for *_, lo, hi in self.segments(epoch, deal) for v in (lo, hi)):
            raise UserError(f"sequence loader: the deal of epoch {epoch} cuts chunks of "
                            f"{self.chunk} slots (redeal without unit={self.chunk}?)")
        super().start_epoch(epoch, offset, deal)

    def next_batch(self, n):
        """The next min(n, remaining) / chunk chunks: (x (steps*B, feature_dim) float32,
        y (steps*B,) int32), time-major (row t*B + b: step t of chunk b), B = 0 when the
        epoch is exhausted. n in frame slots, a multiple of chunk. Views into one output
        buffer: valid until the next call."""
        if n % self.chunk:
            raise ValueError(f"batch of {n} frame slots is not whole chunks of {self.chunk}")
        if n // self.chunk * self.steps > len(self._out_y):
            raise ValueError(f"batch of {n // self.chunk} chunks x {self.steps} steps exceeds "
                             f"the loader's max_batch {len(self._out_y)} rows")
        n = min(n, self.remaining)
        chunks, steps = n // self.chunk, self.steps
        x = self._out_x[:steps * chunks]
        y = self._out_y[:steps * chunks]
        x_tb, y_tb = x.reshape(steps, chunks, self.feature_dim), y.reshape(steps, chunks)
        filled = 0
        while filled < chunks:
            if self._current is None:   # stream positions of a buffer are slots: to chunks
                self._current, first, end = self._next_buffer()
                self._in_buffer, self._end = first // self.chunk, end // self.chunk
            buf = self._current
            take = min(chunks - filled, self._end - self._in_buffer)
            start, length, window, lo, hi = \
                buf.table[buf.order[self._in_buffer:self._in_buffer + take]].T
            gather_sequences(buf.feats, buf.labels, start, length, window, lo, hi,
                             self.left_context, x_tb[:, filled:filled + take],
                             y_tb[:, filled:filled + take])
            self._in_buffer += take
            filled += take
            if self._in_buffer == self._end:
                self._current = None
        self._offset += n
        return x, y
