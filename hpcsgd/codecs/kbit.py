"""k-bit (k = 2..8) uniform quantization per column with error feedback; reference + CPU + CUDA.

Per column: v = grad + residual; a range [lower, upper] from the range rule; codes are bucket
indices q = clip(floor((v - lower) / step), 0, 2^k - 1) with step = (upper - lower) / 2^k,
decoded at bucket centres lower + (q + 0.5) * step (CNTK's formula, any k, not only powers of 2);
residual <- v - decoded.

Range rules (`range=`):
  "rms"    lower/upper = -/+ clip * RMS(v) (mean forced to 0). CNTK uses clip = 4.
  "minmax" lower/upper = min(v), max(v): nothing clipped, coarser buckets.
The default is "minmax": on real speech-MLP gradients with error feedback it gave the lowest
quantization error at every k = 2..8 (experiments/codecs_range_rule.py, docs/codecs.md).

Packed layout, per column, 32-bit little-endian words:
    [float32 lower][float32 upper][ceil(n_rows * k / 32) uint32 words]
row r's k-bit field starts at bit r * k of the column's word area, least significant bit first;
fields may straddle two words (k = 3, 5, 6, 7).
"""
import math

import numba
import numpy as np
from numba import njit, prange

from hpcsgd.codecs.common import (ADD, KEY_NEG_INF, KEY_POS_INF, LANES, SET, Codec, f32_bits,
                                  f32_from_bits, lane_tree_cpu, lane_tree_cuda, nonfinite_error,
                                  order_key, order_key_ref, pack_chunk_cuda, ref_lane_sums,
                                  row_threads)
from hpcsgd.device import as_device
from hpcsgd.lazy_cuda import cuda



def _range(sumsq, mn, mx, n, use_minmax, clip):
    """(lower, upper) as float32 from the column statistics; float64 math, one rounding each."""
    if use_minmax:
        return np.float32(mn), np.float32(mx)
    rms = (sumsq / n) ** 0.5
    hi = np.float32(clip * rms)
    return -hi, hi


def _step(lower, upper, levels):
    return np.float32((np.float64(upper) - np.float64(lower)) / levels)


def _inv(step):
    return 1.0 / np.float64(step) if step > 0 else 0.0


def _code(v, lower, inv, maxq):
    t = (np.float64(v) - np.float64(lower)) * inv
    if t <= 0.0:
        return 0
    if t >= maxq:
        return maxq
    return int(t)  # t > 0: truncation is floor


def _value(q, lower, step):
    # step * (q + 0.5) is exact in float64 (24 + 9 bits), so a GPU FMA gives the same bits
    return np.float32(np.float64(lower) + np.float64(step) * (q + 0.5))


_range_cpu, _step_cpu, _inv_cpu, _code_cpu, _value_cpu = (
    njit(inline="always")(f) for f in (_range, _step, _inv, _code, _value))
_order_key_cpu = njit(inline="always")(order_key)
_range_cuda, _step_cuda, _inv_cuda, _code_cuda, _value_cuda = (
    cuda.jit(device=True)(f) for f in (_range, _step, _inv, _code, _value))


def words_per_column(n_rows, k):
    return 2 + (n_rows * k + 31) // 32


