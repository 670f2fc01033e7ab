"""Stripes: which codec columns of every parameter each data rank owns in the striped
exchange, and how per-rank state moves when the number of data ranks changes.

Rule (CNTK's): rank j of K owns a contiguous range of codec columns of every exchanged matrix,
n_cols // K each, the first n_cols % K ranks one more. A matrix with fewer columns than ranks
has empty ranges on the last ranks. An owner keeps its stripes' optimizer state and second
residual compact: its ranges of every matrix, back to back in matrix order.
"""
import numpy as np


def stripe_ranges(mats, rank, size):
    """Flat [lo, hi) ranges that rank `rank` of `size` owns, one per matrix of `mats`
    (hpcsgd.model.flat.Matrix)."""
    ranges = []
    for m in mats:
        base, extra = divmod(m.n_cols, size)
        first = rank * base + min(rank, extra)
        count = base + (1 if rank < extra else 0)
        lo = m.offset + first * m.n_rows
        ranges.append((lo, lo + count * m.n_rows))
    return ranges


def exchanged(mats):
    """The matrices whose gradients are exchanged (codec or float): the striped ones."""
    return [m for m in mats if m.exchange != "none"]


def unstripe(parts, mats, size, out=None):
    """The full vector over `mats` from every owner's compact stripe (parts[r] of rank r of
    `size`); positions nobody owns (parameters not exchanged) are left as in `out` (zeros)."""
    total = sum(m.offset + m.size for m in mats[-1:]) if mats else 0
    full = np.zeros(total, np.asarray(parts[0]).dtype) if out is None else out
    for r, part in enumerate(parts):
        part, a = np.asarray(part), 0
        for lo, hi in stripe_ranges(exchanged(mats), r, size):
            full[lo:hi] = part[a:a + hi - lo]
            a += hi - lo
    return full


def stripe_of(full, mats, rank, size):
    """Rank `rank` of `size`'s compact stripe of a full vector."""
    return np.concatenate([np.asarray(full[lo:hi])
                           for lo, hi in stripe_ranges(exchanged(mats), rank, size)])


def restripe(arrays, old_size, old_striped, mats, rank, size, striped):
    """Per-rank optimizer arrays of a checkpoint written by `old_size` data ranks -> this rank's
    under the new exchange: arrays maps "velocity"/"sqr" to the shared array (replicated
    state) or to the list of every old rank's array (owner stripes if old_striped). A
    1-element array is the optimizer's placeholder for a feature that is off and passes
    through. Returns {"velocity": ..., "sqr": ...}."""
    size_all = sum(m.size for m in mats)
    out = {}
    for name, value in arrays.items():
        if not isinstance(value, list):
            full = np.asarray(value)
        elif np.asarray(value[0]).size == 1 or not old_striped:
            full = np.asarray(value[0])
        else:
            full = unstripe(value, mats, old_size)
        if full.size == size_all and striped:
            full = stripe_of(full, mats, rank, size)
        out[name] = full
    return out


def folded_from(rank, old_size, size):
    """The old ranks whose first residuals new rank `rank` of `size` takes over."""
    return list(range(rank, old_size, size))


def fold_residuals(old1, old2, mats, old_size, rank, size):
    """Error feedback across a change of data ranks, nothing lost: the sum over ranks of the
    first residuals (what no rank has sent yet) and every owner's second residual (what no
    owner has sent yet) are both preserved.
      residual1  new rank j takes the sum of the old ranks r with r % size == j
                 (folded_from; none for a new rank beyond the old ones: zeros)
      residual2  the owners' compact stripes laid back into the full vector, cut into the new
                 stripes
    old1: the first residuals of folded_from(rank, old_size, size), in that order; old2: every
    old rank's second residual. Returns (residual1, residual2) of `rank`."""
    r1 = np.zeros(sum(m.size for m in exchanged(mats)), np.float32)
    for part in old1:
        r1 += np.asarray(part)
    r2 = stripe_of(unstripe(old2, mats, old_size), mats, rank, size)
    return r1, r2
