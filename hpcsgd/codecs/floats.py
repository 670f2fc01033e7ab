"""float32 and float16 baselines behind the codec interface (what plain Allreduce/NCCL sends).

float32: packed = the float32 bytes of v = grad (+ residual, which is then zeroed): lossless.
float16: packed = float16(v) (round to nearest even on every backend); with error feedback
(default on when a residual is passed) residual <- v - float32(float16(v)).
|v| > 65504 overflows float16: reported as the same non-finite ValueError as NaN input.
float16 with a scale S (a power of two, `codec.scale`; the striped exchange sets the loss
scale of mixed precision): packed = float16(v * S) saturated to +-65504, decoded as
float32(half) / S, residual <- v - float32(half) / S (unscaled, so a change of S between
steps needs no rescaling; what saturation cut off is carried too). S = 1 is the plain codec.

Backends: "reference" is NumPy (astype(float16)); "cpu" is Numba, which has no float16 type on
the CPU, so its kernels convert with LLVM's fptrunc/fpext to `half` (the CPU's own conversion
instructions, F16C on x86: round to nearest even, as NumPy; vectorised, 4.4x faster than
rounding on the float's bits with integer operations); "cuda" uses the GPU's float16
conversion. All three give the same bits (tested at every half and every tie).
"""
import numpy as np
from numba import njit, prange

from hpcsgd.codecs.common import Codec, nonfinite_error
from hpcsgd.device import as_device, one_thread_each
from hpcsgd.half import half_bits as _half_bits, half_value as _half_value
from hpcsgd.lazy_cuda import cuda


@njit(parallel=True, cache=True)
def _encode16_cpu(g, r, out, ef):
    """out[i] = bits of float16(v), v = g[i] (+ r[i], then r[i] = v - float16(v) with error
    feedback); flat float32 g, r and uint16 out. Returns the count of non-finite halves.
    One loop per case: LLVM vectorises the conversion only without a branch inside."""
    bad = 0
    if ef:
        for i in prange(g.size):
            v = g[i] + r[i]
            h = _half_bits(v)
            out[i] = h
            r[i] = v - _half_value(h)   # exact (Sterbenz): the same bits as NumPy's
            bad += (h & 0x7c00) == 0x7c00
    else:
        for i in prange(g.size):
            h = _half_bits(g[i])
            out[i] = h
            bad += (h & 0x7c00) == 0x7c00
    return bad


HALF_MAX = np.float32(65504.0)


@njit(parallel=True, cache=True)
def _encode16_scaled_cpu(g, r, out, ef, s, inv_s):
    """_encode16_cpu of v * s (s a power of two), saturated to +-65504 (a non-finite v is
    still counted), the residual v - float16(v * s) / s."""
    bad = 0
    for i in prange(g.size):
        v = g[i] + r[i] if ef else g[i]
        h = _half_bits(min(max(v * s, -HALF_MAX), HALF_MAX))
        out[i] = h
        if ef:
            r[i] = v - _half_value(h) * inv_s
        bad += not v - v == 0.0
    return bad


@njit(parallel=True, cache=True)
def _decode16_scaled_cpu(p, out, accumulate, inv_s):
    if accumulate:
        for i in prange(out.size):
            out[i] += _half_value(p[i]) * inv_s
    else:
        for i in prange(out.size):
            out[i] = _half_value(p[i]) * inv_s


@njit(parallel=True, cache=True)
def _decode16_cpu(p, out, accumulate):
    """out[i] (+)= float32 value of the half with bits p[i]; flat uint16 p, float32 out."""
    if accumulate:
        for i in prange(out.size):
            out[i] += _half_value(p[i])
    else:
        for i in prange(out.size):
            out[i] = _half_value(p[i])


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
def _encode_cuda(g, r, out32, out16, half, ef, s, inv_s, bad):
    """s: the float16 scale (1: unscaled, unsaturated). bad[0] <- 1 + the index of a value
    that is not finite as sent (any one of them)."""
    i = cuda.grid(1)
    if i >= g.size:
        return
    v = g[i] + r[i] if ef else g[i]
    if half:
        x = v
        if s != 1:
            x = v * s
            x = min(max(x, np.float32(-65504.0)), np.float32(65504.0)) if v - v == 0 else x
        h = np.float16(x)
        out16[i] = h
        sent = np.float32(h)
        if ef:
            r[i] = v - sent * inv_s
    else:
        out32[i] = v
        sent = v
        if ef:
            r[i] = 0.0
    if not sent - sent == 0:
        bad[0] = i + 1


