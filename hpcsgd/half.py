"""float16 and bfloat16 on every backend: the conversion intrinsics, and the whole-array kernels
of mixed precision and bf16 (docs/precision.md), each with its NumPy reference.

    round_half(src, dst)          dst = float32(float16(src)), round to nearest even
    round_bf16(src, dst)          dst = float32(bfloat16(src)), round to nearest even
    round_to(kind)                the one of the two for kind "float16" or "bfloat16"
    scale(x, s)                   x *= float32(s) in place (the loss scale)
    unscale(g, scale, rounding)   g = (rounded to `rounding` first, if any) * (1 / scale) in
                                  place; returns (non-finite values, max |g| after unscaling)
    widen(v), stored(a, v)        inside a CUDA kernel: a stored value as float32, and a
                                  float32 as array a stores it (uint16 a: bfloat16 bits)

Numba has no float16 type on the CPU, so the CPU kernels convert with LLVM's fptrunc/fpext to
`half`: the CPU's own instructions (F16C's vcvtps2ph/vcvtph2ps on x86, AVX2 and AVX-512
alike), vectorised, the same bits as NumPy's astype. CUDA kernels use the GPU's conversion.
Mixed precision stores its float16 values in float32 arrays that hold only float16 values
(the emulation of docs/precision.md): rounding in place is all a "store as float16" is.

bfloat16 is float32's upper 16 bits (8 exponent bits, 7 stored significand bits), so its
rounding is integer arithmetic on the float32 bits, the same on every CPU and GPU:
bits + 0x7FFF + (bit 16 of bits), low 16 bits cleared -- round to nearest even, carrying into
the exponent (float32's largest finite values round to Inf, as a real conversion does; Inf
stays Inf; subnormals round like any value, no flush to zero). A NaN keeps its sign and upper
payload with the quiet bit set (Intel's vcvtneps2bf16; the sum would turn a NaN whose payload
sits in the low half into Inf). One scalar function, bf16_round_bits, serves the CPU and CUDA
kernels; the NumPy reference is written apart, on whole arrays.
"""
import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic

from hpcsgd.bfloat16 import round_bf16_ref
from hpcsgd.codecs.common import f32_bits, f32_from_bits
from hpcsgd.device import fill, is_device, on_stream, one_thread_each
from hpcsgd.lazy_cuda import cuda, device_function

BLOCK = 256   # CUDA threads per block of the element-wise kernels here