# ---------------------------------------------------------------- NumPy reference
def encode_ref(g, r, packed, k, use_minmax, clip):
    n_cols, n_rows = g.shape
    W = words_per_column(n_rows, k)
    v = g + r
    v64 = v.astype(np.float64)
    sumsq = ref_lane_sums(v64 * v64)
    bad = ~np.isfinite(sumsq)
    if bad.any():
        return int(np.argmax(bad))
    if use_minmax:   # in the order of order_key: a zero minimum is -0 if the column has one
        keys = order_key_ref(v)
        lower = order_key(keys.min(axis=1)).view(np.float32)
        upper = order_key(keys.max(axis=1)).view(np.float32)
    else:
        upper = (clip * np.sqrt(sumsq / n_rows)).astype(np.float32)
        lower = -upper
    levels = 1 << k
    step = ((upper.astype(np.float64) - lower) / levels).astype(np.float32)
    inv = np.divide(1.0, step.astype(np.float64), out=np.zeros(n_cols), where=step > 0)
    t = (v64 - lower[:, None].astype(np.float64)) * inv[:, None]
    q = np.clip(np.floor(t), 0, levels - 1).astype(np.int64)
    dec = (lower[:, None].astype(np.float64) + step[:, None].astype(np.float64) * (q + 0.5))
    r[:] = v - dec.astype(np.float32)
    cols = packed.view(np.uint32).reshape(n_cols, W)
    cols[:, 0] = lower.view(np.uint32)
    cols[:, 1] = upper.view(np.uint32)
    bits = ((q[:, :, None] >> np.arange(k)) & 1).astype(np.uint8).reshape(n_cols, n_rows * k)
    stream = np.zeros((n_cols, (W - 2) * 32), np.uint8)
    stream[:, :n_rows * k] = bits
    cols[:, 2:] = np.packbits(stream, axis=1, bitorder="little").view(np.uint32)
    return -1


def decode_ref(packed, out, accumulate, k):
    n_cols, n_rows = out.shape
    cols = packed.view(np.uint32).reshape(n_cols, words_per_column(n_rows, k))
    lower = cols[:, 0].view(np.float32)
    upper = cols[:, 1].view(np.float32)
    step = ((upper.astype(np.float64) - lower) / (1 << k)).astype(np.float32)
    bits = np.unpackbits(cols[:, 2:].copy().view(np.uint8), axis=1, bitorder="little")
    q = (bits[:, :n_rows * k].reshape(n_cols, n_rows, k).astype(np.int64) << np.arange(k)).sum(2)
    dec = (lower[:, None].astype(np.float64) + step[:, None].astype(np.float64) * (q + 0.5))
    if accumulate:
        out += dec.astype(np.float32)
    else:
        out[:] = dec.astype(np.float32)


# ---------------------------------------------------------------- Numba CPU
@njit(inline="always")
def _column_sumsq(gc, rc, sq):
    """The canonical lane sums of squares (float64) of v = g + r over one column (range
    "rms"); sq is LANES of scratch."""
    n_rows = gc.size
    nfull = n_rows // LANES
    for l in range(LANES):
        sq[l] = 0.0
    for i in range(nfull):
        for l in range(LANES):
            x = np.float64(gc[i * LANES + l] + rc[i * LANES + l])
            sq[l] += x * x
    for j in range(nfull * LANES, n_rows):
        x = np.float64(gc[j] + rc[j])
        sq[j - nfull * LANES] += x * x
    return lane_tree_cpu(sq)


@njit(inline="always")
def _take_key(v, mnk, mxk):
    """(mnk, mxk) after v's order key. Numba widens int32 arithmetic to int64; the casts let
    LLVM keep 8 lanes of int32."""
    key = np.int32(_order_key_cpu(f32_bits(v)))
    return np.int32(min(mnk, key)), np.int32(max(mxk, key))


@njit(inline="always")
def _keys_range(gc, rc, a, b, mnk, mxk):
    """mnk/mxk updated with the order keys of v = g + r over rows [a, b) (_column_minmax)."""
    for i in range(a, b):
        mnk, mxk = _take_key(gc[i] + rc[i], mnk, mxk)
    return mnk, mxk


@njit(inline="always")
def _keys_result(mnk, mxk):
    """(min, max, finite) from the extreme keys."""
    return (f32_from_bits(np.int32(_order_key_cpu(mnk))),
            f32_from_bits(np.int32(_order_key_cpu(mxk))),
            KEY_NEG_INF < mnk and mxk < KEY_POS_INF)


@njit(inline="always")
def _column_minmax(gc, rc):
    """(min, max, finite) of v = g + r over one column (range "minmax"), by order keys: one
    flat loop of integer min/max reductions, which LLVM vectorises on every x86 (per-lane
    float minima it unrolled to scalar code on Zen 3). Exact; -0 counts below +0."""
    # above (below) every finite key: no finite row leaves them there
    mnk, mxk = _keys_range(gc, rc, 0, gc.size, np.int32(KEY_POS_INF + 1),
                           np.int32(KEY_NEG_INF - 1))
    return _keys_result(mnk, mxk)