@cuda.jit
def _decode_cuda(p32, p16, out, half, accumulate, inv_s):
    i = cuda.grid(1)
    if i >= out.size:
        return
    val = np.float32(p16[i]) * inv_s if half else p32[i]
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

    def __init__(self, backend="cpu", dtype="float32", error_feedback=True, scale=1.0):
        super().__init__(backend)
        self.name = dtype
        self.half = dtype == "float16"
        self.error_feedback = bool(error_feedback)
        self.scale = scale   # float16: v * scale is sent (a power of two; see the docstring)

    def set_loss_scale(self, scale):
        if self.half:   # sent as v * scale: the loss scale's headroom on the wire too
            self.scale = scale

    def _scales(self):
        s = float(self.scale)
        if not (s > 0 and np.frexp(s)[0] == 0.5):
            raise ValueError(f"float16 codec: scale {s:g} is not a power of two")
        return np.float32(s), np.float32(1.0 / s)

    def packed_nbytes(self, n_cols, n_rows):
        n = n_cols * n_rows
        return 2 * (n + (n & 1)) if self.half else 4 * n  # float16 padded to 4 bytes

    def encode(self, grad, residual, out):
        self._check_encode(grad, residual, out)
        n = grad.size
        if n == 0:
            return
        ef = self.error_feedback and residual is not None
        s, inv_s = self._scales() if self.half else (np.float32(1), np.float32(1))
        if self.backend == "cuda":
            o = as_device(out)
            g = as_device(grad).reshape(n)
            r = as_device(residual).reshape(n) if ef else g
            p16 = o.view(np.float16)
            shape = grad.shape
            flag = self._device_flag(lambda v: nonfinite_error(self.name, shape,
                                                               (v - 1) // shape[1]))
            _encode_cuda[one_thread_each(n)](g, r, o.view(np.float32) if not self.half else p16,
                                             p16, self.half, ef, s, inv_s, flag)
            self._flagged()
            bad = np.zeros(1, bool)
        elif self.half and s != 1:
            # a non-finite v leaves a non-finite residual: that names it on the error path
            g = grad.reshape(n)
            if self.backend == "cpu":
                bad = _encode16_scaled_cpu(g, residual.reshape(n) if ef else g,
                                           out.view(np.uint16)[:n], ef, s, inv_s)
            else:
                v = g + residual.reshape(n) if ef else g
                with np.errstate(invalid="ignore"):
                    h = np.clip(v * s, -HALF_MAX, HALF_MAX).astype(np.float16)
                    out.view(np.float16)[:n] = h
                    if ef:
                        residual.reshape(n)[:] = v - h.astype(np.float32) * inv_s
                bad = int((~np.isfinite(v)).sum())
            bad = ~np.isfinite(residual if ef else grad) if bad else np.zeros(1, bool)
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
        inv_s = self._scales()[1] if self.half else np.float32(1)
        if self.backend == "cuda":
            p = as_device(packed)
            p16 = p.view(np.float16)
            _decode_cuda[one_thread_each(n)](p.view(np.float32) if not self.half else p16, p16,
                                             as_device(out).reshape(n), self.half, accumulate,
                                             inv_s)
        elif self.half and inv_s != 1:
            if self.backend == "cpu":
                _decode16_scaled_cpu(packed.view(np.uint16)[:n], out.reshape(n), accumulate,
                                     inv_s)
            else:
                h = packed.view(np.float16)[:n].reshape(out.shape).astype(np.float32) * inv_s
                if accumulate:
                    out += h
                else:
                    out[:] = h
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
