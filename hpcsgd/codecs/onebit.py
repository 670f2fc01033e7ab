"""1-bit SGD quantization with error feedback (Seide et al. 2014), reference + Numba CPU + CUDA.

Per column c (array row c, n_rows values): v = grad + residual; bit = 1 where v >= 0
(threshold 0); the two reconstruction values are the conditional means
mean0 = mean(v[v < 0]), mean1 = mean(v[v >= 0]) (an empty side counts as one element, so an
all-zero column decodes to 0), which minimise the squared error for that threshold;
residual <- v - decoded.

Packed layout, per column, in 32-bit little-endian words (4-byte aligned):
    [float32 mean0][float32 mean1][W = ceil(n_rows/32) uint32 words]
row r is bit (r % 32) of word r // 32 -- i.e. bit r % 8 of byte r // 8 of the bit area.
This differs from CNTK (which stores lower/upper and interleaves rows across words): storing
the two means makes decoding a select (no arithmetic, so exact on every backend), and the
sequential bit order lets the CPU unpack a byte at a time (3x faster than per-word in Numba)
while the GPU stays coalesced by reading one row per thread. See docs/codecs.md.
"""
import numpy as np
import numba
from numba import njit, prange

from hpcsgd.codecs.common import (LANES, Codec, lane_tree_cpu, lane_tree_cuda, nonfinite_error,
                                  ref_lane_sums, row_threads)
from hpcsgd.device import as_device
from hpcsgd.lazy_cuda import cuda


def _means(s_neg, s_pos, n_pos, n):
    """Conditional means from float64 sums; an empty side divides by 1 (CNTK's rule)."""
    n_neg = n - n_pos
    m0 = np.float32(s_neg / max(n_neg, 1))
    m1 = np.float32(s_pos / max(n_pos, 1))
    return m0, m1


def _finite(x):
    return x - x == 0.0  # False for NaN and +-Inf; works on every backend


_means_cpu, _finite_cpu = njit(inline="always")(_means), njit(inline="always")(_finite)
_means_cuda, _finite_cuda = cuda.jit(device=True)(_means), cuda.jit(device=True)(_finite)


def words_per_column(n_rows):
    return 2 + (n_rows + 31) // 32


# ---------------------------------------------------------------- NumPy reference
def column_sums_ref(g, r):
    """(n_cols, 4) float64: per column of g + r the negative sum, the non-negative sum and
    count (canonical lane order), the number of values; None-free: NaN/Inf pass through."""
    v64 = (g + r).astype(np.float64)
    pos = v64 >= 0
    return np.stack([ref_lane_sums(np.where(pos, 0.0, v64)), ref_lane_sums(np.where(pos, v64, 0.0)),
                     pos.sum(axis=1).astype(np.float64),
                     np.full(g.shape[0], g.shape[1], np.float64)], axis=1)


def encode_ref(g, r, packed, sums=None):
    """sums: the columns' sums added over a model group (column_sums_ref's layout), or None
    for this matrix's own."""
    n_cols, n_rows = g.shape
    W = words_per_column(n_rows)
    v = g + r
    pos = v >= 0
    sums = column_sums_ref(g, r) if sums is None else sums
    s_neg, s_pos, n_pos, n = sums.T
    bad = ~np.isfinite(s_pos + s_neg)
    if bad.any():
        return int(np.argmax(bad))
    m0 = (s_neg / np.maximum(n - n_pos, 1)).astype(np.float32)
    m1 = (s_pos / np.maximum(n_pos, 1)).astype(np.float32)
    cols = packed.view(np.uint32).reshape(n_cols, W)
    cols[:, 0] = m0.view(np.uint32)
    cols[:, 1] = m1.view(np.uint32)
    bits = np.packbits(pos, axis=1, bitorder="little")  # byte r//8, bit r%8
    area = cols[:, 2:].view(np.uint8).reshape(n_cols, -1)
    area[:] = 0
    area[:, :bits.shape[1]] = bits
    r[:] = v - np.where(pos, m1[:, None], m0[:, None])
    return -1


