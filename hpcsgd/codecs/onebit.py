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

from hpcsgd.codecs.common import (LANES, Codec, lane_tree_cuda, nonfinite_error, pack_chunk_cuda,
                                  ref_lane_sums,
                                  row_threads)
from hpcsgd.codecs.onebit_columns import (ADD, SET, SUB_LR, column_means, column_means_cpu,
                                          column_sums_cpu, decode_column_cpu, encode_column_cpu,
                                          is_finite, is_finite_cpu, quantize_column_cpu,
                                          words_per_column)
from hpcsgd.codecs.onebit_owner import owner_pass
from hpcsgd.device import as_device, mul_rn64
from hpcsgd.lazy_cuda import cuda


_means_cuda = cuda.jit(device=True)(column_means)
_finite_cuda = cuda.jit(device=True)(is_finite)


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
# Every column by the column kernels of hpcsgd/codecs/onebit_columns.py.


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
            if not is_finite_cpu(sums[c, 0] + sums[c, 1]):
                bad[c] = 1
                continue
            m0, m1 = column_means_cpu(sums[c, 0], sums[c, 1], sums[c, 2], sums[c, 3])
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
def encode_cuda(g, r, words, means, bad, table):
    """One 32-thread block per column of the table (one matrix's or several's: element
    offset in the flat g and r, rows, word offset of its packed column in words/means, the
    packed buffers viewed as 1-D uint32/float32): lane sums + tree (= the canonical order),
    then 32 rows at a time, one per lane (coalesced: residual read and written once), their
    bits packed through shared memory (pack_chunk)."""
    c = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    at = table[c, 0]
    n_rows = table[c, 1]
    wo = table[c, 2]
    pos = cuda.shared.array(LANES, np.float64)
    neg = cuda.shared.array(LANES, np.float64)
    cnt = cuda.shared.array(LANES, np.int32)
    mm = cuda.shared.array(3, np.float32)
    p_acc = 0.0
    n_acc = 0.0
    k = 0
    for i in range(lane, n_rows, LANES):  # coalesced: a warp reads 32 consecutive rows
        x = np.float64(g[at + i] + r[at + i])
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
            means[wo] = m0
            means[wo + 1] = m1
    cuda.syncthreads()
    if mm[2] != 0.0:
        return
    m0 = mm[0]
    m1 = mm[1]
    codes = cuda.shared.array(LANES, np.int32)
    for base in range(0, n_rows, LANES):   # every lane the same trip count (syncthreads)
        i = base + lane
        q = 0
        if i < n_rows:
            v = g[at + i] + r[at + i]
            q = 1 if v >= 0 else 0
            r[at + i] = v - (m1 if q else m0)
        codes[lane] = q
        cuda.syncthreads()
        pack_chunk_cuda(codes, lane, 1, words, wo + 2 + base // LANES, 1)
        cuda.syncthreads()


@cuda.jit
def decode_cuda(words, means, out, mode, lr, n_src, stride, table):
    """One block per column of the table (element offset in the flat out, rows, word offset),
    one thread per row (coalesced). mode SET: out = decoded; ADD: out += decoded; SUB_LR:
    out -= lr * decoded (the weights; decode_column_cpu's arithmetic, float64 lr times the
    float32 value, the difference rounded once; the product as mul.rn.f64, which ptxas may
    not fuse into an FMA: the CPU's bits). n_src > 1 (SET or ADD): the sum of n_src packed
    columns `stride` words apart, added in source order in float32 as a decode then
    decode_accumulate per source add them, with one write."""
    c = cuda.blockIdx.x
    at = table[c, 0]
    n_rows = table[c, 1]
    wo = table[c, 2]
    for i in range(cuda.threadIdx.x, n_rows, cuda.blockDim.x):
        acc = np.float32(0.0) if mode == SET else out[at + i]   # SET: out is not read
        for s in range(n_src):
            w = s * stride + wo
            bit = (words[w + 2 + (i >> 5)] >> np.uint32(i & 31)) & np.uint32(1)
            val = means[w + 1] if bit else means[w]
            if mode == SUB_LR:   # float64 product and difference, rounded once
                acc = np.float32(acc - mul_rn64(lr, val))
            elif mode == ADD or s > 0:   # float32 sums, in order (acc stays float32)
                acc += val
            else:
                acc = val
        out[at + i] = acc


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
            self.encode_many([(0, n_cols, n_rows, 0)], as_device(grad).reshape(grad.size),
                             as_device(residual).reshape(grad.size), out)
            bad = -1
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
            self._decode_table([(0, n_cols, n_rows, 0)], packed,
                               as_device(out).reshape(out.size), ADD if accumulate else SET)

    # ---- the GPU launches of Codec's table path (every matrix of a phase in one launch)
    def words_per_column(self, rows):
        return words_per_column(rows)

    def _launch_encode(self, table, src, residual, out, flag):
        o = as_device(out)
        encode_cuda[table.shape[0], LANES](as_device(src), as_device(residual),
                                           o.view(np.uint32), o.view(np.float32), flag, table)

    def _launch_decode(self, table, packed, out, mode, lr, n_src, stride, most_rows):
        p = as_device(packed)
        decode_cuda[table.shape[0], row_threads(most_rows)](
            p.view(np.uint32), p.view(np.float32), out, mode, np.float64(lr), n_src, stride,
            table)

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
            self._decode_table([(0, n_cols, n_rows, 0)], packed, as_device(w).reshape(w.size),
                               SUB_LR, lr)
