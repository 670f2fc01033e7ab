"""The 1-bit codec's column kernels (Numba CPU): one column of the packed layout of
hpcsgd/codecs/onebit.py at a time, encoded or decoded. The codec's kernels there and the striped
exchange's fused owner pass (hpcsgd/codecs/onebit_owner.py) both call these, so every path packs
the same bytes; a module of their own, so that neither of those imports the other.

They are called, not inlined (inline="always"): a call per column costs nothing, while Numba
copying their IR into each owner-pass variant took 6 of its 9 s of compiling.
"""
import numpy as np
from numba import njit

from hpcsgd.codecs.common import ADD, LANES, SET, SUB_LR, lane_tree_cpu


def column_means(s_neg, s_pos, n_pos, n):
    """Conditional means from float64 sums; an empty side divides by 1 (CNTK's rule)."""
    n_neg = n - n_pos
    m0 = np.float32(s_neg / max(n_neg, 1))
    m1 = np.float32(s_pos / max(n_pos, 1))
    return m0, m1


def is_finite(x):
    return x - x == 0.0  # False for NaN and +-Inf; works on every backend


# the CUDA kernels (onebit.py) compile the same two as device functions
column_means_cpu = njit(inline="always")(column_means)
is_finite_cpu = njit(inline="always")(is_finite)


def words_per_column(n_rows):
    return 2 + (n_rows + 31) // 32


@njit(cache=True)
def column_sums_cpu(g, r, pos, neg):
    """(sum of the negative side, sum of the non-negative side, count of the non-negative
    side) of one column of g + r, in float64 by the canonical lane order (codecs/common.py).
    pos/neg (LANES float64) are the caller's scratch. Reads grad and residual from memory."""
    n_rows = g.shape[0]
    nfull = n_rows // LANES
    pos[:] = 0.0
    neg[:] = 0.0
    n_pos = 0
    for i in range(nfull):
        for l in range(LANES):
            x = np.float64(g[i * LANES + l] + r[i * LANES + l])
            p = x if x >= 0.0 else 0.0
            pos[l] += p
            neg[l] += x - p
            n_pos += x >= 0.0
    for j in range(nfull * LANES, n_rows):
        x = np.float64(g[j] + r[j])
        p = x if x >= 0.0 else 0.0
        pos[j - nfull * LANES] += p
        neg[j - nfull * LANES] += x - p
        n_pos += x >= 0.0
    return lane_tree_cpu(neg), lane_tree_cpu(pos), n_pos


@njit(cache=True)
def quantize_column_cpu(g, r, col8, colf, m0, m1, signs, signs64):
    """The column's packed bytes for reconstruction values m0 (v < 0) and m1 (v >= 0), and
    r <- the new residual. signs (ceil(n_rows/8)*8 uint8, its padding 0; signs64 the same as
    uint64) is the caller's scratch."""
    n_rows = g.shape[0]
    colf[0] = m0
    colf[1] = m1
    # pass 2, from L1/L2 (the column is 8-74 KB): new residual and one sign byte per row, a
    # plain vectorisable select and compare
    for i in range(n_rows):
        v = g[i] + r[i]
        s = v >= 0
        signs[i] = s
        r[i] = v - (m1 if s else m0)
    # pass 3: 8 sign bytes (0/1, little-endian in a uint64) -> 1 byte, row j at bit j, by one
    # multiply: its partial products land on distinct bits, so nothing carries into the top
    # byte (27% faster than 8 shifts on one thread)
    nbytes = (n_rows + 7) // 8
    for b in range(nbytes):
        col8[8 + b] = np.uint8((signs64[b] * np.uint64(0x0102040810204080)) >> np.uint64(56))
    for b in range(8 + nbytes, col8.shape[0]):
        col8[b] = 0   # zero padding to the word


@njit(cache=True)
def encode_column_cpu(g, r, col8, colf, pos, neg, signs, signs64):
    """Encode one column: g, r (n_rows,) float32 -> its packed bytes col8 (4W uint8; colf the
    same bytes as float32), r <- the new residual; the scratch as above. Returns False,
    writing nothing, if g + r has a NaN or Inf."""
    s_neg, s_pos, n_pos = column_sums_cpu(g, r, pos, neg)
    if not is_finite_cpu(s_pos + s_neg):
        return False
    m0, m1 = column_means_cpu(s_neg, s_pos, n_pos, g.shape[0])
    quantize_column_cpu(g, r, col8, colf, m0, m1, signs, signs64)
    return True


BIT = np.uint32(1) << np.arange(32, dtype=np.uint32)   # BIT[j]: bit j of a word


@njit(inline="always")
def _decode_words(colw, colf, out, mode, lr):
    n_rows = out.shape[0]
    m0 = colf[0]
    m1 = colf[1]
    nw = n_rows // 32
    for w in range(nw):
        word = colw[2 + w]
        for j in range(32):
            val = m1 if word & BIT[j] else m0
            if mode == SET:
                out[32 * w + j] = val
            elif mode == ADD:
                out[32 * w + j] += val
            else:
                out[32 * w + j] = out[32 * w + j] - lr * val
    for i in range(nw * 32, n_rows):
        val = m1 if colw[2 + nw] & BIT[i - nw * 32] else m0
        if mode == SET:
            out[i] = val
        elif mode == ADD:
            out[i] += val
        else:
            out[i] = out[i] - lr * val


NEG_ZERO = np.uint32(0x80000000)   # -0.0's bits


@njit(cache=True)
def decode_column_cpu(colw, colf, out, mode, lr):
    """Decode one column's packed words (colw uint32, colf the same as float32) into out
    (n_rows,) float32 by `mode`; SUB_LR is the optimizer's apply: float64 lr times the
    float32 value, rounded once. Row 32w + j is bit j of word 2 + w; testing it against
    BIT[j], a constant vector, lets LLVM vectorise the 32 rows of a word (6x faster than
    shifting the word by j). LLVM vectorises the select-and-add but not the select-and-store
    (10x slower), so SET zeroes and adds: +0.0 + x is x for every mean but -0.0 (a negative
    mean that underflowed), which takes the store loop."""
    if mode == SET:
        if colw[0] != NEG_ZERO and colw[1] != NEG_ZERO:
            out[:] = 0.0
            _decode_words(colw, colf, out, ADD, lr)
        else:
            _decode_words(colw, colf, out, SET, lr)
    elif mode == ADD:
        _decode_words(colw, colf, out, ADD, lr)
    else:
        _decode_words(colw, colf, out, SUB_LR, lr)
