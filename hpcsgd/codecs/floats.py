"""float32 and float16 baselines behind the codec interface (what plain Allreduce/NCCL sends).

float32: packed = the float32 bytes of v = grad (+ residual, which is then zeroed): lossless.
float16: packed = float16(v) (round to nearest even on every backend); with error feedback
(default on when a residual is passed) residual <- v - float32(float16(v)).
|v| > 65504 overflows float16: reported as the same non-finite ValueError as NaN input.

Backends: "reference" is NumPy (astype(float16)); "cpu" is Numba, which has no float16 type on
the CPU, so its kernels build the half's bits from the float's bits with integer operations
(NumPy's own rounding) and decode them through a power-of-two table; "cuda"
uses the GPU's float16 conversion. All three give the same bits.
"""
import numpy as np
from numba import cuda, njit, prange

# value of a half with exponent field e (1..30) and significand n = 1024 + mantissa: n * 2^(e-25);
# e = 0 (subnormal): mantissa * 2^-24 = mantissa * POW2[1]
POW2 = np.array([2.0 ** (max(e, 1) - 25) for e in range(32)], np.float32)


@njit(inline="always")
def _to_half(v):
    """float32 v -> (the float16's bits, its value as float32), rounded to nearest even like
    a hardware conversion: NumPy's npy_floatbits_to_halfbits on the float's bits (integer
    operations only), the value through the power-of-two table."""
    f = np.uint32(np.float32(v).view(np.uint32))
    sign = np.uint32((f >> np.uint32(16)) & np.uint32(0x8000))
    f_exp = f & np.uint32(0x7f800000)
    f_sig = f & np.uint32(0x007fffff)
    if f_exp >= np.uint32(0x47800000):            # overflow, inf or NaN
        h = np.uint32(0x7e00) if (f_exp == np.uint32(0x7f800000) and f_sig) else np.uint32(0x7c00)
    elif f_exp <= np.uint32(0x38000000):          # subnormal half or signed zero
        if f_exp < np.uint32(0x33000000):
            h = np.uint32(0)
        else:
            e = f_exp >> np.uint32(23)
            sig = np.uint32(0x00800000) + f_sig
            sig >>= np.uint32(113) - e
            if (sig & np.uint32(0x3fff)) != np.uint32(0x1000) or (f & np.uint32(0x7ff)):
                sig += np.uint32(0x1000)
            h = sig >> np.uint32(13)
    else:
        h = (f_exp - np.uint32(0x38000000)) >> np.uint32(13)
        if (f_sig & np.uint32(0x3fff)) != np.uint32(0x1000):
            f_sig += np.uint32(0x1000)
        h += f_sig >> np.uint32(13)             # a carry into the exponent is right
    e = (h >> np.uint32(10)) & np.uint32(31)
    m = h & np.uint32(1023)
    if e == 31:
        value = np.float32(np.inf) if m == 0 else np.float32(np.nan)
    else:
        value = np.float32(m + (np.uint32(1024) if e else np.uint32(0))) * POW2[e]
    if sign:
        value = -value
    return sign | h, value


@njit(parallel=True, cache=True)
def _encode16_cpu(g, r, out, ef):
    """out[i] = bits of float16(v), v = g[i] (+ r[i], then r[i] = v - float16(v) with error
    feedback); flat float32 g, r and uint16 out. Returns the count of non-finite halves."""
    bad = 0
    for i in prange(g.size):
        v = g[i] + r[i] if ef else g[i]
        bits, value = _to_half(v)
        out[i] = bits
        if ef:
            r[i] = v - value   # exact (Sterbenz): the same bits as NumPy's
        if (bits & 0x7c00) == 0x7c00:
            bad += 1
    return bad


@njit(parallel=True, cache=True)
def _decode16_cpu(p, out, accumulate):
    """out[i] (+)= float32 value of the half with bits p[i]; flat uint16 p, float32 out."""
    for i in prange(out.size):
        h = p[i]
        e = (h >> 10) & 31
        m = h & 1023
        if e == 31:
            val = np.float32(np.inf) if m == 0 else np.float32(np.nan)
        else:
            val = np.float32(m + (1024 if e else 0)) * POW2[e]
        if h & 0x8000:
            val = -val
        if accumulate:
            out[i] += val
        else:
            out[i] = val

from hpcsgd.codecs.common import Codec, nonfinite_error
from hpcsgd.device import as_device


