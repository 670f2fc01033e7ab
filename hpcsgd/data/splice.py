"""Load-time feature kernels: per-speaker CMVN and context splicing (never stored on disk).

Shapes: F = frames in a buffer, D = feature dim, C = context frames each side,
        n = frames in a minibatch, (2C+1)*D = spliced input dim.

Each kernel has a plain NumPy reference beside it (`*_reference`), used by the tests.
Kernels are serial and release the GIL (`nogil`): the loader's prefetch thread runs them while
the trainer's BLAS threads use the cores; one core splices > 1M frames/s (memory-bound copy).
"""
import numba
import numpy as np

VAR_FLOOR = 1.0e-10  # a constant feature dimension (e.g. digital silence) must not divide by 0


def cmvn_from_stats(stats, norm_vars):
    """Kaldi 2x(D+1) stats of each speaker -> (shift, scale) so that x_norm = (x + shift) * scale.

    stats: (S, 2, D+1) float64, row 0 = sums and count, row 1 = sums of squares.
    """
    count = stats[:, 0, -1:]
    if np.any(count <= 0):
        raise ValueError("CMVN stats with a zero frame count")
    mean = stats[:, 0, :-1] / count
    shift = (-mean).astype(np.float32)
    if norm_vars:
        var = np.maximum(stats[:, 1, :-1] / count - mean * mean, VAR_FLOOR)
        scale = (1.0 / np.sqrt(var)).astype(np.float32)
    else:
        scale = np.ones_like(shift)
    return np.ascontiguousarray(shift), np.ascontiguousarray(scale)


@numba.njit(nogil=True, cache=True)
def apply_cmvn(feats, row_spk, shift, scale):
    """In place: feats[f] = (feats[f] + shift[s]) * scale[s] with s = row_spk[f]."""
    num_frames, dim = feats.shape
    for f in range(num_frames):
        s = row_spk[f]
        for d in range(dim):
            feats[f, d] = (feats[f, d] + shift[s, d]) * scale[s, d]


def apply_cmvn_reference(feats, row_spk, shift, scale):
    return (feats + shift[row_spk]) * scale[row_spk]


@numba.njit(nogil=True, cache=True)
def splice_gather(feats, src, lo, hi, order, context, out):
    """out[i] = frames src[j]-C .. src[j]+C of feats, concatenated, with j = order[i].

    Frames outside the utterance [lo[j], hi[j]] are replaced by its edge frame (as Kaldi's
    splice-feats does). Writes rows 0..len(order)-1 of out, shape (n, (2C+1)*D).
    """
    dim = feats.shape[1]
    for i in range(order.shape[0]):
        j = order[i]
        centre = src[j]
        for k in range(2 * context + 1):
            row = centre + k - context
            if row < lo[j]:
                row = lo[j]
            elif row > hi[j]:
                row = hi[j]
            base = k * dim
            for d in range(dim):
                out[i, base + d] = feats[row, d]


def splice_reference(feats, src, lo, hi, order, context):
    rows = src[order][:, None] + np.arange(-context, context + 1)[None, :]
    rows = np.clip(rows, lo[order][:, None], hi[order][:, None])
    return feats[rows].reshape(len(order), -1)
