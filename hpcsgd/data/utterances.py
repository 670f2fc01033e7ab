"""Whole-utterance minibatches for the sequence-trained models (CTC; the RNN-T next): an
utterance's frames with its token sequence, bucketed by length, dealt over the data ranks.

The epoch (every rank computes it from the shards' offsets alone, no communication):

  utterances   every one of the archive whose frames <= data.max_frames (the longer ones
               are dropped for the run: counted and named in the log)
  order        sorted by length times a per-epoch jitter exp(U(-0.1, 0.1)) (seed, epoch), cut
               into buckets of about data.bucket_frames frames; the buckets' order and the
               utterances inside each bucket shuffled (seed, epoch): similar lengths together,
               a different mix every epoch
               (data.sortagrad: the first epoch's buckets shortest first, as DeepSpeech2's
               SortaGrad: short utterances while the model is new)
  batches      the next run of the order inside one bucket whose frames stay <= N (the global
               minibatch, train.minibatch) and whose padded rows (utterances x the longest)
               stay <= PAD_SLACK x N; at least one utterance
  the deal     a batch's utterances sorted by length (longest first) and dealt to the K data
               ranks in snake order (0 1 .. K-1 K-1 .. 0 0 1 ..): every rank's part is sorted
               longest first (what the model's packed passes need), the ranks' utterance
               counts differ by at most one and their frames by about one utterance

A rank's padded rows are then at most ceil(count / K) x the longest <= PAD_SLACK N / K + the
longest utterance: `max_rows`, the model's workspace, fixed for the run.

The position in an epoch is the number of utterances of the order already trained, which the
frames trained by all ranks together (the sum of the progress's offsets) determine: every
batch trains a whole prefix of the order. So a step's per-rank frames (take), a resume
(resume) and another number of ranks (redeal) need nothing but the offsets, and the
minibatch size may change between any two steps (the automatic minibatch size: N in frames).
Double buffering's halves are each rank's utterances at even and at odd places of its part.

A batch: x (T*nb, D) float32, time-major (row t*nb + b = frame t of the b-th utterance,
longest first), zeros past each utterance's end; the Targets (frames, token ids, offsets).
CMVN per speaker as the frame loader's; SpecAugment (data.specaugment, Park et al. 2019: F
frequency masks of up to F_w bins, T time masks of up to min(T_w, p x length) frames, set to
0 = the speaker's mean after CMVN) drawn per (seed, epoch, utterance): a resumed run masks
the same frames. A thread loads the next step's utterances while the trainer computes.
"""
import concurrent.futures
import os
from typing import NamedTuple, Optional

import numpy as np

from hpcsgd.data import archive
from hpcsgd.data import cmvn as norm
from hpcsgd.errors import UserError
from hpcsgd.model.kernels_dropout import utterance_keys

PAD_SLACK = 1.25          # a batch's padded rows at most this many times its frame budget
BUCKET_BATCHES = 4        # data.bucket_frames = 0: buckets of this many minibatches
JITTER = 0.1              # the sort key's per-epoch noise: log-length +-JITTER
SPEC_TAG = 0x5EC          # SpecAugment's draws: rng(seed, epoch, SPEC_TAG, utterance)


class Targets(NamedTuple):
    """What a CTC (or RNN-T) loss needs of a batch of nb whole utterances, longest first."""
    frames: np.ndarray    # (nb,) int64 input frames of each
    ids: np.ndarray       # (N,) int32 token ids 1..V-1 of all of them, concatenated
    offsets: np.ndarray   # (nb + 1,) int64: utterance b's are ids[offsets[b]:offsets[b+1]]
    # (nb,) uint64: each utterance's dropout key this epoch (model/kernels_dropout.py: from
    # train.seed, the epoch and its place in the archive); training batches only
    keys: Optional[np.ndarray] = None
    # (T_out * nb,) int32: the alignment's frame label at each output step of the model
    # (time-major at the encoder's output rate, -1 on the padding); a loader given
    # label_stride only (the CTC model's frame CE head, model.frame_ce)
    labels: Optional[np.ndarray] = None


def empty_targets():
    return Targets(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(1, np.int64))


class SpecAugment(NamedTuple):
    freq_masks: int
    freq_width: int
    time_masks: int
    time_width: int
    time_ratio: float