def decode_ref(packed, out, accumulate):
    n_cols, n_rows = out.shape
    cols = packed.view(np.uint32).reshape(n_cols, words_per_column(n_rows))
    m = cols[:, :2].view(np.float32)
    bits = np.unpackbits(cols[:, 2:].view(np.uint8).reshape(n_cols, -1), axis=1,
                         count=n_rows, bitorder="little").astype(bool)
    dec = np.where(bits, m[:, 1:2], m[:, 0:1])
    if accumulate:
        out += dec
    else:
        out[:] = dec


# ---------------------------------------------------------------- Numba CPU
# One column at a time: the kernels below and the striped exchange's fused owner pass
# (hpcsgd/codecs/onebit_owner.py) share these, so every path packs the same bytes.
# They are called, not inlined (inline="always"): a call per column costs nothing, while
# Numba copying their IR into each owner-pass variant took 6 of its 9 s of compiling.


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
    if not _finite_cpu(s_pos + s_neg):
        return False
    m0, m1 = _means_cpu(s_neg, s_pos, n_pos, g.shape[0])
    quantize_column_cpu(g, r, col8, colf, m0, m1, signs, signs64)
    return True


SET, ADD, SUB_LR = 0, 1, 2   # decode_column_cpu's modes: out = d, out += d, out -= lr * d
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


