"""Dettmers' (2016) 8-bit data types as a codec: linear, mantissa, static tree, dynamic tree.

Every type is a sorted table of 256 float32 values times a scale per block:
  linear        k/127, k = -128..127                          scale = abs-max (default)
  mantissa      +-m * 10^-e / 10, m = 0..15, e = 0..7 (4-bit    scale = exponent offset
                mantissa, 3-bit exponent; has duplicate zeros)  (default 10, the paper's 10^1)
  static_tree   +-t_j * 10^-e, t_j the 16 leaves of the bisection tree on (0.1, 1) (midpoints
                of linspace(0.1, 1, 17)), e = 0..7            scale = exponent offset
  dynamic_tree  bitsandbytes' dynamic map: for i = 0..6 the 2^i midpoints of linspace(0.1, 1,
                2^i + 1) times +-10^(i-6), plus 0 and 1       scale = abs-max (default)
Encode: x = v / scale (float64), code = index of the nearest table value = the number of the
255 midpoints <= x (ties go up). The reference counts with np.searchsorted, CUDA with an 8-step
binary search in shared memory, the CPU with one lookup in a bucket table keyed by the bits of
x (see `code_buckets`), or, for one scale over a large matrix, keyed by the bits of v itself
against that scale's thresholds (see `scale_buckets`): the same codes. Decode:
table[code] * scale.
Normalisation `norm="absmax"` uses the abs-max of each block of `block` values of the
flattened matrix (block=0: one block = the whole matrix), recomputed every `refresh` encodes
(the paper refreshes every 50 minibatches; values beyond a stale abs-max clip to +-1 and the
error feedback, when on, carries the rest). `norm="fixed"` uses scale = `offset`.

Packed layout (4-byte aligned): [uint32 age][float32 scale x n_blocks][uint8 code x n][pad to 4].
`age` counts encodes since the scales were computed: reusing the previous scales reads them
from the same output buffer, so `refresh` > 1 needs the caller to pass the same buffer for the
same matrix each step (the exchange's preallocated buffers); a fresh buffer recomputes.
"""
import numpy as np
from numba import njit, prange

from hpcsgd.codecs.common import (KEY_NEG_INF, KEY_POS_INF, Codec, f32_bits, f32_from_bits,
                                  f64_bits, nonfinite_error, order_key)
from hpcsgd.device import as_device, mul_rn, one_thread_each
from hpcsgd.lazy_cuda import cuda

DTYPES = ("linear", "mantissa", "static_tree", "dynamic_tree")


def make_table(dtype):
    """The 256 sorted float32 values of a type, normalised (scale 1)."""
    if dtype == "linear":
        t = np.arange(-128, 128) / 127.0
    elif dtype == "mantissa":
        m = np.arange(16.0)
        t = np.concatenate([m * 10.0 ** (-e) / 10.0 for e in range(8)])
        t = np.concatenate([-t, t])
    elif dtype == "static_tree":
        b = np.linspace(0.1, 1.0, 17)
        leaves = (b[:-1] + b[1:]) / 2
        t = np.concatenate([leaves * 10.0 ** (-e) for e in range(8)])
        t = np.concatenate([-t, t])
    elif dtype == "dynamic_tree":
        t = [0.0, 1.0]
        for i in range(7):
            b = np.linspace(0.1, 1.0, 2 ** i + 1)
            means = (b[:-1] + b[1:]) / 2
            t += list(10.0 ** (i - 6) * means) + list(-(10.0 ** (i - 6)) * means)
        t = np.array(t)
    else:
        raise ValueError(f"dettmers: dtype must be one of {DTYPES}, got {dtype!r}")
    t = np.sort(t.astype(np.float32))
    assert t.shape == (256,)
    return t


def midpoints(table):
    t = table.astype(np.float64)
    return (t[:-1] + t[1:]) / 2  # exact: float32 halves fit in float64


def _code(v, scale, mids):
    """Index of the table value nearest to v / scale = number of midpoints <= v / scale,
    by an 8-step binary search (ties go up). Branch-free: q + step - 1 <= 254 at every step,
    and a comparison's 0/1 picks the step (no mispredicted branch per level)."""
    x = np.float64(v) / np.float64(scale) if scale > 0 else 0.0
    q = 0
    step = 128
    while step > 0:
        q += step * (mids[q + step - 1] <= x)
        step >>= 1
    return q


