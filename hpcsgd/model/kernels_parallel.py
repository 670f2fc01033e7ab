"""The split softmax's kernels (Numba CPU) and their NumPy reference: a model-parallel group's
cross-entropy and log-posteriors from each rank's columns of the logits
(hpcsgd/model/parallel.py: SplitSoftmax).

Per frame, each rank reduces its columns to STATS numbers (its max, its sum of exp(z - max),
the target logit if it owns the label, its first argmax); one Allgather gives every rank all of
them, and each rank combines them in rank order -- the same float64 arithmetic everywhere, so
the CE and the argmax are the same bits on every rank of the group. As hpcsgd.model.kernels:
dtype-generic, no fastmath, column sums in NCHUNK fixed row chunks.
"""
import math

import numpy as np
from numba import njit, prange

from hpcsgd.model import kernels as K
from hpcsgd.model.kernels import NCHUNK, _bias_max_argmax, _exp_sum, fexp

STATS = 4   # per frame and rank: max, sum of exp(z - max), target logit (or 0), first argmax


@njit(parallel=True, cache=True)
def split_xent_stats(z, b, y, lo, stats, lanes):
    """z (n, c): my logits without bias in, exp(z + b - max) out (in place); stats (n, 4):
    my row max, the sum of the exps, the target logit (z + b)[y] if I own label y
    (else 0), and my first argmax as a whole-label index."""
    n, c = z.shape
    for i in prange(n):
        mx, arg = _bias_max_argmax(z, b, i, c)
        label = y[i] - lo
        zy = z[i, label] if 0 <= label < c else 0.0
        s = _exp_sum(z[i], mx, c, lanes[i])
        stats[i, 0] = mx
        stats[i, 1] = s
        stats[i, 2] = zy
        stats[i, 3] = lo + arg


@njit(inline="always")
def _combine(every, i):
    """(max, sum of exp(z - max), target logit, first argmax) of frame i over every rank's
    statistics, in rank order (the same float64 bits on every rank)."""
    ranks = every.shape[0]
    gmax = every[0, i, 0]
    for r in range(1, ranks):
        gmax = max(gmax, every[r, i, 0])
    total, zy, first = 0.0, 0.0, -1.0
    for r in range(ranks):
        total += every[r, i, 1] * math.exp(every[r, i, 0] - gmax)
        zy += every[r, i, 2]
        if first < 0 and every[r, i, 0] == gmax:
            first = every[r, i, 3]
    return gmax, total, zy, first


@njit(parallel=True, cache=True)
def split_xent_finish(z, y, lo, me, every, gb, partial, ce_part, correct_part):
    """z (n, c): exp(z + b - my max) in, dCE/d(z + b) = posterior - onehot(y) on my columns
    out; gb (1, c) its column sums (NCHUNK fixed row chunks: the bits do not depend on the
    threads); ce_part, correct_part per chunk, the same on every rank. every (M, n, 4): the
    gathered statistics. A frame labelled -1 has no loss."""
    n, c = z.shape
    rows = (n + NCHUNK - 1) // NCHUNK
    for ch in prange(NCHUNK):
        p = partial[ch, :c]
        p[:] = 0
        ce, correct = 0.0, 0
        for i in range(ch * rows, min(n, (ch + 1) * rows)):
            label = y[i]
            if label < 0:
                z[i, :] = 0
                continue
            gmax, total, zy, first = _combine(every, i)
            f = z.dtype.type(math.exp(every[me, i, 0] - gmax) / total)
            row = z[i]
            for j in range(c):
                v = row[j] * f
                row[j] = v
                p[j] += v
            if lo <= label < lo + c:
                row[label - lo] -= 1
                p[label - lo] -= 1
            ce += math.log(total) + gmax - zy
            correct += 1 if first == label else 0
        ce_part[ch] = ce
        correct_part[ch] = correct
    for j in prange(c):
        acc = partial[0, j]
        for ch in range(1, NCHUNK):
            acc += partial[ch, j]
        gb[0, j] = acc


@njit(parallel=True, cache=True)
def split_lse_stats(z, b, stats):
    """Inference: z (n, c) <- z + b; stats (n, 4): my row max and sum of exp(z + b - max)."""
    n, c = z.shape
    for i in prange(n):
        mx, _ = _bias_max_argmax(z, b, i, c)
        s = 0.0
        for j in range(c):
            s += fexp(z[i, j] - mx)
        stats[i, 0] = mx
        stats[i, 1] = s
        stats[i, 2] = 0.0
        stats[i, 3] = 0.0


@njit(parallel=True, cache=True)
def split_lse_finish(z, every):
    """z (n, c) <- z + b - log-sum-exp over every rank's columns: my log-posteriors."""
    n, c = z.shape
    for i in prange(n):
        gmax, total, _, _ = _combine(every, i)
        lse = z.dtype.type(gmax + math.log(total))
        for j in range(c):
            z[i, j] = z[i, j] - lse


def ref_split_softmax(z_parts, b_parts, y):
    """The NumPy reference of the group's softmax: each rank's (gradient slice, bias gradient
    slice) and the CE and correct frames, computed from the whole logits in float64 (what the
    split kernels must equal to float32 rounding)."""
    z = np.concatenate([zp.astype(np.float64) for zp in z_parts], axis=1)
    b = np.concatenate([bp.astype(np.float64) for bp in b_parts], axis=1)
    grad, gb, ce, correct, logpost = K.ref_softmax_xent(z, b, y)
    bounds = np.cumsum([0] + [zp.shape[1] for zp in z_parts])
    return ([grad[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])],
            [gb[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])], ce, correct, logpost)
