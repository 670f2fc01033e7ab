"""Dropout between the encoder's layers of a batch of whole utterances: masks computed, not
stored, from a counter-based hash of (utterance key, layer, output step, channel).

Shape key: x, out (T*nb, C) time-major, row t*nb + b step t of sequence b; keys (nb,) uint64,
one per utterance of the batch (hpcsgd.data.utterances: from train.seed, the epoch and the
utterance's place in the archive); salt: the layer's number.

    h    = mix64(keys[b] + salt * GOLDEN + t * 2^20 + c)       (uint64 arithmetic, wrapping)
    keep = (h >> 40) >= threshold                                (24 bits; threshold = p * 2^24)
    out[t*nb + b, c] = x[t*nb + b, c] * scale if keep else 0     (scale = 1 / (1 - p), float32)

The mask is a function of the utterance and the position, not of the rank, the batch or the
row it lands on: an utterance gets the same mask wherever the loader deals it, alone or padded
beside others, so K ranks train exactly what one process does on the same global batch, and a
resume at any rank count replays it. The backward pass applies the same function to the
gradient (dx = dy * mask * scale), so nothing is kept between the passes. mix64 is
SplitMix64's finalizer (Steele et al. 2014): every input bit flips about half the output
bits, so neighbouring t, c and keys give independent-looking draws.

`drop` is the Numba CPU kernel (parallel over rows; in place when out is x), `ref_drop` the
NumPy reference it is tested against; the CUDA twin is hpcsgd.model.kernels_cuda.drop, the
same element function (`_keep`) compiled for the device.
"""
import numpy as np
from numba import njit, prange

from hpcsgd.lazy_cuda import cuda

KEEP_BITS = 24                       # the draw's resolution: p in steps of 2^-24
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S20, _S40 = (np.uint64(s) for s in (30, 27, 31, 20, 40))


def _mix64(z):
    """SplitMix64's finalizer on a uint64 (wrapping multiplications)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def _keep(key, salt, t, c, threshold):
    """True where element (t, c) of the utterance with this key survives layer `salt`'s
    dropout: the hash's top 24 bits against threshold (all operands uint64; _mix64 written
    out, so that one plain function compiles for the CPU, the GPU and NumPy arrays)."""
    z = key + salt * GOLDEN + (t << _S20) + c
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    z = z ^ (z >> _S31)
    return (z >> _S40) >= threshold


keep_cpu, keep_cuda = njit(inline="always")(_keep), cuda.jit(device=True)(_keep)


def threshold_of(p):
    """The 24-bit threshold of a drop probability p in [0, 1)."""
    return int(round(p * (1 << KEEP_BITS)))


def scale_of(p):
    """Inverted dropout's scale 1 / (1 - p), as the float32 every kernel multiplies by."""
    return np.float32(1.0 / (1.0 - p))


@njit(parallel=True, cache=True)
def drop(x, out, keys, nb, salt, threshold, scale):
    """out[:rows] <- x[:rows] * mask * scale (module docstring); rows = x.shape[0], a whole
    number of steps of nb sequences. out may be x."""
    s, th = np.uint64(salt), np.uint64(threshold)
    for r in prange(x.shape[0]):
        t, b = r // nb, r % nb
        key, tt = keys[b], np.uint64(t)
        for c in range(x.shape[1]):
            if keep_cpu(key, s, tt, np.uint64(c), th):
                out[r, c] = x[r, c] * scale
            else:
                out[r, c] = 0


def utterance_keys(seed, epoch, utterances, tag=0xD120):
    """Each utterance's dropout key for this epoch: a hash of (seed, tag, epoch, the
    utterance's index in the archive). utterances: int array. NumPy, on the host."""
    with np.errstate(over="ignore"):
        base = _mix64(_mix64(np.uint64(seed) ^ np.uint64(tag)) + np.uint64(epoch))
        return _mix64(base + np.asarray(utterances, np.uint64) * GOLDEN)


# ---------------------------------------------------------------------------------------------
# NumPy reference


def ref_mask(rows, cols, keys, nb, salt, p):
    """(rows, cols) bool: which elements survive, by the module docstring's formula."""
    r = np.arange(rows, dtype=np.uint64)[:, None]
    c = np.arange(cols, dtype=np.uint64)[None, :]
    key = np.asarray(keys, np.uint64)[(r % np.uint64(nb)).astype(np.int64)]
    t = r // np.uint64(nb)
    with np.errstate(over="ignore"):
        return _keep(key, np.uint64(salt), t, c, np.uint64(threshold_of(p)))


def ref_drop(x, keys, nb, salt, p):
    """x * mask * scale in float32 (the kernels' product: exact to compare)."""
    x = np.asarray(x, np.float32)
    return np.where(ref_mask(*x.shape, keys, nb, salt, p), x * scale_of(p), np.float32(0))
