"""Speaker-level partitions: the train/cross-validation split and the dealing of speakers to shards.

Both work on whole speakers, as Kaldi's subset_data_dir_tr_cv.sh and split_data.sh do: a speaker's
utterances never straddle train and cv (so cv measures unseen speakers), and a speaker lives in
exactly one shard (so that shard's per-speaker CMVN statistics are complete).
"""
import numpy as np

from hpcsgd.errors import UserError


def split_speakers(speakers, num_cv, seed):
    """-> (train, cv): num_cv speakers drawn with numpy's default_rng(seed), both sorted.
    Deterministic for (set of speakers, num_cv, seed), independent of input order."""
    speakers = sorted(set(speakers))
    if not 0 < num_cv < len(speakers):
        raise UserError(f"--cv-speakers {num_cv}: need 0 < N < {len(speakers)} (number of speakers)")
    order = np.random.default_rng(seed).permutation(len(speakers))
    cv = sorted(speakers[i] for i in order[:num_cv])
    chosen = set(cv)
    return [s for s in speakers if s not in chosen], cv


def deal_speakers(speaker_weight, num_shards):
    """Balanced, deterministic assignment: speakers by decreasing weight (ties by name) each go to
    the currently lightest shard (greedy LPT; max load within one speaker of the optimum).
    speaker_weight: {speaker: frames}. -> list of sorted speaker lists, one per shard."""
    if num_shards < 1 or num_shards > len(speaker_weight):
        raise UserError(f"--num-shards {num_shards}: need 1..{len(speaker_weight)} "
                        f"(a shard holds whole speakers; there are {len(speaker_weight)})")
    loads = [0] * num_shards
    shards = [[] for _ in range(num_shards)]
    for spk in sorted(speaker_weight, key=lambda s: (-speaker_weight[s], s)):
        i = min(range(num_shards), key=lambda k: (loads[k], k))
        loads[i] += speaker_weight[spk]
        shards[i].append(spk)
    return [sorted(s) for s in shards]