def _value(t, scale):
    return np.float32(np.float64(t) * np.float64(scale))  # exact product, one rounding


def _value_gpu(t, scale):
    """_value on a GPU: the exact float64 product rounded once is the float32 product rounded
    once, as a multiply that ptxas may not fuse with the caller's add (device.mul_rn)."""
    return mul_rn(t, scale)


_value_cpu = njit(inline="always")(_value)
_code_cuda, _value_cuda = cuda.jit(device=True)(_code), cuda.jit(device=True)(_value_gpu)


def _reuse(age, refresh, old):
    return refresh > 1 and 1 <= age < refresh and old - old == 0.0 and old > 0.0


# ---------------------------------------------------------------- NumPy reference
def scales_ref(v, scales, block, age, refresh, norm_absmax, offset):
    n = v.size
    for b in range(scales.size):
        if not norm_absmax:
            scales[b] = offset
        elif not _reuse(age, refresh, scales[b]):
            scales[b] = np.abs(v[b * block:min(n, (b + 1) * block)]).max()


def encode_ref(v, r, codes, scales, block, table, mids):
    s = np.repeat(scales, block)[:v.size].astype(np.float64)
    x = np.divide(v.astype(np.float64), s, out=np.zeros(v.size), where=s > 0)
    codes[:] = np.searchsorted(mids, x, side="right")
    if r is not None:
        r[:] = v - (table[codes].astype(np.float64) * s).astype(np.float32)


def decode_ref(codes, scales, table, out, block, accumulate):
    s = np.repeat(scales, block)[:out.size].astype(np.float64)
    dec = (table[codes].astype(np.float64) * s).astype(np.float32)
    if accumulate:
        out += dec
    else:
        out[:] = dec


# ---------------------------------------------------------------- Numba CPU
# Work is split into tasks of at most CHUNK values inside one normalisation block, so that a
# whole-matrix block (block=0, the default) still runs on every thread; a block's abs-max is
# the max of its tasks' maxima (max is exact: any order gives the same bits).
CHUNK = 1 << 14


@njit(inline="always")
def _task_range(t, per_block, block, n):
    """(normalisation block, first, end) of task t."""
    b = t // per_block
    lo = b * block + (t % per_block) * CHUNK
    return b, lo, min(lo + CHUNK, (b + 1) * block, n)


@njit(cache=True)
def _absmax(g, r, ef, lo, hi):
    """max |g + r| (or |g|) over [lo, hi), as the integer max of the values' bits with the
    sign cleared: for floats that are not NaN, the same order and the same value; a NaN gives
    a NaN (as NumPy's max), and the encode's exponent check reports it. One flat int32
    reduction that LLVM vectorises on every x86 (8 lanes of vpmaxsd on AVX2), where per-lane
    float maxima stayed scalar on Zen 3. Called once per task, not inlined (inlining only
    added compile time)."""
    m = np.int32(0)
    a, b = np.uint64(lo), np.uint64(hi)   # unsigned: contiguous loads (encode_cpu)
    if ef:
        for i in range(a, b):
            m = np.int32(max(m, np.int32(f32_bits(g[i] + r[i]) & np.int32(0x7FFFFFFF))))
    else:
        for i in range(a, b):
            m = np.int32(max(m, np.int32(f32_bits(g[i]) & np.int32(0x7FFFFFFF))))
    return f32_from_bits(m)


_reuse_cpu = njit(inline="always")(_reuse)