@njit(inline="always")
def _pack4(x):
    """8 codes < 16, one per byte of x (little-endian) -> the 32-bit word, code j at 4 j."""
    x = (x | (x >> np.uint64(4))) & np.uint64(0x00FF00FF00FF00FF)
    x = (x | (x >> np.uint64(8))) & np.uint64(0x0000FFFF0000FFFF)
    return np.uint32((x | (x >> np.uint64(16))) & np.uint64(0xFFFFFFFF))


@njit(inline="always")
def _pack2(x):
    """8 codes < 4, one per byte of x -> 16 bits, code j at 2 j."""
    x = (x | (x >> np.uint64(6))) & np.uint64(0x000F000F000F000F)
    x = (x | (x >> np.uint64(12))) & np.uint64(0x000000FF000000FF)
    return np.uint32((x | (x >> np.uint64(24))) & np.uint64(0xFFFF))


@njit(inline="always")
def _quantize(v, lower, inv, maxq_f, step):
    """_code and _value without branches: the clamp as min/max (the same q: t <= 0 gives 0,
    t >= maxq gives maxq, else trunc = floor), so the loop vectorises."""
    t = (np.float64(v) - np.float64(lower)) * inv
    q = np.int32(min(max(t, 0.0), maxq_f))
    return q, np.float32(np.float64(lower) + np.float64(step) * (q + 0.5))


@njit(inline="always")
def _threshold(j, lower, step, inv):
    """The smallest float32 v whose _quantize code is at least j (1 <= j <= maxq), +inf if
    none (step 0). t(v) = (v - lower) * inv in float64 never falls as v rises (each rounding
    is monotone), so code(v) >= j exactly when v >= this threshold: start from the float32
    nearest lower + j * step and walk the float32s in order (keys, -0 below +0), down while
    t >= j, then up while t < j (a step or two)."""
    if not inv > 0.0:
        return np.float32(np.inf)
    key = np.int32(_order_key_cpu(f32_bits(np.float32(np.float64(lower) + np.float64(step) * j))))
    lo64 = np.float64(lower)
    while (np.float64(f32_from_bits(np.int32(_order_key_cpu(key)))) - lo64) * inv >= j:
        key -= np.int32(1)
    while (np.float64(f32_from_bits(np.int32(_order_key_cpu(key)))) - lo64) * inv < j:
        key += np.int32(1)
    return f32_from_bits(np.int32(_order_key_cpu(key)))


@njit(inline="always")
def _quantize2(v, t1, t2, t3, d0, d1, d2, d3):
    """_quantize for k = 2 by the column's three thresholds (_threshold) and four decoded
    values: the same code and value, by float32 compares and selects (8 lanes on AVX2)
    instead of float64 arithmetic and conversions (4 lanes)."""
    c1, c2, c3 = v >= t1, v >= t2, v >= t3
    q = np.int32(c1) + np.int32(c2) + np.int32(c3)
    return q, d3 if c3 else (d2 if c2 else (d1 if c1 else d0))