def specaugment(feats, rng, spec):
    """Park et al.'s frequency and time masks on one utterance's (L, D) features, in place:
    each mask's width uniform in [0, its maximum], its start uniform where it fits."""
    length, dim = feats.shape
    for _ in range(spec.freq_masks):
        width = int(rng.integers(0, min(spec.freq_width, dim) + 1))
        start = int(rng.integers(0, dim - width + 1))
        feats[:, start:start + width] = 0
    most = min(spec.time_width, int(spec.time_ratio * length))
    for _ in range(spec.time_masks):
        width = int(rng.integers(0, most + 1))
        start = int(rng.integers(0, length - width + 1))
        feats[start:start + width] = 0


def snake(count, world):
    """The rank of each of `count` utterances (longest first) in snake order."""
    k = np.arange(count)
    lap, pos = k // world, k % world
    return np.where(lap % 2 == 0, pos, world - 1 - pos)


class UtteranceLoader:
    """Whole utterances and their tokens for one data rank. See the module docstring."""
    unit = 1
    context = 0   # the features as they are (no splicing)

    def __init__(self, archive_dir, rank=0, world=1, tokens="phones", cmvn="meanvar", seed=0,
                 minibatch=8000, max_minibatch=None, max_frames=0, bucket_frames=0,
                 spec=None, prefetch=True, sortagrad=False, label_stride=0):
        norm.spec(cmvn)   # a bad kind or scope named before any file is read
        if not 0 <= rank < world:
            raise UserError(f"loader: rank {rank} outside world of {world}")
        self.index = archive.read_index(archive_dir)
        self.dir, self.rank, self.world, self.seed = self.index["dir"], rank, world, seed
        self.kind, self.cmvn, self.spec, self.prefetch = tokens, cmvn, spec, prefetch
        self.sortagrad = bool(sortagrad)   # epoch 0's buckets shortest first (DeepSpeech2)
        # tokens None: the features alone (inference on an archive without transcripts)
        self.symbols = archive.read_tokens(archive_dir, tokens, self.index) if tokens else None
        self.num_labels = len(self.symbols or ())   # the model's outputs: blank and tokens
        self.feature_dim = self.input_dim = int(self.index["feature_dim"])
        self.minibatch = int(minibatch)
        # label_stride S > 0: each batch's frame labels at the model's output rate (the label
        # of input frame t*S + S//2 at output step t: the middle of what stride S merges)
        self.label_stride = int(label_stride)
        if self.label_stride and not self.index.get("frame_labels", True):
            raise UserError(f"{archive_dir}: model.frame_ce needs the alignment's frame labels, "
                            f"and this archive was prepped without them (hpcsgd prep "
                            f"--alignments)")
        self._catalogue()
        self.dropped = []   # (utterance, frames) longer than max_frames
        keep = np.ones(len(self.lengths), bool)
        if max_frames:
            keep = self.lengths <= max_frames
            self.dropped = [(self.utt_ids[u], int(self.lengths[u])) for u in np.flatnonzero(~keep)]
        self.kept = np.flatnonzero(keep)
        if not len(self.kept):
            raise UserError(f"{archive_dir}: no utterance of at most data.max_frames="
                            f"{max_frames} frames")
        self.frames_per_epoch = int(self.lengths[self.kept].sum())
        self.bucket_frames = int(bucket_frames) or BUCKET_BATCHES * self.minibatch
        cap = self.cap = max(self.minibatch, int(max_minibatch or 0))
        longest = int(self.lengths[self.kept].max())
        self.max_rows = int(np.ceil(PAD_SLACK * cap / world)) + longest
        self._out_x = np.zeros((self.max_rows, self.feature_dim), np.float32)
        self._out_labels = np.full(self.max_rows, -1, np.int32) if self.label_stride else None
        self._plans, self._epoch, self._groups, self._step_parts = {}, None, [], []
        self._part, self._part_key = (np.zeros(0, np.int64), None), None
        self._files = {}
        self._pool = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="utterances")
                      if prefetch else None)
        self._loading = {}   # (epoch, utterances) -> future of their features

    # --- the archive's utterances, from the shards' metadata ------------------------------
    def _catalogue(self):
        """Every utterance's shard, place, frames, speaker, tokens (as arrays), and each
        normalisation rows per speaker (hpcsgd/data/cmvn.py; None under the utterance
        scope)."""
        shard, first, lengths, spk, ids, tok_first, tok_len, utt_ids = ([] for _ in range(8))
        self._paths, token_base, spk_base = [], 0, 0
        shifts, scales = [], []
        for s, entry in enumerate(self.index["shards"]):
            path = os.path.join(self.dir, entry["file"])
            meta = archive.read_shard_meta(path)
            offsets = meta["utt_offsets"]
            count = len(meta["utt_ids"])
            tok, tok_off = (archive.read_shard_tokens(path, self.kind) if self.kind else
                            (np.zeros(0, np.int32), np.zeros(count + 1, np.int64)))
            shard.append(np.full(count, s, np.int64))
            first.append(offsets[:-1])
            lengths.append(np.diff(offsets))
            spk.append(meta["utt_spk"].astype(np.int64) + spk_base)
            ids.append(tok)
            tok_first.append(tok_off[:-1] + token_base)
            tok_len.append(np.diff(tok_off))
            utt_ids += meta["utt_ids"]
            token_base += len(tok)
            spk_base += len(meta["spk_ids"])
            rows = norm.speaker_rows(self.cmvn, meta["cmvn_stats"])
            if rows:   # None: each utterance normalised by its own frames as it is read
                shifts.append(rows[0])
                scales.append(rows[1])
            self._paths.append(path)
        cat = lambda parts, dtype: np.concatenate(parts).astype(dtype) if parts else \
            np.zeros(0, dtype)   # noqa: E731
        self.shard, self.first = cat(shard, np.int64), cat(first, np.int64)
        self.lengths, self.spk = cat(lengths, np.int64), cat(spk, np.int64)
        self.tokens, self.tok_first = cat(ids, np.int32), cat(tok_first, np.int64)
        self.tok_len, self.utt_ids = cat(tok_len, np.int64), utt_ids
        self.rows = (np.concatenate(shifts), np.concatenate(scales)) if shifts else None

    def token_lengths(self):
        """Tokens of every kept utterance (with `frames_after`: which no alignment fits)."""
        return self.tok_len[self.kept]

    def too_short(self, stride):
        """Kept utterances whose frames after a subsampling by `stride` are fewer than their
        tokens plus repeated neighbours: CTC has no alignment for them (zero loss)."""
        bad = []
        for u in self.kept:
            ids = self.tokens[self.tok_first[u]:self.tok_first[u] + self.tok_len[u]]
            need = len(ids) + int(np.count_nonzero(ids[1:] == ids[:-1]))
            if -(-int(self.lengths[u]) // stride) < need:
                bad.append(self.utt_ids[u])
        return bad

    # --- the epoch's order and its batches ------------------------------------------------
    def _plan(self, epoch):
        """(order of kept utterances, bucket end of each position, cumulative frames)."""
        if epoch not in self._plans:
            rng = np.random.default_rng([self.seed, epoch])
            lengths = self.lengths[self.kept]
            key = np.log(lengths) + rng.uniform(-JITTER, JITTER, len(lengths))
            by_length = self.kept[np.argsort(key, kind="stable")]
            cum = np.cumsum(self.lengths[by_length])
            # bucket b: the utterances whose cumulative frames end in ((b-1)F, bF]
            bucket = (cum - 1) // self.bucket_frames
            starts = np.flatnonzero(np.diff(bucket, prepend=-1))
            ends = np.append(starts[1:], len(by_length))
            pieces = []
            buckets = (np.arange(len(starts)) if self.sortagrad and epoch == 0
                       else rng.permutation(len(starts)))
            for b in buckets:
                members = by_length[starts[b]:ends[b]]
                pieces.append(members[rng.permutation(len(members))])
            order = np.concatenate(pieces)
            sizes = np.array([len(p) for p in pieces])
            bucket_end = np.repeat(np.cumsum(sizes), sizes)
            self._plans = {epoch: (order, bucket_end, np.cumsum(self.lengths[order]))}
        return self._plans[epoch]

    def _position(self, epoch, done):
        """Utterances of the epoch's order trained, from the frames all ranks trained."""
        order, _, cum = self._plan(epoch)
        if done == 0:
            return 0
        m = int(np.searchsorted(cum, done, side="left"))
        if m >= len(cum) or cum[m] != done:
            raise UserError(f"loader: {done} frames trained in epoch {epoch} is not a whole "
                            f"number of its utterances; was the archive, data.max_frames or "
                            f"train.seed changed since the checkpoint?")
        return m + 1

    def _batch_end(self, epoch, m, minibatch):
        """The end (exclusive) of the batch starting at position m."""
        order, bucket_end, _ = self._plan(epoch)
        frames, longest, e = 0, 0, m
        limit = int(bucket_end[m])
        while e < limit:
            length = int(self.lengths[order[e]])
            longest_next = max(longest, length)
            if e > m and (frames + length > minibatch
                          or (e - m + 1) * longest_next > PAD_SLACK * minibatch):
                break
            frames, longest, e = frames + length, longest_next, e + 1
        return e

    def _deal(self, utts):
        """The batch's utterances dealt to the ranks: a list of K arrays, longest first."""
        utts = utts[np.argsort(-self.lengths[utts], kind="stable")]
        ranks = snake(len(utts), self.world)
        return [utts[ranks == r] for r in range(self.world)]

    def epoch_frames(self, epoch, deal=None):
        """Frames every rank trains in `epoch` at the configured minibatch. Only their sum is
        a fixed quantity: another minibatch size (a probe's) deals the rest otherwise."""
        order, _, _ = self._plan(epoch)
        totals, m = np.zeros(self.world, np.int64), 0
        while m < len(order):
            e = self._batch_end(epoch, m, self.minibatch)
            totals += [self.lengths[p].sum() for p in self._deal(order[m:e])]
            m = e
        return totals

    # --- the step's contract with the spine ----------------------------------------------
    def resume(self, epoch, offsets, deal=None):
        """Start (or continue) `epoch` where the ranks' offsets (frames trained by each)
        say; any number of ranks' offsets (a resume at another K)."""
        self._epoch, self._groups = epoch, []
        self._position(epoch, int(np.sum(offsets)))   # checks it is a whole prefix

    def take(self, minibatch, offsets, rank_frames=None):
        """The next step's frames on every data rank (int64 array), the step at the
        position the offsets give. Remembers this rank's part for next_batch."""
        if minibatch > self.cap:
            raise ValueError(f"loader: a minibatch of {minibatch} frames is above the "
                             f"{self.cap} its buffers were sized for (max_minibatch)")
        m = self._position(self._epoch, int(np.sum(offsets)))
        order, _, _ = self._plan(self._epoch)
        if m >= len(order):
            self._groups = []
            return np.zeros(self.world, np.int64)
        e = self._batch_end(self._epoch, m, minibatch)
        parts = self._step_parts = self._deal(order[m:e])
        mine = parts[self.rank]
        self._groups = [mine]
        self._part = (mine, self._load(mine))
        self._part_key = (self._epoch, mine.tobytes())
        if e < len(order):   # the next step at this size, loading while this one computes
            self._load(self._deal(order[e:self._batch_end(self._epoch, e, minibatch)])[self.rank])
        return np.array([self.lengths[p].sum() for p in parts], np.int64)

    def halves(self, take):
        """Double buffering: every rank's utterances at even and at odd places of its part
        (both longest first, their frames known to every rank)."""
        parts = self._step_parts
        first = np.array([self.lengths[p[0::2]].sum() for p in parts], np.int64)
        mine = parts[self.rank]
        self._groups = [mine[0::2], mine[1::2]]
        return [first, take - first]

    def redeal(self, deal, offsets, world, epoch):
        """A checkpoint's position for `world` ranks: the frames trained so far (their sum
        is all the position there is), on the first rank; no deal."""
        return None, [int(np.sum(offsets))] + [0] * (world - 1)

    def next_batch(self, n):
        """This rank's next group (its part of the step, or a half of it) as (x (T*nb, D)
        float32 time-major, zero padding; Targets); n its frames (a check). x is a view of
        one buffer, valid until the next call."""
        group = self._groups.pop(0) if self._groups else np.zeros(0, np.int64)
        frames = int(self.lengths[group].sum())
        if frames != n:
            raise ValueError(f"loader: asked for {n} frames, the step's next group has "
                             f"{frames}")
        if not len(group):
            return self._out_x[:0], empty_targets()
        part, future = self._part   # the group is the step's part or a half of it
        feats = future.result() if future is not None else self._read(self._epoch, part)
        at = {int(u): k for k, u in enumerate(part)}
        return self._batch(group, [feats[at[int(u)]] for u in group])

    def _batch(self, group, feats):
        """(x, Targets) of a group of utterances (longest first) and their (features, frame
        labels or None), x a view of the loader's one output buffer (the labels too)."""
        lengths = self.lengths[group]
        steps, nb = int(lengths[0]), len(group)
        x = self._out_x[:steps * nb]
        x_tb = x.reshape(steps, nb, self.feature_dim)
        for b, (f, _) in enumerate(feats):
            x_tb[:len(f), b] = f
            x_tb[len(f):, b] = 0
        labels = None
        if self.label_stride:   # time-major at the output rate, -1 past each utterance's end
            stride = self.label_stride
            out_steps = -(-lengths // stride)
            labels = self._out_labels[:int(out_steps[0]) * nb]
            labels_tb = labels.reshape(-1, nb)
            labels_tb[...] = -1
            for b, (_, lab) in enumerate(feats):
                at = np.minimum(np.arange(out_steps[b]) * stride + stride // 2, len(lab) - 1)
                labels_tb[:out_steps[b], b] = lab[at]
        counts = self.tok_len[group]
        offsets = np.zeros(nb + 1, np.int64)
        np.cumsum(counts, out=offsets[1:])
        ids = np.concatenate([self.tokens[self.tok_first[u]:self.tok_first[u] + self.tok_len[u]]
                              for u in group]) if offsets[-1] else np.zeros(0, np.int32)
        return x, Targets(lengths.astype(np.int64), ids.astype(np.int32), offsets,
                          None if self._epoch is None
                          else utterance_keys(self.seed, self._epoch, group), labels)

    @property
    def max_sequences(self):
        """The most utterances a training batch can hold: its padded rows (at most
        max_rows) are its utterances times the longest, each at least the shortest kept."""
        shortest = int(self.lengths[self.kept].min()) if len(self.kept) else 1
        return max(self.max_rows // max(shortest, 1), 1)

    def eval_batches(self, max_rows, max_sequences=None):
        """This rank's share of the archive for evaluation and inference, each utterance
        once: (utterance ids, x, Targets) of batches of similar lengths, longest first,
        at most max_rows padded rows and max_sequences utterances (None: any) each; no
        shuffling, no SpecAugment. Utterances are dealt to the ranks in turn by length, so
        every rank gets a similar share."""
        by_length = np.argsort(-self.lengths, kind="stable")[self.rank::self.world]
        longest = int(self.lengths[by_length[0]]) if len(by_length) else 0
        if longest > min(max_rows, self.max_rows):
            utt = self.utt_ids[by_length[0]]
            raise UserError(f"{self.dir}: utterance {utt} has {longest} frames, more than "
                            f"the {min(max_rows, self.max_rows)} rows of a pass")
        rows, m = min(max_rows, self.max_rows), 0
        while m < len(by_length):
            e = m + 1
            while e < len(by_length) and (e - m + 1) * self.lengths[by_length[m]] <= rows \
                    and (max_sequences is None or e - m < max_sequences):
                e += 1
            group = by_length[m:e]
            x, targets = self._batch(group, self._read(None, group))
            yield [self.utt_ids[u] for u in group], x, targets
            m = e

    # --- reading (the prefetch thread) -------------------------------------------------------
    def _load(self, group):
        """The future of a part's features (started now unless already loading; None
        without prefetching: next_batch reads them then)."""
        key = (self._epoch, group.tobytes())
        if self._pool is None or not len(group):
            return None
        if key not in self._loading:
            # at most this step's and the next step's parts (a probe's other sizes, a
            # changed minibatch: what it loaded for nothing is dropped)
            keep = {self._part_key} if self._part_key else set()
            self._loading = {k: v for k, v in self._loading.items() if k in keep}
            self._loading[key] = self._pool.submit(self._read, self._epoch, group.copy())
        return self._loading[key]

    def _read(self, epoch, group):
        """Each utterance's (normalised features, frame labels or None: only with
        label_stride), longest first, SpecAugment's masks on the features when the loader
        has them and an epoch is given (epoch None: evaluation)."""
        out = []
        for u in group:
            s, a, length = int(self.shard[u]), int(self.first[u]), int(self.lengths[u])
            f = self._files.get(s) or self._files.setdefault(s, archive.open_shard(self._paths[s]))
            try:
                feats = f["feats"][a:a + length]
                labels = f["labels"][a:a + length] if self.label_stride else None
            except (OSError, ValueError, KeyError) as err:
                raise UserError(f"{self._paths[s]}: cannot read utterance {self.utt_ids[u]} "
                                f"({err}); truncated or corrupt shard?") from None
            norm.normalise(self.cmvn, feats, self.rows, self.spk[u])
            if self.spec is not None and epoch is not None:
                specaugment(feats, np.random.default_rng([self.seed, epoch, SPEC_TAG, int(u)]),
                            self.spec)
            out.append((feats, labels))
        return out

    def close(self):
        if self._pool is not None:
            for future in self._loading.values():
                future.cancel()
            self._pool.shutdown(wait=True)
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="utterances")
        self._loading = {}
        for f in self._files.values():
            f.close()
        self._files = {}