@njit(parallel=True, cache=True)
def scales_cpu(g, r, ef, scales, block, age, refresh, norm_absmax, offset):
    """The scales of blocks larger than a task (block > CHUNK): a pass of its own before the
    encode. Smaller blocks take their abs-max inside the encode's task (encode_cpu)."""
    n, nb = g.size, scales.size
    per_block = -(-block // CHUNK)
    if not norm_absmax:
        scales[:] = offset
        return
    keep = np.zeros(nb, np.bool_)
    for b in range(nb):
        keep[b] = _reuse_cpu(age, refresh, scales[b])
    part = np.zeros(nb * per_block, np.float32)
    for t in prange(nb * per_block):
        b, lo, hi = _task_range(t, per_block, block, n)
        if not keep[b]:
            part[t] = _absmax(g, r, ef, lo, hi)
    for b in range(nb):
        if not keep[b]:
            scales[b] = part[b * per_block:(b + 1) * per_block].max()


# The CPU encode counts midpoints <= x with one lookup. Key = the top bits of float64 x: sign,
# exponent (clamped to [emin, emax], octaves that hold no midpoint) and M mantissa bits, with M
# the smallest that leaves at most one midpoint in any bucket. x's remaining S = 52 - M bits
# (mirrored for negative x, whose bits grow as x falls) are its place in the bucket, 0..2^S-1.
# lo = the count at the bucket's lower end; t = the place of the bucket's midpoint, 1..2^S-1,
# or 2^S, above every x, for a bucket without one. Entry = lo * 2^S + (2^S - t), so that
# code = lo + (place >= t) = (entry + place) >> S: one add and one shift after the one 64-bit
# lookup per value (a binary search is 8 dependent lookups: 8% of the memory limit). x = +-0 is
# the one value outside the rule (mantissa's duplicate zeros put midpoints at 0): its key is the
# table's last entry, qzero * 2^S, which always gives qzero.


def code_buckets(mids):
    """(entries int64, emin, emax, M) for `_bucket_key`; emin/emax biased exponents. The last
    entry is the zero key's."""
    mids = np.asarray(mids, np.float64)
    mag = np.abs(mids[mids != 0])
    emin = int(np.frexp(mag.min())[1]) - 1 + 1023 - 1   # the octave below the smallest
    emax = int(np.frexp(mag.max())[1]) - 1 + 1023 + 1   # the octave above the largest
    ne = emax - emin + 1
    for M in range(1, 13):
        lowmask = (1 << (52 - M)) - 1
        e, m = np.meshgrid(np.arange(emin, emax + 1, dtype=np.int64),
                           np.arange(1 << M, dtype=np.int64), indexing="ij")
        b0 = ((e << 52) | (m << (52 - M))).ravel()
        lowmag, highmag = b0.view(np.float64), (b0 + lowmask).view(np.float64)
        entries = []
        for sign in (0, 1):  # x in [lowmag, highmag], or in [-highmag, -lowmag]
            a, b = (lowmag, highmag) if sign == 0 else (-highmag, -lowmag)
            lo = np.searchsorted(mids, a, side="right")
            hi = np.searchsorted(mids, b, side="right")
            if (hi - lo > 1).any():
                break
            thr_low = mids[np.minimum(lo, mids.size - 1)].view(np.int64) & lowmask
            t = np.where(hi > lo, thr_low if sign == 0 else lowmask - thr_low, lowmask + 1)
            assert (t >= 1).all()   # a midpoint at a bucket's lower end is counted in lo
            entries.append((lo.astype(np.int64) << (52 - M)) + (lowmask + 1 - t))
        else:
            qzero = int(np.searchsorted(mids, 0.0, side="right"))
            table = np.concatenate(entries + [[qzero << (52 - M)]])
            assert table.size == (2 * ne << M) + 1
            return table, emin, emax, M
    raise ValueError("dettmers: a table whose midpoints are too close for the bucket search")


@njit(inline="always")
def _bucket_key(x, emin, emax, M):
    """(index into `code_buckets`' table, x's place in its bucket). No table read: the
    encode computes the keys of a run of values as a vector loop of its own."""
    u = f64_bits(x)
    s = (u >> 63) & 1
    e = min(max((u >> 52) & 0x7FF, emin), emax)
    m = (u >> (52 - M)) & ((1 << M) - 1)
    lowmask = (1 << (52 - M)) - 1
    key = ((s * (emax - emin + 1) + e - emin) << M) | m
    return (2 * (emax - emin + 1) << M) if x == 0.0 else key, (u & lowmask) ^ (lowmask & -s)


@njit(inline="always")
def _bucket_count(entry, place, M):
    """Number of midpoints <= x, from x's bucket entry and place in the bucket. Unsigned:
    the result indexes the decoded values without Numba's negative-index check."""
    return np.uint64(entry + place) >> np.uint64(52 - M)


@njit(inline="always")
def _bucket_code(x, buckets, emin, emax, M):
    """Number of midpoints <= x (= _code's q), from `code_buckets`' table."""
    key, place = _bucket_key(x, emin, emax, M)
    return _bucket_count(buckets[key], place, M)


@njit(cache=True)
def _scaled_table(table, s, out):
    """out[c] = _value(table[c], s): every value a code can decode to under scale s, once per
    block (256 products) instead of once per value; decoding is then a lookup."""
    for c in range(table.size):
        out[c] = _value_cpu(table[c], s)


# The encode works on runs of SUB values still in L1, in three loops: keys (contiguous loads,
# the divide and bit arithmetic: vectorised), codes (one table read per value), residuals (one
# read of the block's decoded values per value). One loop doing all three is not vectorised on
# CPUs whose gathers LLVM rates slow (Zen 3: all scalar, 1.7x slower), and a store to r beside
# table reads it cannot prove apart stops vectorisation on the others.
SUB = 1024


@njit(inline="always")
def _encode_tasks(g, r, ef, codes, scales, block, table, buckets, emin, emax, M, bad, take_max):
    """bad[b] = 1 where block b holds a NaN or Inf. Branch-free loops.
    take_max (blocks of at most CHUNK values, one a task): the task takes its block's abs-max
    just before its codes, so the codes read the values from cache, not a second time from
    memory (otherwise scales_cpu has taken the scales in a pass of its own)."""
    n, nb = g.size, scales.size
    per_block = -(-block // CHUNK)
    flags = np.zeros(nb * per_block, np.uint8)
    for t in prange(nb * per_block):
        b, lo, hi = _task_range(t, per_block, block, n)
        vt = np.empty(table.size, np.float32)
        keys, places = np.empty(SUB, np.int32), np.empty(SUB, np.int64)
        if take_max:
            scales[b] = _absmax(g, r, ef, lo, hi)   # a task is its block: no other reads it
        s = scales[b]
        _scaled_table(table, s, vt)
        # a zero scale gives x = 0 for every value (_code's rule): v / inf is +-0 for a finite v
        # and NaN for the others, which the exponent check still sees
        sd = np.float64(s) if s > 0 else np.inf
        top = 0  # the largest exponent field of x: 0x7FF is a NaN or Inf
        for j in range(lo, hi, SUB):
            # unsigned indices: with a signed computed start, Numba's negative-index wraparound
            # hides that the loads are contiguous and LLVM gathers every one
            ja, jb = np.uint64(j), np.uint64(min(j + SUB, hi))
            if ef:  # outside the loop: a flag inside it stops LLVM vectorising the loop
                for i in range(ja, jb):
                    x = np.float64(g[i] + r[i]) / sd
                    keys[i - ja], places[i - ja] = _bucket_key(x, emin, emax, M)
                    top = max(top, (f64_bits(x) >> 52) & 0x7FF)
            else:
                for i in range(ja, jb):
                    x = np.float64(g[i]) / sd
                    keys[i - ja], places[i - ja] = _bucket_key(x, emin, emax, M)
                    top = max(top, (f64_bits(x) >> 52) & 0x7FF)
            for i in range(ja, jb):
                codes[i] = _bucket_count(buckets[np.uint64(keys[i - ja])], places[i - ja], M)
            if ef:
                for i in range(ja, jb):
                    r[i] = (g[i] + r[i]) - vt[codes[i]]
        flags[t] = top == 0x7FF
    for t in range(nb * per_block):
        if flags[t]:
            bad[t // per_block] = 1


def _compiled_encode(take_max):
    """One compiled encode per take_max, passed on as a constant (a closure value): with a
    run-time flag LLVM stopped vectorising the code loop (2.5x slower). Its own name gives
    each its own cache file."""
    def encode(g, r, ef, codes, scales, block, table, buckets, emin, emax, M, bad):
        _encode_tasks(g, r, ef, codes, scales, block, table, buckets, emin, emax, M, bad, take_max)
    encode.__name__ = encode.__qualname__ = f"encode_cpu_{'fused' if take_max else 'scaled'}"
    return njit(parallel=True, cache=True)(encode)


encode_cpu = _compiled_encode(False)        # the scales are set (scales_cpu)
encode_fused_cpu = _compiled_encode(True)   # each task takes its block's abs-max first


# One scale for a whole large matrix (block 0, the default): the codes by v's own float32
# bits, with no divide. For the scale s, T_c = the smallest float32 v with fl(v / s) >= mid_c
# (`scale_thresholds`); fl(v / s) never falls as v rises, so code(v) = #{c: T_c <= v} exactly.
# A bucket table over runs of 2^16 float32 order keys (`scale_buckets`, the same entry rule as
# `code_buckets`) then gives the code from one read, the keys come from 8 int32 lanes instead
# of 4 float64 ones, and the divide goes. Built per encode (about 0.1-0.3 ms for the dynamic
# tree's 30,558 buckets), so only for matrices of at least VSPACE_MIN_VALUES values; a scale
# whose thresholds share a bucket (a tiny scale crowding them into denormals), or a zero scale,
# takes the float64 path. About 1.2x on the 46M model's largest matrix on Zen 3 (1.06-1.41x
# round by round, experiments/dettmers_vspace.py; 1.14x through the codec with its abs-max
# pass, 1.24x with refresh 50). Its codes and residuals share one loop (the entry, then the
# decoded value, read per value): 1.17-1.22x over separate loops on Zen 3, where the float64
# path gained nothing from the same change (experiments/dettmers_vspace_loops.py).
VSPACE_MIN_VALUES = 1 << 20
_order_key_cpu = njit(inline="always")(order_key)


@njit(cache=True)
def scale_thresholds(mids, s):
    """The order keys (int64) of T_c, the smallest float32 v with float64(v) / s >= mids[c],
    for s > 0 finite: from the float32 nearest mids[c] * s, a step or two along the keys.
    -0 and +0 give the same codes (x = +-0 both count the midpoints <= 0), so a threshold at
    -0 (a midpoint 0: mantissa's duplicate zeros) is put at +0, which starts a bucket: all of
    them count in that bucket's lo."""
    sd = np.float64(s)
    keys = np.empty(mids.size, np.int64)
    for c in range(mids.size):
        k = np.int64(_order_key_cpu(f32_bits(np.float32(mids[c] * sd))))
        while k < KEY_POS_INF and \
                np.float64(f32_from_bits(_order_key_cpu(np.int32(k)))) / sd < mids[c]:
            k += 1
        while k > KEY_NEG_INF and \
                np.float64(f32_from_bits(_order_key_cpu(np.int32(k - 1)))) / sd >= mids[c]:
            k -= 1
        keys[c] = 0 if k == -1 else k   # -0 as +0 (the keys do the same, below)
    return keys


@njit(cache=True)
def scale_buckets(keys):
    """(entries int32, base): buckets of 2^16 order keys from the one below the first
    threshold's to the one above the last's; entry = lo * 2^16 + 2^16 - t (t: the place of
    the bucket's one threshold, 2^16 for none), so code = (entry + place) >> 16. Keys below
    or above the range clamp to the end buckets, which hold no threshold. No entries when a
    bucket would hold two thresholds."""
    w = 16   # a key's low 16 bits are its place (encode_vspace_cpu's 16 and 0xFFFF)
    base = (keys[0] >> w) - 1
    n = (keys[-1] >> w) + 2 - base
    entries = np.empty(n, np.int32)
    j = 0
    for b in range(n):
        start = (base + b) << w
        while j < keys.size and keys[j] <= start:
            j += 1
        t = 1 << w
        if j < keys.size and keys[j] < start + (1 << w):
            if j + 1 < keys.size and keys[j + 1] < start + (1 << w):
                return entries[:0], base
            t = keys[j] - start
        entries[b] = (j << w) + (1 << w) - t
    return entries, base


@njit(inline="always")
def _vspace_code(key, entries):
    """The code of a value from its bucket-and-place key (encode_vspace_cpu): one read."""
    w = np.uint64(np.uint32(key))
    return (np.uint64(entries[w >> np.uint64(16)]) + (w & np.uint64(0xFFFF))) >> np.uint64(16)


@njit(parallel=True, cache=True)
def encode_vspace_cpu(g, r, ef, codes, vt, entries, base, bad):
    """The codes (and residuals, v - vt[code]) of one scale's matrix from `scale_buckets`'
    entries; bad[0] = 1 if a value is NaN or Inf. Three loops over runs of SUB values in L1:
    v = g + r, keys (8 int32 lanes), then codes and residuals (two reads each)."""
    n = g.size
    lo_k = np.int32(base)
    hi_k = np.int32(base + entries.size - 1)
    tasks = -(-n // CHUNK)
    flags = np.zeros(tasks, np.uint8)
    for t in prange(tasks):
        lo, hi = t * CHUNK, min((t + 1) * CHUNK, n)
        keys, vs = np.empty(SUB, np.int32), np.empty(SUB, np.float32)
        top = np.int32(0)   # the largest exponent field, shifted: 0x7F800000 is a NaN or Inf
        for j in range(lo, hi, SUB):
            ja, jb = np.uint64(j), np.uint64(min(j + SUB, hi))
            if ef:
                for i in range(ja, jb):
                    vs[i - ja] = g[i] + r[i]
            else:
                for i in range(ja, jb):
                    vs[i - ja] = g[i]
            for i in range(np.uint64(0), jb - ja):
                u = f32_bits(vs[i] + np.float32(0.0))   # -0 + 0 = +0: one key for both zeros
                top = np.int32(max(top, np.int32(u & np.int32(0x7F800000))))
                key = np.int32(_order_key_cpu(u))
                k = np.int32(np.int32(min(np.int32(max(np.int32(key >> np.int32(16)), lo_k)),
                                          hi_k)) - lo_k)
                keys[i] = np.int32(np.int32(k << np.int32(16)) | np.int32(key & np.int32(0xFFFF)))
            if ef:
                for i in range(ja, jb):
                    c = _vspace_code(keys[i - ja], entries)
                    codes[i] = c
                    r[i] = vs[i - ja] - vt[c]
            else:
                for i in range(ja, jb):
                    codes[i] = _vspace_code(keys[i - ja], entries)
        flags[t] = top == np.int32(0x7F800000)
    for t in range(tasks):
        if flags[t]:
            bad[0] = 1


@njit(parallel=True, cache=True)
def decode_cpu(codes, scales, table, out, block, accumulate):
    """In tasks inside normalisation blocks (as encode_cpu): each block's 256 decoded values
    computed once, then a lookup per value (a vector gather from L1)."""
    n, nb = out.size, scales.size
    per_block = -(-block // CHUNK)
    for t in prange(nb * per_block):
        b, lo, hi = _task_range(t, per_block, block, n)
        vt = np.empty(table.size, np.float32)
        _scaled_table(table, scales[b], vt)
        ia, ib = np.uint64(lo), np.uint64(hi)  # unsigned: contiguous loads (encode_cpu)
        if accumulate:
            for i in range(ia, ib):
                out[i] += vt[codes[i]]
        else:
            for i in range(ia, ib):
                out[i] = vt[codes[i]]


# ---------------------------------------------------------------- Numba CUDA
@cuda.jit
def scales_cuda(g, r, ef, scales, block, age, refresh, norm_absmax, offset, head, new_age):
    """One thread block per normalisation block: shared-memory max reduction (max is exact,
    so the order does not matter). Block 0's thread 0 also writes the buffer's new age (the
    host gave it: no copy to the device)."""
    b = cuda.blockIdx.x
    t = cuda.threadIdx.x
    if b == 0 and t == 0:
        head[0] = new_age
    sm = cuda.shared.array(128, np.float32)
    old = scales[b]
    if not norm_absmax:
        if t == 0:
            scales[b] = offset
        return
    if refresh > 1 and 1 <= age < refresh and old - old == 0.0 and old > 0.0:
        return
    n = g.size
    m = np.float32(0.0)
    for i in range(b * block + t, min(n, (b + 1) * block), cuda.blockDim.x):
        v = g[i] + r[i] if ef else g[i]
        m = max(m, abs(v))
    sm[t] = m
    cuda.syncthreads()
    if t == 0:
        for j in range(1, cuda.blockDim.x):
            m = max(m, sm[j])
        scales[b] = m


@cuda.jit
def encode_cuda(g, r, ef, codes, scales, block, table, mids, bad):
    """One thread per value; the 256-entry table and its midpoints in shared memory."""
    sh_t = cuda.shared.array(256, np.float32)
    sh_m = cuda.shared.array(255, np.float64)
    t = cuda.threadIdx.x
    for j in range(t, 256, cuda.blockDim.x):
        sh_t[j] = table[j]
        if j < 255:
            sh_m[j] = mids[j]
    cuda.syncthreads()
    i = cuda.grid(1)
    if i >= g.size:
        return
    s = scales[i // block]
    v = g[i] + r[i] if ef else g[i]
    if not v - v == 0.0:
        bad[0] = i // block + 1
    q = _code_cuda(v, s, sh_m)
    codes[i] = q
    if ef:
        r[i] = v - _value_cuda(sh_t[q], s)


@cuda.jit
def decode_cuda(codes, scales, table, out, block, accumulate):
    sh_t = cuda.shared.array(256, np.float32)
    for j in range(cuda.threadIdx.x, 256, cuda.blockDim.x):
        sh_t[j] = table[j]
    cuda.syncthreads()
    i = cuda.grid(1)
    if i >= out.size:
        return
    val = _value_cuda(sh_t[codes[i]], scales[i // block])
    if accumulate:
        out[i] += val
    else:
        out[i] = val


def _host(a):
    return a if isinstance(a, np.ndarray) else a.copy_to_host()


# ---------------------------------------------------------------- the codec
class Dettmers(Codec):
    """Options: dtype, norm ("absmax" | "fixed"; default by type as in the paper), offset
    (fixed scale, default 10), block (values per abs-max block, 0 = whole matrix), refresh
    (recompute abs-max every N encodes), error_feedback (default True)."""
    name = "dettmers"

    def __init__(self, backend="cpu", dtype="dynamic_tree", norm=None, offset=10.0, block=0,
                 refresh=1, error_feedback=True):
        super().__init__(backend)
        self.dtype = dtype
        self.table = make_table(dtype)
        self.mids = midpoints(self.table)
        self.buckets = code_buckets(self.mids)
        if norm is None:
            norm = "absmax" if dtype in ("linear", "dynamic_tree") else "fixed"
        if norm not in ("absmax", "fixed"):
            raise ValueError(f"dettmers: norm must be 'absmax' or 'fixed', got {norm!r}")
        if int(block) < 0 or int(refresh) < 1:
            raise ValueError("dettmers: block must be >= 0 and refresh >= 1")
        self.norm, self.offset, self.block = norm, float(offset), int(block)
        self.refresh, self.error_feedback = int(refresh), bool(error_feedback)
        self.buffer_state = self.refresh > 1   # the scales (and their age) are reused
        self._dev = None  # device copies of table and midpoints, made on first CUDA use

    def _blocking(self, n):
        block = self.block if self.block > 0 else max(n, 1)
        return block, -(-n // block)

    def encode_reread_bytes(self, n_cols, n_rows):
        """A fresh abs-max of a block larger than a task (the default: one per matrix) is a
        pass of its own over grad and residual before the first code (scales_cpu); smaller
        blocks take theirs in the encode's task, from cache."""
        n = n_cols * n_rows
        if self.norm != "absmax" or self._blocking(n)[0] <= CHUNK:
            return 0.0
        return (8.0 if self.error_feedback else 4.0) * n / self.refresh

    def packed_nbytes(self, n_cols, n_rows):
        n = n_cols * n_rows
        if n == 0:
            return 0
        return 4 + 4 * self._blocking(n)[1] + 4 * (-(-n // 4))

    def _views(self, packed, n):
        nb = self._blocking(n)[1]
        return (packed[:4].view(np.uint32), packed[4:4 + 4 * nb].view(np.float32),
                packed[4 + 4 * nb:4 + 4 * nb + n])

    def encode(self, grad, residual, out):
        self._check_encode(grad, residual, out)
        n = grad.size
        if n == 0:
            return
        block, nb = self._blocking(n)
        ef = self.error_feedback and residual is not None
        absmax = self.norm == "absmax"
        if self.backend == "cuda":
            o = as_device(out)
            head, scales, codes = self._views(o, n)
            # the age matters only to a refresh > 1 (then read: a device sync); else it is 1
            age = int(head.copy_to_host()[0]) if self.refresh > 1 else 1
            g = as_device(grad).reshape(n)
            r = as_device(residual).reshape(n) if ef else g
            if self._dev is None:
                self._dev = cuda.to_device(self.table), cuda.to_device(self.mids)
            flag = self._device_flag(lambda v: self._fault(grad, residual, ef))
            new_age = 1 if age < 1 or age >= self.refresh else age + 1
            scales_cuda[nb, 128](g, r, ef, scales, block, age, self.refresh, absmax, self.offset,
                                 head, new_age)
            encode_cuda[one_thread_each(n)](g, r, ef, codes, scales, block, *self._dev, flag)
            self._flagged()
            bad = -1
        else:
            head, scales, codes = self._views(out, n)
            age = int(head[0])
            g = grad.reshape(n)
            r = residual.reshape(n) if ef else None
            if self.backend == "reference":
                v = g + r if ef else g.copy()
                scales_ref(v, scales, block, age, self.refresh, absmax, self.offset)
                bad = int(np.argmax(~np.isfinite(v))) // block if not np.isfinite(v).all() else -1
                if bad < 0:
                    encode_ref(v, r, codes, scales, block, self.table, self.mids)
            else:
                flags = np.zeros(nb, np.uint8)
                rr = r if ef else g
                if absmax and block <= CHUNK and not (1 <= age < self.refresh):
                    # a fresh abs-max of blocks a task holds whole: one read of memory
                    encode_fused_cpu(g, rr, ef, codes, scales, block, self.table, *self.buckets,
                                     flags)
                else:
                    scales_cpu(g, rr, ef, scales, block, age, self.refresh, absmax, self.offset)
                    entries, base = self._vspace_buckets(scales, n)
                    if entries.size:
                        vt = np.empty(self.table.size, np.float32)
                        _scaled_table(self.table, scales[0], vt)
                        encode_vspace_cpu(g, rr, ef, codes, vt, entries, base, flags)
                    else:
                        encode_cpu(g, rr, ef, codes, scales, block, self.table, *self.buckets,
                                   flags)
                bad = int(np.argmax(flags)) if flags.any() else -1
            head[0] = 1 if age < 1 or age >= self.refresh else age + 1
            out[4 + 4 * nb + n:] = 0  # padding bytes defined, so buffers compare equal
        if bad >= 0:
            raise self._fault(grad, residual, ef)

    def _fault(self, grad, residual, ef):
        """The error for a non-finite value, the exact column found on the host (error path
        only; the residuals were already overwritten, so the gradient's column if it has one)."""
        v = _host(grad)
        if np.isfinite(v).all() and ef:
            v = v + _host(residual)
        col = int(np.argmax(~np.isfinite(v).all(axis=1)))
        return nonfinite_error(f"{self.name}/{self.dtype}", grad.shape, col)

    def _vspace_buckets(self, scales, n):
        """`scale_buckets`' (entries, base) for one positive finite scale over at least
        VSPACE_MIN_VALUES values, else no entries (the float64 path)."""
        s = scales[0]
        if scales.size != 1 or n < VSPACE_MIN_VALUES or not 0.0 < s < np.inf:
            return np.empty(0, np.int32), 0
        return scale_buckets(scale_thresholds(self.mids, s))

    def _decode(self, packed, out, accumulate):
        self._check_decode(packed, out)
        n = out.size
        if n == 0:
            return
        block, nb = self._blocking(n)
        if self.backend == "cuda":
            _, scales, codes = self._views(as_device(packed), n)
            if self._dev is None:
                self._dev = cuda.to_device(self.table), cuda.to_device(self.mids)
            decode_cuda[one_thread_each(n)](codes, scales, self._dev[0],
                                            as_device(out).reshape(n), block, accumulate)
        else:
            _, scales, codes = self._views(packed, n)
            fn = decode_ref if self.backend == "reference" else decode_cpu
            fn(codes, scales, self.table, out.reshape(n), block, accumulate)

    def decode(self, packed, out):
        self._decode(packed, out, False)

    def decode_accumulate(self, packed, out):
        self._decode(packed, out, True)