@njit(cache=True)
def _encode_column(gc, rc, colw, colf, k, lower, upper, gn, rn, take_next, codes):
    """Codes and residuals of one finite column whose range [lower, upper] is known, in one
    pass over it (from L1: the range's pass has just read it). With take_next (minmax),
    the same loop takes the next column's min and max keys: its rows stream from memory
    while this column's arithmetic runs, instead of after it. Returns the next column's
    (lower, upper, finite) (meaningless without take_next).
    Called once per column, not inlined: inlining cost a second of compiling, no speed."""
    n_rows = gc.size
    maxq = (1 << k) - 1
    colf[0] = lower
    colf[1] = upper
    step = _step_cpu(lower, upper, maxq + 1)
    inv = _inv_cpu(step)
    maxq_f = np.float64(maxq)
    mnk, mxk = np.int32(KEY_POS_INF + 1), np.int32(KEY_NEG_INF - 1)
    start = 0
    if 32 % k == 0:   # k = 2, 4, 8: codes first (one vectorised loop), then whole words
        per = 32 // k
        start = n_rows // per * per
        # the codes as bytes (k = 8: the word area itself, little-endian), then whole
        # words from 8 codes at a time by shifts and masks; every loop vectorises
        code8 = colw[2:].view(np.uint8) if k == 8 else codes.view(np.uint8)
        if k == 2:   # thresholds and selects: half the arithmetic per value of _quantize
            t1, t2, t3 = (_threshold(1, lower, step, inv), _threshold(2, lower, step, inv),
                          _threshold(3, lower, step, inv))
            d0, d1, d2, d3 = (_value_cpu(0, lower, step), _value_cpu(1, lower, step),
                              _value_cpu(2, lower, step), _value_cpu(3, lower, step))
            if take_next:
                for i in range(start):
                    v = gc[i] + rc[i]
                    q, value = _quantize2(v, t1, t2, t3, d0, d1, d2, d3)
                    rc[i] = v - value
                    code8[i] = np.uint8(q)
                    mnk, mxk = _take_key(gn[i] + rn[i], mnk, mxk)
            else:
                for i in range(start):
                    v = gc[i] + rc[i]
                    q, value = _quantize2(v, t1, t2, t3, d0, d1, d2, d3)
                    rc[i] = v - value
                    code8[i] = np.uint8(q)
        elif take_next:   # the flag outside the loop: inside, it stops LLVM vectorising it
            for i in range(start):
                v = gc[i] + rc[i]
                q, value = _quantize(v, lower, inv, maxq_f, step)
                rc[i] = v - value
                code8[i] = np.uint8(q)
                mnk, mxk = _take_key(gn[i] + rn[i], mnk, mxk)
        else:
            for i in range(start):
                v = gc[i] + rc[i]
                q, value = _quantize(v, lower, inv, maxq_f, step)
                rc[i] = v - value
                code8[i] = np.uint8(q)
        if k == 4:
            for w in range(start // 8):
                colw[2 + w] = _pack4(codes[w])
        elif k == 2:
            for w in range(start // 16):
                colw[2 + w] = _pack2(codes[2 * w]) | (_pack2(codes[2 * w + 1]) << np.uint32(16))
    acc = np.uint64(0)  # bit accumulator: fields enter at bit nb, words leave at 32
    nb = 0
    w = 2 + start * k // 32
    for i in range(start, n_rows):
        v = gc[i] + rc[i]
        q, value = _quantize(v, lower, inv, maxq_f, step)
        rc[i] = v - value
        acc |= np.uint64(q) << np.uint64(nb)
        nb += k
        if nb >= 32:
            colw[w] = np.uint32(acc & np.uint64(0xFFFFFFFF))
            acc >>= np.uint64(32)
            nb -= 32
            w += 1
    if nb > 0:
        colw[w] = np.uint32(acc)
    if take_next:
        mnk, mxk = _keys_range(gn, rn, start, n_rows, mnk, mxk)
    return _keys_result(mnk, mxk)


@njit(parallel=True, cache=True)
def encode_cpu(g, r, cols, fcols, bad, k, use_minmax, clip, nchunk):
    """Columns in nchunk tasks, each with its own scratch (allocated once per task). A
    column's range, then its codes; minmax takes each next column's range inside the
    previous column's code loop (_encode_column)."""
    n_cols, n_rows = g.shape
    for t in prange(nchunk):
        sq = np.empty(LANES, np.float64)
        codes = np.empty((n_rows + 7) // 8, np.uint64)   # codes as bytes, 8 to a word
        c0, c1 = t * n_cols // nchunk, (t + 1) * n_cols // nchunk
        lower, upper, finite = np.float32(0.0), np.float32(0.0), True
        if use_minmax and c0 < c1:
            lower, upper, finite = _column_minmax(g[c0], r[c0])
        for c in range(c0, c1):
            if not use_minmax:
                sumsq = _column_sumsq(g[c], r[c], sq)
                finite = sumsq - sumsq == 0.0   # NaN or Inf somewhere in the column
                lower, upper = _range_cpu(sumsq, 0.0, 0.0, n_rows, False, clip)
            take_next = use_minmax and c + 1 < c1
            cn = c + 1 if take_next else c
            if finite:
                nxt = _encode_column(g[c], r[c], cols[c], fcols[c], k, lower, upper, g[cn],
                                     r[cn], take_next, codes)
            else:
                bad[c] = 1
                nxt = _column_minmax(g[cn], r[cn])
            if take_next:
                lower, upper, finite = nxt


@njit(inline="always")
def _unpack4(word):
    """_pack4's inverse: a 32-bit word of 8 4-bit codes -> one code per byte of a uint64."""
    x = np.uint64(word)
    x = (x | (x << np.uint64(16))) & np.uint64(0x0000FFFF0000FFFF)
    x = (x | (x << np.uint64(8))) & np.uint64(0x00FF00FF00FF00FF)
    return (x | (x << np.uint64(4))) & np.uint64(0x0F0F0F0F0F0F0F0F)


@njit(inline="always")
def _unpack2(half):
    """_pack2's inverse: 16 bits of 8 2-bit codes -> one code per byte of a uint64."""
    x = np.uint64(half)
    x = (x | (x << np.uint64(24))) & np.uint64(0x000000FF000000FF)
    x = (x | (x << np.uint64(12))) & np.uint64(0x000F000F000F000F)
    return (x | (x << np.uint64(6))) & np.uint64(0x0303030303030303)


@njit(inline="always")
def _decode_bytes(code8, n, lower, step, outc, accumulate):
    """outc[:n] (+)= the values of n codes given one per byte: a flat loop, vectorised."""
    if accumulate:
        for i in range(n):
            outc[i] += _value_cpu(int(code8[i]), lower, step)
    else:
        for i in range(n):
            outc[i] = _value_cpu(int(code8[i]), lower, step)


@njit(parallel=True, cache=True)
def decode_cpu(cols, fcols, out, accumulate, k, nchunk):
    """Columns in nchunk tasks (scratch once per task). k = 2, 4: whole words are first
    unpacked to one code per byte by shifts and masks, then decoded by the flat loop k = 8
    uses (the codes read straight from words, 8 or 16 to a word, were not vectorised)."""
    n_cols, n_rows = out.shape
    mask = np.uint64((1 << k) - 1)
    for t in prange(nchunk):
        codes = np.empty((n_rows + 7) // 8, np.uint64)   # codes as bytes, 8 to a word
        code8 = codes.view(np.uint8)
        for c in range(t * n_cols // nchunk, (t + 1) * n_cols // nchunk):
            lower = fcols[c, 0]
            step = _step_cpu(lower, fcols[c, 1], 1 << k)
            start = 0
            if k == 8:        # one code per byte, little-endian: the word area as bytes
                start = n_rows
                _decode_bytes(cols[c, 2:].view(np.uint8), n_rows, lower, step, out[c],
                              accumulate)
            elif 32 % k == 0:   # k = 2, 4: whole words, as the encoder writes them
                per = 32 // k
                start = n_rows // per * per
                if k == 4:
                    for w in range(start // 8):
                        codes[w] = _unpack4(cols[c, 2 + w])
                else:
                    for w in range(start // 16):
                        word = cols[c, 2 + w]
                        codes[2 * w] = _unpack2(word & np.uint32(0xFFFF))
                        codes[2 * w + 1] = _unpack2(word >> np.uint32(16))
                _decode_bytes(code8, start, lower, step, out[c], accumulate)
            acc = np.uint64(0)
            nb = 0
            w = 2 + start * k // 32
            for i in range(start, n_rows):
                if nb < k:
                    acc |= np.uint64(cols[c, w]) << np.uint64(nb)
                    nb += 32
                    w += 1
                q = int(acc & mask)
                acc >>= np.uint64(k)
                nb -= k
                val = _value_cpu(q, lower, step)
                if accumulate:
                    out[c, i] += val
                else:
                    out[c, i] = val


# ---------------------------------------------------------------- Numba CUDA
@cuda.jit
def encode_cuda(g, r, words, fwords, bad, k, use_minmax, clip, table):
    """One 32-thread block per column of the table (element offset in the flat g and r, rows,
    word offset of its packed column): canonical lane sums, then 32 rows at a time, one per
    lane (coalesced: code and residual from one read), the chunk's k words packed through
    shared memory (pack_chunk)."""
    c = cuda.blockIdx.x
    lane = cuda.threadIdx.x
    ga = table[c, 0]
    n_rows = table[c, 1]
    wo = table[c, 2]
    W = 2 + (n_rows * k + 31) // 32
    sq = cuda.shared.array(LANES, np.float64)
    mns = cuda.shared.array(LANES, np.float32)
    mxs = cuda.shared.array(LANES, np.float32)
    lu = cuda.shared.array(3, np.float32)
    zeros = cuda.shared.array(LANES, np.int32)
    acc = 0.0
    mn = np.float32(np.inf)
    mx = np.float32(-np.inf)
    z = 0   # bit 0: the column holds a -0, bit 1: a +0 (the CPU's order keys put -0 below +0)
    for i in range(lane, n_rows, LANES):
        v = g[ga + i] + r[ga + i]
        x = np.float64(v)
        acc += x * x
        mn = min(mn, v)
        mx = max(mx, v)
        if v == 0.0:
            z |= 1 if math.copysign(1.0, v) < 0.0 else 2
    sq[lane] = acc
    mns[lane] = mn
    mxs[lane] = mx
    zeros[lane] = z
    cuda.syncthreads()
    if lane == 0:
        sumsq = lane_tree_cuda(sq)
        for l in range(1, LANES):
            mn = min(mn, mns[l])
            mx = max(mx, mxs[l])
            z |= zeros[l]
        if mn == 0.0:
            mn = np.float32(-0.0) if z & 1 else np.float32(0.0)
        if mx == 0.0:
            mx = np.float32(0.0) if z & 2 else np.float32(-0.0)
        lu[2] = 0.0
        if not sumsq - sumsq == 0.0:
            lu[2] = 1.0
            bad[0] = c + 1
        else:
            lower, upper = _range_cuda(sumsq, mn, mx, n_rows, use_minmax, clip)
            lu[0] = lower
            lu[1] = upper
            fwords[wo] = lower
            fwords[wo + 1] = upper
    cuda.syncthreads()
    if lu[2] != 0.0:
        return
    lower = lu[0]
    maxq = (1 << k) - 1
    step = _step_cuda(lower, lu[1], maxq + 1)
    inv = _inv_cuda(step)
    codes = cuda.shared.array(LANES, np.int32)
    for base in range(0, n_rows, LANES):   # every lane the same trip count (syncthreads)
        i = base + lane
        q = 0
        if i < n_rows:
            v = g[ga + i] + r[ga + i]
            q = _code_cuda(v, lower, inv, maxq)
            r[ga + i] = v - _value_cuda(q, lower, step)
        codes[lane] = q
        cuda.syncthreads()
        at = base * k // LANES   # the chunk's first word: 32 rows fill k words exactly
        pack_chunk_cuda(codes, lane, k, words, wo + 2 + at, min(k, W - 2 - at))
        cuda.syncthreads()


@cuda.jit
def decode_cuda(words, fwords, out, mode, k, n_src, stride, table):
    """One block per column of the table (element offset in the flat out, rows, word offset),
    one thread per row; a field may span two words. mode SET: out = decoded; ADD: out +=
    decoded. n_src > 1: the sum of n_src packed columns `stride` words apart, added in source
    order in float32 as a decode then decode_accumulate per source add them, one write."""
    c = cuda.blockIdx.x
    oa = table[c, 0]
    n_rows = table[c, 1]
    wo = table[c, 2]
    mask = np.uint64((1 << k) - 1)
    for i in range(cuda.threadIdx.x, n_rows, cuda.blockDim.x):
        acc = out[oa + i] if mode == ADD else np.float32(0.0)
        bit = i * k
        off = bit % 32
        for s in range(n_src):
            at = s * stride + wo
            lower = fwords[at]
            step = _step_cuda(lower, fwords[at + 1], 1 << k)
            w = at + 2 + bit // 32
            x = np.uint64(words[w]) >> np.uint64(off)
            if off + k > 32:
                x |= np.uint64(words[w + 1]) << np.uint64(32 - off)
            val = _value_cuda(int(x & mask), lower, step)
            if mode == ADD or s > 0:   # float32 sums, in order (acc stays float32)
                acc += val
            else:
                acc = val
        out[oa + i] = acc


# ---------------------------------------------------------------- the codec
class KBit(Codec):
    """k-bit codec; options: bits (2..8), range ("rms" | "minmax"), clip (RMS multiple)."""
    name = "kbit"

    def __init__(self, backend="cpu", bits=4, range="minmax", clip=4.0):
        super().__init__(backend)
        if not (isinstance(bits, (int, np.integer)) and 2 <= bits <= 8):
            raise ValueError(f"kbit: bits must be an integer in 2..8, got {bits!r}")
        if range not in ("rms", "minmax"):
            raise ValueError(f"kbit: range must be 'rms' or 'minmax', got {range!r}")
        self.bits = int(bits)
        self.range = range
        self.clip = float(clip)  # RMS multiple, used by range="rms" only (CNTK: 4)

    def packed_nbytes(self, n_cols, n_rows):
        return 4 * n_cols * words_per_column(n_rows, self.bits) if n_rows else 0

    def encode(self, grad, residual, out):
        self._check_encode(grad, residual, out)
        n_cols, n_rows = grad.shape
        if n_cols == 0 or n_rows == 0:
            return
        k, mm = self.bits, self.range == "minmax"
        W = words_per_column(n_rows, k)
        if self.backend == "reference":
            bad = encode_ref(grad, residual, out, k, mm, self.clip)
        elif self.backend == "cpu":
            flags = np.zeros(n_cols, np.uint8)
            encode_cpu(grad, residual, out.view(np.uint32).reshape(n_cols, W),
                       out.view(np.float32).reshape(n_cols, W), flags, k, mm, self.clip,
                       min(n_cols, 8 * numba.get_num_threads()))
            bad = int(np.argmax(flags)) if flags.any() else -1
        else:
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
        W = words_per_column(n_rows, self.bits)
        if self.backend == "reference":
            decode_ref(packed, out, accumulate, self.bits)
        elif self.backend == "cpu":
            decode_cpu(packed.view(np.uint32).reshape(n_cols, W),
                       packed.view(np.float32).reshape(n_cols, W), out, accumulate, self.bits,
                       min(n_cols, 8 * numba.get_num_threads()))
        else:
            self._decode_table([(0, n_cols, n_rows, 0)], packed,
                               as_device(out).reshape(out.size), ADD if accumulate else SET)

    # ---- the GPU launches of Codec's table path (every matrix of a phase in one launch)
    def words_per_column(self, rows):
        return words_per_column(rows, self.bits)

    def _launch_encode(self, table, src, residual, out, flag):
        o = as_device(out)
        encode_cuda[table.shape[0], LANES](as_device(src), as_device(residual),
                                           o.view(np.uint32), o.view(np.float32), flag,
                                           self.bits, self.range == "minmax", self.clip, table)

    def _launch_decode(self, table, packed, out, mode, lr, n_src, stride, most_rows):
        if mode not in (SET, ADD):
            raise ValueError("kbit: no fused decode-apply (the exchange decodes, then applies)")
        p = as_device(packed)
        decode_cuda[table.shape[0], row_threads(most_rows)](
            p.view(np.uint32), p.view(np.float32), out, mode, self.bits, n_src, stride, table)

    def decode(self, packed, out):
        self._decode(packed, out, False)

    def decode_accumulate(self, packed, out):
        self._decode(packed, out, True)