@njit(parallel=True, cache=True)
def encode_cpu(g, r, cols8, meancols, bad, nchunk):
    """cols8/meancols: the packed bytes as uint8 (n_cols, 4W) and float32 (n_cols, W).
    Columns are dealt to `nchunk` tasks in contiguous runs so each task allocates its scratch
    once (the result does not depend on nchunk)."""
    n_cols, n_rows = g.shape
    for t in prange(nchunk):
        pos = np.empty(LANES, np.float64)
        neg = np.empty(LANES, np.float64)
        signs = np.zeros((n_rows + 7) // 8 * 8, np.uint8)   # one byte per row; padding 0
        signs64 = signs.view(np.uint64)
        for c in range(t * n_cols // nchunk, (t + 1) * n_cols // nchunk):
            if not encode_column_cpu(g[c], r[c], cols8[c], meancols[c], pos, neg, signs,
                                     signs64):
                bad[c] = 1


# A model-parallel slice holds part of each column (hpcsgd/model/parallel.py): its sums are
# added over the model group first, so the means are the whole column's (Codec.column_sums).
@njit(parallel=True, cache=True)
def column_sums_kernel(g, r, sums, nchunk):
    """sums (n_cols, 4) float64 <- per column: negative sum, non-negative sum and count,
    number of values."""
    n_cols, n_rows = g.shape
    for t in prange(nchunk):
        pos = np.empty(LANES, np.float64)
        neg = np.empty(LANES, np.float64)
        for c in range(t * n_cols // nchunk, (t + 1) * n_cols // nchunk):
            s_neg, s_pos, n_pos = column_sums_cpu(g[c], r[c], pos, neg)
            sums[c, 0] = s_neg
            sums[c, 1] = s_pos
            sums[c, 2] = n_pos
            sums[c, 3] = n_rows


@njit(parallel=True, cache=True)
def encode_with_sums_cpu(g, r, cols8, meancols, sums, bad, nchunk):
    """encode_cpu with each column's means taken from `sums` (column_sums_kernel's layout,
    added over the columns' parts)."""
    n_cols, n_rows = g.shape
    for t in prange(nchunk):
        signs = np.zeros((n_rows + 7) // 8 * 8, np.uint8)
        signs64 = signs.view(np.uint64)
        for c in range(t * n_cols // nchunk, (t + 1) * n_cols // nchunk):
            if not _finite_cpu(sums[c, 0] + sums[c, 1]):
                bad[c] = 1
                continue
            m0, m1 = _means_cpu(sums[c, 0], sums[c, 1], sums[c, 2], sums[c, 3])
            quantize_column_cpu(g[c], r[c], cols8[c], meancols[c], m0, m1, signs, signs64)


@njit(parallel=True, cache=True)
def decode_cpu(cols, meancols, out, mode, lr):
    """Every column by decode_column_cpu's `mode` (SUB_LR: the final decode folded into the
    weight update, out being the weights). cols/meancols: the packed bytes as uint32 and
    float32 (n_cols, W)."""
    for c in prange(out.shape[0]):
        decode_column_cpu(cols[c], meancols[c], out[c], mode, lr)


# ---------------------------------------------------------------- Numba CUDA
@cuda.jit
def encode_cuda(g, r, words, means, bad):
    """One 32-thread block per column: lane sums + tree (= the canonical order), then one
    thread per packed word. words/means: the packed buffer viewed as 1-D uint32/float32."""
    c = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    n_rows = g.shape[1]
    W = 2 + (n_rows + 31) // 32
    pos = cuda.shared.array(LANES, np.float64)
    neg = cuda.shared.array(LANES, np.float64)
    cnt = cuda.shared.array(LANES, np.int32)
    mm = cuda.shared.array(3, np.float32)
    p_acc = 0.0
    n_acc = 0.0
    k = 0
    for i in range(lane, n_rows, LANES):  # coalesced: a warp reads 32 consecutive rows
        x = np.float64(g[c, i] + r[c, i])
        p = x if x >= 0.0 else 0.0
        p_acc += p
        n_acc += x - p
        k += x >= 0.0
    pos[lane] = p_acc
    neg[lane] = n_acc
    cnt[lane] = k
    cuda.syncthreads()
    if lane == 0:
        s_pos = lane_tree_cuda(pos)
        s_neg = lane_tree_cuda(neg)
        n_pos = 0
        for l in range(LANES):
            n_pos += cnt[l]
        mm[2] = 0.0
        if not _finite_cuda(s_pos + s_neg):
            mm[2] = 1.0
            bad[0] = c + 1  # any bad column; the host reports it
        else:
            m0, m1 = _means_cuda(s_neg, s_pos, n_pos, n_rows)
            mm[0] = m0
            mm[1] = m1
            means[c * W] = m0
            means[c * W + 1] = m1
    cuda.syncthreads()
    if mm[2] != 0.0:
        return
    m0 = mm[0]
    m1 = mm[1]
    for w in range(lane, W - 2, LANES):
        word = np.uint32(0)
        base = w * 32
        for b in range(min(32, n_rows - base)):
            v = g[c, base + b] + r[c, base + b]
            bit = v >= 0
            word |= np.uint32(bit) << np.uint32(b)
            r[c, base + b] = v - (m1 if bit else m0)
        words[c * W + 2 + w] = word


@cuda.jit
def decode_cuda(words, means, out, mode, lr):
    """One block per column, one thread per row (coalesced). mode SET: out = decoded;
    ADD: out += decoded; SUB_LR: out -= lr * decoded (the weights; decode_column_cpu's
    arithmetic, float64 lr times the float32 value, rounded once -- but NVVM may contract
    the multiply-subtract into an FMA, so GPU ranks agree with each other bit for bit, not
    necessarily with CPU ranks; the simulator runs it exactly)."""
    c = cuda.blockIdx.x
    n_rows = out.shape[1]
    W = 2 + (n_rows + 31) // 32
    m0 = means[c * W]
    m1 = means[c * W + 1]
    for i in range(cuda.threadIdx.x, n_rows, cuda.blockDim.x):
        bit = (words[c * W + 2 + (i >> 5)] >> np.uint32(i & 31)) & np.uint32(1)
        val = m1 if bit else m0
        if mode == SUB_LR:
            out[c, i] = out[c, i] - lr * val
        elif mode == ADD:
            out[c, i] += val
        else:
            out[c, i] = val


# ---------------------------------------------------------------- the codec
class OneBit(Codec):
    """Seide's 1-bit codec; always uses error feedback (it is what makes 1 bit work).
    Fusions (see Codec): decode_apply on every backend, the owner pass on the CPU
    (hpcsgd/codecs/onebit_owner.py)."""
    name = "onebit"
    fused_apply = True

    @property
    def fused_owner(self):
        return self.backend == "cpu"

    def owner_pass(self, recv, world, slot, pieces, params, opt, residual2, gather):
        """The striped exchange's owner phases in one pass per column (onebit_owner.py)."""
        from hpcsgd.codecs.onebit_owner import owner_pass
        owner_pass(self.name, recv, world, slot, pieces, params, opt, residual2, gather)

    def packed_nbytes(self, n_cols, n_rows):
        return 4 * n_cols * words_per_column(n_rows) if n_rows else 0

    def column_sums(self, grad, residual, sums):
        """sums (n_cols, 4) float64 <- each column's negative sum, non-negative sum and
        count, and length: what a model-parallel slice's columns add over the group before
        encode(..., sums=) takes the whole columns' means (CPU and reference backends)."""
        if self.backend == "reference":
            sums[:] = column_sums_ref(grad, residual)
        elif self.backend == "cpu":
            column_sums_kernel(grad, residual, sums, max(1, min(grad.shape[0],
                                                               8 * numba.get_num_threads())))
        else:
            raise ValueError("onebit: column sums over a model group are CPU-only (model "
                             "parallelism runs on CPU ranks: train.device=cuda is refused)")

    def encode(self, grad, residual, out, sums=None):
        """sums: the columns' sums over a model group (column_sums), or None."""
        self._check_encode(grad, residual, out)
        n_cols, n_rows = grad.shape
        if n_cols == 0 or n_rows == 0:
            return
        if self.backend == "reference":
            bad = encode_ref(grad, residual, out, sums)
        elif self.backend == "cpu":
            W = words_per_column(n_rows)
            flags = np.zeros(n_cols, np.uint8)
            args = (out.reshape(n_cols, 4 * W), out.view(np.float32).reshape(n_cols, W))
            nchunk = min(n_cols, 8 * numba.get_num_threads())
            if sums is None:
                encode_cpu(grad, residual, *args, flags, nchunk)
            else:
                encode_with_sums_cpu(grad, residual, *args, sums, flags, nchunk)
            bad = int(np.argmax(flags)) if flags.any() else -1
        else:
            if sums is not None:
                raise ValueError("onebit: column sums over a model group are CPU-only (model "
                             "parallelism runs on CPU ranks: train.device=cuda is refused)")
            flag = cuda.to_device(np.zeros(1, np.int32))
            o = as_device(out)
            encode_cuda[n_cols, LANES](as_device(grad), as_device(residual),
                                       o.view(np.uint32), o.view(np.float32), flag)
            bad = int(flag.copy_to_host()[0]) - 1  # device sync: the NaN check needs it
        if bad >= 0:
            raise nonfinite_error(self.name, grad.shape, bad)

    def _decode(self, packed, out, accumulate):
        self._check_decode(packed, out)
        n_cols, n_rows = out.shape
        if n_cols == 0 or n_rows == 0:
            return
        if self.backend == "reference":
            decode_ref(packed, out, accumulate)
        elif self.backend == "cpu":
            W = words_per_column(n_rows)
            decode_cpu(packed.view(np.uint32).reshape(n_cols, W),
                       packed.view(np.float32).reshape(n_cols, W), out, ADD if accumulate else SET,
                       0.0)
        else:
            p = as_device(packed)
            decode_cuda[n_cols, row_threads(n_rows)](p.view(np.uint32), p.view(np.float32),
                                                     as_device(out), ADD if accumulate else SET,
                                                     np.float64(0))

    def decode(self, packed, out):
        self._decode(packed, out, False)

    def decode_accumulate(self, packed, out):
        self._decode(packed, out, True)

    def decode_apply(self, packed, w, lr):
        """w -= lr * decoded(packed), in one pass over w: the exchange's final decode fused
        with the weight update, bit-identical to decode followed by Optimizer.apply (float64
        lr, one rounding; on a real GPU see decode_cuda)."""
        self._check_decode(packed, w)
        n_cols, n_rows = w.shape
        if n_cols == 0 or n_rows == 0:
            return
        if self.backend == "reference":
            dec = np.empty_like(w)
            decode_ref(packed, dec, False)
            w[:] = (w.astype(np.float64) - float(lr) * dec.astype(np.float64)).astype(np.float32)
        elif self.backend == "cpu":
            W = words_per_column(n_rows)
            decode_cpu(packed.view(np.uint32).reshape(n_cols, W),
                       packed.view(np.float32).reshape(n_cols, W), w, SUB_LR, float(lr))
        else:
            p = as_device(packed)
            decode_cuda[n_cols, row_threads(n_rows)](p.view(np.uint32), p.view(np.float32),
                                                     as_device(w), SUB_LR, np.float64(lr))