@njit(parallel=True, cache=True)
def _sum_cpu(g, r, out):
    """out = g + r, residual zeroed; per-column NaN flags (column index + 1 or 0)."""
    n_cols, n_rows = g.shape
    bad = np.zeros(n_cols, np.uint8)
    for c in prange(n_cols):
        for i in range(n_rows):
            v = g[c, i] + r[c, i]
            out[c, i] = v
            r[c, i] = 0.0
            if not v - v == 0.0:
                bad[c] = 1
    return bad


@cuda.jit
def _encode_cuda(g, r, out32, out16, half, ef):
    i = cuda.grid(1)
    if i >= g.size:
        return
    v = g[i] + r[i] if ef else g[i]
    if half:
        h = np.float16(v)
        out16[i] = h
        if ef:
            r[i] = v - np.float32(h)
    else:
        out32[i] = v
        if ef:
            r[i] = 0.0


@cuda.jit
def _decode_cuda(p32, p16, out, half, accumulate):
    i = cuda.grid(1)
    if i >= out.size:
        return
    val = np.float32(p16[i]) if half else p32[i]
    if accumulate:
        out[i] += val
    else:
        out[i] = val


@njit(parallel=True, cache=True)
def _decode32_cpu(p, out, accumulate):
    for c in prange(out.shape[0]):
        for i in range(out.shape[1]):
            if accumulate:
                out[c, i] += p[c, i]
            else:
                out[c, i] = p[c, i]


class Float(Codec):
    """float32 / float16 pass-through; error_feedback only matters for float16."""

    def __init__(self, backend="cpu", dtype="float32", error_feedback=True):
        super().__init__(backend)
        self.name = dtype
        self.half = dtype == "float16"
        self.error_feedback = bool(error_feedback)

    def packed_nbytes(self, n_cols, n_rows):
        n = n_cols * n_rows
        return 2 * (n + (n & 1)) if self.half else 4 * n  # float16 padded to 4 bytes

    def encode(self, grad, residual, out):
        self._check_encode(grad, residual, out)
        n = grad.size
        if n == 0:
            return
        ef = self.error_feedback and residual is not None
        if self.backend == "cuda":
            o = as_device(out)
            g = as_device(grad).reshape(n)
            r = as_device(residual).reshape(n) if ef else g
            p16 = o.view(np.float16)
            _encode_cuda[-(-n // 256), 256](g, r, o.view(np.float32) if not self.half else p16,
                                            p16, self.half, ef)
            chk = p16.copy_to_host()[:n] if self.half else o.view(np.float32).copy_to_host()
            bad = ~np.isfinite(chk)  # device sync + copy: baselines, not the fast path
        elif self.half and self.backend == "cpu":
            g = grad.reshape(n)
            halves = out.view(np.uint16)
            bad = _encode16_cpu(g, residual.reshape(n) if ef else g, halves[:n], ef)
            bad = ~np.isfinite(halves[:n].view(np.float16)) if bad else np.zeros(1, bool)
        elif self.half:
            v = grad + residual if ef else grad
            h = v.astype(np.float16)
            out.view(np.float16)[:n] = h.reshape(n)
            if ef:
                with np.errstate(invalid="ignore"):  # inf - inf: reported just below
                    np.subtract(v, h, out=residual)
            bad = ~np.isfinite(h)
        elif ef:
            bad = _sum_cpu(grad, residual, out.view(np.float32).reshape(grad.shape)) != 0
        else:
            out.view(np.float32)[:] = grad.reshape(n)
            bad = ~np.isfinite(grad)
        if self.half:
            out[2 * n:] = 0
        if bad.any():
            idx = int(np.argmax(bad.reshape(-1)))
            col = idx if bad.size == grad.shape[0] else idx // grad.shape[1]
            raise nonfinite_error(self.name, grad.shape, col)

    def _decode(self, packed, out, accumulate):
        self._check_decode(packed, out)
        n = out.size
        if n == 0:
            return
        if self.backend == "cuda":
            p = as_device(packed)
            p16 = p.view(np.float16)
            _decode_cuda[-(-n // 256), 256](p.view(np.float32) if not self.half else p16, p16,
                                            as_device(out).reshape(n), self.half, accumulate)
        elif self.half and self.backend == "cpu":
            _decode16_cpu(packed.view(np.uint16)[:n], out.reshape(n), accumulate)
        elif self.half:
            h = packed.view(np.float16)[:n].reshape(out.shape)
            if accumulate:
                out += h
            else:
                out[:] = h
        else:
            _decode32_cpu(packed.view(np.float32).reshape(out.shape), out, accumulate)

    def decode(self, packed, out):
        self._decode(packed, out, False)

    def decode_accumulate(self, packed, out):
        self._decode(packed, out, True)