@intrinsic
def half_bits(typingctx, v):
    """float32 -> the bits of float16(v), by the CPU's own conversion (LLVM fptrunc: F16C's
    vcvtps2ph on x86, fcvt on ARM; round to nearest even, as NumPy's; vectorised)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
    return types.uint16(types.float32), codegen


@intrinsic
def half_value(typingctx, bits):
    """The bits of a float16 -> its value as float32 (exact)."""
    def codegen(context, builder, sig, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


def _bf16_round_bits(b):
    """The bits b of a float32 -> the bits of float32(bfloat16(value)): round to nearest even
    by integer arithmetic (the carry of + 0x7FFF + lsb may reach the exponent: overflow to Inf
    as the real conversion); a NaN stays a NaN (quiet, sign and upper payload kept)."""
    if (b & 0x7FFFFFFF) > 0x7F800000:
        return (b | 0x00400000) & 0xFFFF0000
    return (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000


bf16_round_bits = njit(inline="always")(_bf16_round_bits)            # the CPU kernels'
_bf16_round_bits_cuda = cuda.jit(device=True)(_bf16_round_bits)      # the CUDA kernels'


# ---------------------------------------------------------------- CUDA loads and stores
# GPU ranks' 16-bit storage: float16 arrays (mixed) or uint16 arrays holding bfloat16 bits
# (bf16: NumPy and Numba have no bfloat16 dtype; float32's upper 16 bits are its layout).
# A kernel reads every stored value through widen (F in model/kernels_cuda.py) and writes
# through stored: chosen at compile time by the argument's Numba type (an overload for the
# CUDA target), by the value's NumPy type in the simulator, which runs kernels as Python.
def _is_bf16_bits(t):
    """A Numba type: uint16 (bfloat16 bits)?"""
    return getattr(t, "bitwidth", None) == 16 and getattr(t, "signed", True) is False \
        and not getattr(t, "ndim", 0)


def _widen_sim(v):
    if isinstance(v, np.uint16):   # bfloat16 bits: the float32 with them on top, exact
        return (np.uint32(v) << np.uint32(16)).view(np.float32)
    return np.float32(v)


def _stored_sim(a, v):
    if a.dtype == np.uint16:
        return np.uint16(_bf16_round_bits(int(np.float32(v).view(np.uint32))) >> 16)
    return v


def _make_widen(real):
    """widen(v): a stored value as float32 -- bfloat16 bits (uint16) shifted into float32's
    upper half and reinterpreted (exact); float16 or float32 (or a float64 scalar) by a
    conversion (none for float32)."""
    if real.config.ENABLE_CUDASIM:
        return _widen_sim
    from numba.cuda import types
    from numba.cuda.extending import intrinsic, overload

    @intrinsic
    def bf16_value(typingctx, bits):
        def codegen(context, builder, sig, args):
            i32 = ir.IntType(32)
            wide = builder.shl(builder.zext(args[0], i32), ir.Constant(i32, 16))
            return builder.bitcast(wide, ir.FloatType())
        return types.float32(types.uint16), codegen

    def widen(v):   # called from Python (not a kernel): the simulator's rule, the same
        return _widen_sim(v)

    @overload(widen, inline="always")
    def _widen(v):
        if _is_bf16_bits(v):
            return lambda v: bf16_value(v)
        return lambda v: np.float32(v)
    return widen


def _make_stored(real):
    """stored(a, v): the float32 v as the array a stores it -- bfloat16 bits by
    _bf16_round_bits (round to nearest even, NaN kept, overflow to Inf) for a uint16 array;
    v itself otherwise (a store into a float16 array rounds once to nearest even)."""
    if real.config.ENABLE_CUDASIM:
        return _stored_sim
    from numba.cuda import types
    from numba.cuda.extending import intrinsic, overload

    @intrinsic
    def f32_bits(typingctx, v):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    def stored(a, v):   # called from Python (not a kernel): the simulator's rule, the same
        return _stored_sim(a, v)

    @overload(stored, inline="always")
    def _stored(a, v):
        if _is_bf16_bits(getattr(a, "dtype", None)):
            return lambda a, v: np.uint16(_bf16_round_bits_cuda(f32_bits(np.float32(v))) >> 16)
        return lambda a, v: v
    return stored


widen, stored = device_function(_make_widen), device_function(_make_stored)


@njit(inline="always")
def bf16_round(v):
    """float32 -> float32(bfloat16(v)) (CPU kernels)."""
    # the bits as int32 (codecs.common's bitcasts) viewed as uint32 and back: bit-preserving
    return f32_from_bits(np.int32(bf16_round_bits(np.uint32(f32_bits(v)))))


# ---------------------------------------------------------------- NumPy references
# round_bf16_ref (imported above): hpcsgd/bfloat16.py, below hpcsgd/device.py's GEMM


def round_half_ref(src, dst):
    with np.errstate(over="ignore"):   # beyond float16's range: Inf, as the kernels give
        dst[...] = src.astype(np.float16).astype(np.float32)


def unscale_ref(g, scale, rounding):
    """rounding: None or False (none), "float16" or True, "bfloat16"."""
    kind = _kind(rounding)
    v = g
    if kind == "float16":
        with np.errstate(over="ignore"):
            v = g.astype(np.float16).astype(np.float32)
    elif kind == "bfloat16":
        v = np.empty_like(g)
        round_bf16_ref(g, v)
    g[...] = v * np.float32(1.0 / scale)
    finite = np.isfinite(g)
    return int((~finite).sum()), float(np.abs(g[finite]).max(initial=0.0))


# ---------------------------------------------------------------- Numba CPU
@njit(parallel=True, cache=True)
def round_half_cpu(src, dst):
    """dst = float32(float16(src)), flat float32 (dst may be src)."""
    for i in prange(src.size):
        dst[i] = half_value(half_bits(src[i]))


@njit(parallel=True, cache=True)
def round_bf16_cpu(src, dst):
    """dst = float32(bfloat16(src)), flat float32 (dst may be src)."""
    for i in prange(src.size):
        dst[i] = bf16_round(src[i])


CHUNK = 1 << 14   # values per task of unscale_cpu (its maxima and counts per task)
NONE, FLOAT16, BFLOAT16 = 0, 1, 2   # unscale's rounding modes (the kernels' argument)


@njit(parallel=True, cache=True)
def unscale_cpu(g, inv, mode):
    """g = (rounded by mode: NONE, FLOAT16, BFLOAT16) g * inv in place (flat float32); returns
    (non-finite count, max |finite g|). Per-task partial results, combined in order (max and
    counts are exact in any order). Branch-free loops (vectorised)."""
    n = g.size
    tasks = (n + CHUNK - 1) // CHUNK
    bad = np.zeros(tasks, np.int64)
    amax = np.zeros(tasks, np.float32)
    for t in prange(tasks):
        lo, hi = np.uint64(t * CHUNK), np.uint64(min(n, (t + 1) * CHUNK))
        nb, m = 0, np.float32(0.0)
        if mode == FLOAT16:
            for i in range(lo, hi):
                v = half_value(half_bits(g[i])) * inv
                g[i] = v
                ok = v - v == 0.0
                nb += not ok
                m = max(m, abs(v) if ok else np.float32(0.0))
        elif mode == BFLOAT16:
            for i in range(lo, hi):
                v = bf16_round(g[i]) * inv
                g[i] = v
                ok = v - v == 0.0
                nb += not ok
                m = max(m, abs(v) if ok else np.float32(0.0))
        else:
            for i in range(lo, hi):
                v = g[i] * inv
                g[i] = v
                ok = v - v == 0.0
                nb += not ok
                m = max(m, abs(v) if ok else np.float32(0.0))
        bad[t], amax[t] = nb, m
    return bad.sum(), amax.max() if tasks else np.float32(0.0)


# the float16 allreduce (hpcsgd/comm/exchange.py: Allreduce): to float16, a float32 sum of the
# K ranks' float16 pieces back to float16, and from float16; uint16 arrays hold the bits
@njit(parallel=True, cache=True)
def to_half_cpu(g, scale, out):
    """out[i] = bits of float16(g[i] * scale) (flat float32 g, uint16 out); returns the count
    of non-finite halves (an overflow)."""
    bad = 0
    for i in prange(g.size):
        h = half_bits(g[i] * scale)
        out[i] = h
        bad += (h & 0x7c00) == 0x7c00
    return bad


@njit(parallel=True, cache=True)
def sum_halves_cpu(parts, factor, out):
    """out[i] = bits of float16(factor * sum over k of parts[k, i]'s value): the K float16
    pieces (K, m) summed in float32 in rank order (a chunk in L1 at a time, each pass a
    unit-stride vector loop), then rounded once. Returns the count of non-finite halves."""
    k, m = parts.shape
    tasks = (m + CHUNK - 1) // CHUNK
    bad = np.zeros(tasks, np.int64)
    for t in prange(tasks):
        a, b = np.uint64(t * CHUNK), np.uint64(min(m, (t + 1) * CHUNK))
        acc = np.empty(CHUNK, np.float32)
        for i in range(a, b):
            acc[i - a] = half_value(parts[0, i])
        for r in range(1, k):
            for i in range(a, b):
                acc[i - a] += half_value(parts[r, i])
        nb = 0
        for i in range(a, b):
            h = half_bits(acc[i - a] * factor)
            out[i] = h
            nb += (h & 0x7c00) == 0x7c00
        bad[t] = nb
    return bad.sum()


@njit(parallel=True, cache=True)
def from_half_cpu(p, scale, out):
    """out[i] = float32 value of the half with bits p[i], times scale."""
    for i in prange(out.size):
        out[i] = half_value(p[i]) * scale


def sum_halves_ref(parts, factor):
    """NumPy reference of sum_halves_cpu: the float16 result (not its bits)."""
    with np.errstate(over="ignore", invalid="ignore"):   # Inf pieces give Inf or NaN sums
        acc = parts.view(np.float16)[0].astype(np.float32)
        for r in range(1, parts.shape[0]):
            acc += parts.view(np.float16)[r].astype(np.float32)
        return (acc * np.float32(factor)).astype(np.float16)


# ---------------------------------------------------------------- Numba CUDA
@cuda.jit
def _round_half_cuda(src, dst):
    i = cuda.grid(1)
    if i < src.size:
        dst[i] = np.float32(np.float16(src[i]))


@cuda.jit
def _round_bf16_cuda(src, dst):
    """On the float32 arrays' uint32 views: the same integer rule as the CPU's (bit-exact on
    any GPU; no bfloat16 type or intrinsic needed)."""
    i = cuda.grid(1)
    if i < src.size:
        dst[i] = _bf16_round_bits_cuda(src[i])


@cuda.jit
def _to_bf16_cuda(src, dst):
    """float32 src -> dst's bfloat16 bits (uint16 storage: stored's rule, the one above)."""
    i = cuda.grid(1)
    if i < src.size:
        dst[i] = stored(dst, src[i])


@cuda.jit
def _scale_cuda(x, s):
    """x *= s in float32: a 16-bit x (float16; uint16 bfloat16 bits, which a plain *= would
    multiply as integers) widened and rounded once to its format."""
    i = cuda.grid(1)
    if i < x.size:
        x[i] = stored(x, widen(x[i]) * s)


@cuda.jit
def _unscale_cuda(g, inv, half, stats):
    """stats[0] += non-finite values, stats[1] = max |finite g| (atomics; exact in any order)."""
    i = cuda.grid(1)
    if i >= g.size:
        return
    v = (np.float32(np.float16(g[i])) if half else g[i]) * inv
    g[i] = v
    if v - v == 0.0:
        cuda.atomic.max(stats, 1, abs(v))
    else:
        cuda.atomic.add(stats, 0, np.float32(1.0))


# ---------------------------------------------------------------- dispatch
def round_half(src, dst):
    """dst = float32(float16(src)) (C-contiguous float32 arrays of one size; dst may be src),
    on the host or the device; on the device dst may also be a float16 array (GPU ranks'
    float16 storage: the weight copy w16 and the input x16), which then holds float16(src)."""
    src, dst = src.reshape(-1), dst.reshape(-1)
    if is_device(src):
        if src.size:
            _round_half_cuda[on_stream(one_thread_each(src.size, BLOCK))](src, dst)
        return
    round_half_cpu(src, dst)


def round_bf16(src, dst):
    """dst = float32(bfloat16(src)) (C-contiguous float32 arrays of one size; dst may be src),
    on the host or the device; on the device dst may also be a uint16 array (GPU ranks'
    bfloat16 storage: w16 and x16), which then holds the bits of bfloat16(src)."""
    src, dst = src.reshape(-1), dst.reshape(-1)
    if is_device(src):
        if src.size and dst.dtype == np.uint16:
            _to_bf16_cuda[on_stream(one_thread_each(src.size, BLOCK))](src, dst)
        elif src.size:
            _round_bf16_cuda[on_stream(one_thread_each(src.size, BLOCK))](src.view(np.uint32),
                                                              dst.view(np.uint32))
        return
    round_bf16_cpu(src, dst)


ROUNDINGS = {"float16": round_half, "bfloat16": round_bf16}


def round_to(kind):
    """The rounding function of a 16-bit format: "float16" (round_half) or "bfloat16"."""
    try:
        return ROUNDINGS[kind]
    except KeyError:
        raise ValueError(f"rounding {kind!r}: expected one of {tuple(ROUNDINGS)}") from None


def _kind(rounding):
    """unscale's rounding argument -> None, "float16" or "bfloat16" (True: float16, as the
    boolean `half` of callers before bfloat16)."""
    if rounding is None or rounding is False:
        return None
    if rounding is True:
        return "float16"
    round_to(rounding)   # a name it knows
    return rounding


def scale(x, s):
    """x *= float32(s) in place (nothing for s = 1)."""
    if s == 1.0:
        return
    if is_device(x):
        flat = x.reshape(-1)
        if flat.size:
            _scale_cuda[on_stream(one_thread_each(flat.size, BLOCK))](flat, np.float32(s))
        return
    np.multiply(x, np.float32(s), out=x)


_STATS = []


def _unscale_stats():
    """unscale's two device counters, made once and zeroed by a launch at each call (no
    allocation per step)."""
    if not _STATS:
        _STATS.append(cuda.to_device(np.zeros(2, np.float32)))
    fill(_STATS[0], 0)
    return _STATS[0]


def unscale(g, scale, rounding=None):
    """Unscale a gradient in float32, in place: g = (g rounded to `rounding`: None, "float16"
    (or True), "bfloat16") / scale (as a multiplication by float32(1 / scale): exact for a
    power of two). Returns (non-finite values: int, max |g| over the finite ones: float), the
    overflow vote's inputs."""
    kind = _kind(rounding)
    inv = np.float32(1.0 / scale)
    if not math.isfinite(inv):
        raise ValueError(f"loss scale {scale!r}: 1 / scale is not a finite float32")
    if is_device(g):
        stats = _unscale_stats()
        if g.size:
            if kind == "bfloat16":   # its own pass: a CUDA kernel has no float32 <-> uint32 cast
                round_bf16(g, g)
            _unscale_cuda[on_stream(one_thread_each(g.size, BLOCK))](g, inv, kind == "float16",
                                                                      stats)
        bad, amax = stats.copy_to_host()   # device -> host: sync point
        return int(bad), float(amax)
    bad, amax = unscale_cpu(g, inv, {None: NONE, "float16": FLOAT16, "bfloat16": BFLOAT16}[kind])
    return int(bad), float(amax)
