"""The Conformer on GPU ranks: every CUDA twin of hpcsgd.model.kernels_conformer
(kernels_conformer_cuda) against the float64 reference and the CPU kernel, in float32 and in
16-bit storage (float16; bfloat16 as uint16 bits); the attention's batched products
(device.batched_matmul) in the simulator and their cublasGemmStridedBatchedEx call against a
stand-in for cuBLAS; a CTC Network with a Conv2d front end and a Conformer block on a GPU rank
against the same model on the CPU, in float32 (with dropout and an instance norm) and in
mixed precision and bf16 (and half.scale on 16-bit arrays, which the block's backward calls);
every new kernel compiled to PTX for sm_80 and sm_90. The CUDA tests run in
Numba's simulator in a child process (as tests/test_norm.py; on a real GPU with
HPCSGD_TEST_GPU=1).

Bounds (u = 2^-24, float32's unit roundoff; each kernel's float32 steps counted, the inputs
taken as exact: the references compute in float64 from the same float32 values):

- residual add x + s o (s = 1/2, 1: the product exact) and bias add: one rounding, u |y|; and
  the CPU's bits.
- sigmoid s = 1 / (1 + exp(-v)): CUDA's expf within 2 ulp (4u relative), the add and the
  division a rounding each: 6u relative. swish v s: 7u |y|, and v = z + b rounded first
  moves it by |swish'| <= 1.1 times u |v|: 8u |y| + 2u |v|. Its backward dy (s + (v s)(1 - s)):
  1 - s is off by at most 6u s + u (1 - s) absolutely, so (v s)(1 - s) by 16u |v|, the sum and
  the product by a rounding each: 20u |dy| (1 + |v|). GLU a s(g): 8u |a| + 0.25u |a||g| (g's
  rounding through s' <= 1/4); its backward: d s within 8u |d|, d a s (1 - s) within 12u |d a|.
- depthwise: the bias and K products each rounded, K adds: (K + 1) u sum|terms| (the
  standard bound for a recursive sum), and the CPU's bits (the same float32 operations in the
  same order, no FMA). Its input gradient likewise with K terms. The taps' and bias's
  gradients: each term a float32 product (u), float64 sums, one final rounding: 2u sum|terms|
  (+ the float64 sums' rows * 2^-52 sum|terms|).
- to_heads / from_heads: a c and b s each with the tables' rounding and their own (2u), the
  add, the scale's product and the scale's own rounding: 5u (|a| + |b|) scale; the CPU's bits
  (same tables, same operations).
- masked softmax: s_j - max rounded (u |s_j - max|, through exp a relative error), expf 4u,
  the float64 sum, 1 / sum and the product a rounding each: p u (10 + |s_j - max| + R), R the
  row's largest |s_j - max|. Its backward p (dp - d), d = sum p dp (float32 products, a
  float64 sum, one rounding): |p| u (2 sum|p dp| + 2 |dp - d|).
- unfold2d copies (exact); fold2d adds at most 4 taps in the CPU's order: the CPU's bits,
  3u sum|terms| from the float64 adjoint.

GPU and CPU are each within these of the exact value, so within twice of each other (the
CPU's exp, Cephes', within the same 2 ulp). 16-bit storage: loads widened, float32
arithmetic, one rounding at each store (kernels_cuda's convention), so a kernel's 16-bit
output is bit for bit its float32 output on the widened inputs, rounded once; its float32
outputs (the depthwise parameter gradients) equal the float32 run's.

The Network: the GPU's gradient and posteriors differ from the float64 model's (its CTC loss
in float32, as every model's) by float32 rounding propagated through the layers, as the float32
CPU model's do: conftest.assert_float32_close's argument, whole vectors, and per matrix with
a floor of 8u of the matrix's norm (a few roundings per value) for a CPU reference that lands
near the float64 one by chance. Mixed precision: the GPU's float16 storage against the CPU's
float32-buffer emulation, the same roundings at the same places, float32 sums in another order
and expf, each able to flip a float16 rounding (2^-11 relative): 2^-7 of each gradient's norm,
as tests/test_ctc_model_cuda.py; bf16 (2^-8 relative per rounding) 2^-4."""
import os

import numpy as np
import pytest

from conftest import assert_float32_close, ptx_compiler, run_cuda_tests_in_child
from hpcsgd.model import kernels_conformer as KF

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"
U = 2.0 ** -24
STORAGES = ("float32", "float16", "bfloat16")


def padded(rng, frames, width):
    """float32 time-major rows of utterances of these frames, garbage (not zeros) in the
    padding: a kernel must not read it."""
    return rng.standard_normal((frames[0] * len(frames), width)).astype(np.float32)


def valid_rows(frames):
    nb = len(frames)
    mask = np.zeros(frames[0] * nb, bool)
    for b, f in enumerate(frames):
        mask[np.arange(f) * nb + b] = True
    return mask


def a64(a):
    return np.asarray(a, np.float64)


if not CHILD:
    import ctypes
    import sys

    from hpcsgd import device
    from test_gemm_layout import (BF16, COMPUTE_32F, OP_N, R_16BF, R_16F, R_32F, HostArray,
                                  _column_major, bf16_of, fake_cublas, values)  # noqa: F401

    def test_conformer_cuda_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    BATCHED = []

    def gemm_strided_batched_ex(handle, transa, transb, m, n, k, alpha, A, atype, lda, sa, B,
                                btype, ldb, sb, beta, C, ctype, ldc, sc, count, compute, algo):
        """C_i (m x n) = alpha op(A_i) op(B_i) + beta C_i, column-major, the i-th matrices
        s_a, s_b, s_c elements after the first, as cuBLAS defines it."""
        BATCHED.append((atype, btype, ctype, compute, count))
        assert compute == COMPUTE_32F and atype == btype
        dt = {R_16F: np.float16, R_32F: np.float32, R_16BF: BF16}
        alpha = np.frombuffer((ctypes.c_float * 1).from_address(alpha), np.float32)[0]
        beta = np.frombuffer((ctypes.c_float * 1).from_address(beta), np.float32)[0]
        for i in range(count):
            size = {t: np.dtype(dt[t]).itemsize for t in dt}
            a = _column_major(A + i * sa * size[atype], dt[atype],
                              *((m, k) if transa == OP_N else (k, m)), lda)
            b = _column_major(B + i * sb * size[btype], dt[btype],
                              *((k, n) if transb == OP_N else (n, k)), ldb)
            c = _column_major(C + i * sc * size[ctype], dt[ctype], m, n, ldc)
            opa = values(a) if transa == OP_N else values(a).T
            opb = values(b) if transb == OP_N else values(b).T
            result = alpha * (opa @ opb) + beta * values(c)
            c[...] = bf16_of(result) if c.dtype == BF16 else result.astype(c.dtype)

    @pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
    @pytest.mark.parametrize("dtype,out_dtype", [(np.float32, np.float32),
                                                 (np.float16, np.float16), (BF16, BF16),
                                                 (np.float16, np.float32)])
    def test_batched_gemm_calls_cublas_strided_batched(fake_cublas, trans_a, trans_b, dtype,
                                                       out_dtype):
        """(2, 3) stacks of products, as the attention's (utterance, head) blocks: one call,
        each matrix at its stride, the row-major stacks as cuBLAS's column-major
        transposes."""
        sys.modules["cupy_backends.cuda.libs"].cublas.gemmStridedBatchedEx = \
            gemm_strided_batched_ex
        BATCHED.clear()
        rng = np.random.default_rng(0)
        n, k, m = 4, 6, 5

        def draw(shape, dt):
            v = rng.standard_normal(shape)
            return bf16_of(v) if dt == BF16 else v.astype(dt)
        a = draw((2, 3) + ((k, n) if trans_a else (n, k)), dtype)
        b = draw((2, 3) + ((m, k) if trans_b else (k, m)), dtype)
        out = draw((2, 3, n, m), out_dtype)
        device.gemm_strided_batched(HostArray(a), HostArray(b), HostArray(out), trans_a,
                                    trans_b)
        want = np.matmul(np.swapaxes(values(a), -1, -2) if trans_a else values(a),
                         np.swapaxes(values(b), -1, -2) if trans_b else values(b))
        want = bf16_of(want) if out_dtype == BF16 else want.astype(out_dtype)
        np.testing.assert_array_equal(out, want)
        ab = {np.float16: R_16F, np.float32: R_32F, BF16: R_16BF}
        assert BATCHED == [(ab[dtype], ab[dtype], ab[out_dtype], COMPUTE_32F, 6)]
        assert fake_cublas == []   # no gemmEx: one strided-batched call

    def test_batched_gemm_refuses_a_strided_stack(fake_cublas):
        a = np.zeros((2, 4, 6), np.float32)[:, :, ::2]
        b = np.zeros((2, 3, 2), np.float32)
        with pytest.raises(ValueError, match="C-contiguous stack"):
            device.gemm_strided_batched(HostArray(a), HostArray(b),
                                        HostArray(np.zeros((2, 4, 2), np.float32)))

    def test_conformer_kernels_compile_for_sm80_and_sm90(monkeypatch):
        """NVVM compiles every kernel of kernels_conformer_cuda with float32, float16 and
        bfloat16 (uint16) arrays (the depthwise parameter gradients and the rotary tables
        float32); ptxas reports no spills. The kernels that promise the CPU's bits (no exp,
        no float64 sum) have no FMA in their PTX (device.mul_rn)."""
        cuda, types, bench_cuda = ptx_compiler(monkeypatch)
        from hpcsgd.model import kernels_conformer_cuda as KFC
        i64, I = types.Array(types.int64, 1, "C"), types.int64
        f2 = types.Array(types.float32, 2, "C")
        sigs = []
        for dt in (types.float32, types.float16, types.uint16):
            x2, x4 = types.Array(dt, 2, "C"), types.Array(dt, 4, "C")
            sigs += [(KFC._add_scaled_kernel, (x2, x2, types.float32, x2), True),
                     (KFC._add_bias_kernel, (x2, x2), True),
                     (KFC._swish_kernel, (x2, x2), False),
                     (KFC._bias_swish_kernel, (x2, x2, x2), False),
                     (KFC._swish_backward_kernel, (x2, x2, x2), False),
                     (KFC._bias_glu_kernel, (x2, x2, x2), False),
                     (KFC._glu_backward_kernel, (x2, x2, x2), False),
                     (KFC._depthwise_kernel, (x2, x2, x2, x2, I, i64, I), True),
                     (KFC._depthwise_dx_kernel, (x2, x2, x2, I, i64, I), True),
                     (KFC._depthwise_grad_kernel, (x2, x2, I, i64, I, f2, f2), False),
                     (KFC._to_heads_kernel, (x2, I, x4, I, i64, f2, f2, types.boolean,
                                             types.float32), True),
                     (KFC._from_heads_kernel, (x4, x2, I, I, i64, f2, f2, types.boolean,
                                               types.float32), True),
                     (KFC._masked_softmax_kernel, (x4, x4, i64), False),
                     (KFC._masked_softmax_backward_kernel, (x4, x4, x4, i64), False),
                     (KFC._unfold2d_kernel, (x2, x2, I, I, I, I, I, I), True),
                     (KFC._fold2d_kernel, (x2, x2, I, I, I, I, I, I), True)]
        for cc in (80, 90):
            monkeypatch.setattr(bench_cuda._Target, "compute_capability", divmod(cc, 10))
            for kernel, sig, exact in sigs:
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=divmod(cc, 10))
                rep = bench_cuda.ptxas_report(ptx, cc)
                name = kernel.py_func.__name__
                assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (cc, name, sig, rep)
                if exact:
                    assert "fma.rn.f32" not in ptx, (cc, name, sig)

else:
    from numba import cuda

    from hpcsgd import device
    from hpcsgd.bfloat16 import bits as bf16_bits
    from hpcsgd.bfloat16 import values as bf16_values
    from hpcsgd.model import kernels_conformer_cuda as KFC
    from hpcsgd.model.lengths import Lengths
    from hpcsgd.model.ops import CpuOps, CudaOps

    STORAGE_OF = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16",
                  np.dtype(np.uint16): "bfloat16"}

    def to16(a, storage):
        """a's values (rounded to float32 first) in the storage's array: float32 kept,
        float16, bfloat16 bits."""
        a = np.asarray(a, np.float32)
        if storage == "float32":
            return a
        return a.astype(np.float16) if storage == "float16" else bf16_bits(a)

    def widened(a):
        """A stored array's values as float32 (exact)."""
        return bf16_values(a) if a.dtype == np.uint16 else a.astype(np.float32)

    def rounded(a, storage):
        """float32 results as the storage's array stores them (one rounding)."""
        return to16(a, storage)

    def dev(*arrays):
        return [cuda.to_device(np.ascontiguousarray(a)) for a in arrays]

    def nan_like(shape, dtype):
        """A device array full of NaN (its bits 0xFFFF for 16-bit): what a kernel leaves
        unwritten shows."""
        return cuda.to_device(to16(np.full(shape, np.nan), STORAGE_OF[np.dtype(dtype)]))

    def host(*arrays):
        return [a.copy_to_host() for a in arrays]

    # ---- element-wise ---------------------------------------------------------------------

    def elementwise(z, b, dy, du, zg):
        """Every element-wise kernel's outputs on the device, from arrays of one storage
        dtype: z (R, 2M), b (1, 2M), dy (R, 2M), du (R, M), zg (R, 2M) the GLU's input of
        its backward."""
        n, m2 = z.shape
        out = {}
        pre, y = dev(z)[0], nan_like(z.shape, z.dtype)
        KFC.bias_swish(pre, dev(b)[0], y)
        out["pre"], out["swish_b"] = host(pre, y)
        y = nan_like(z.shape, z.dtype)
        KFC.swish_forward(dev(z)[0], y)
        out["swish"] = y.copy_to_host()
        d = dev(dy)[0]
        KFC.swish_backward(dev(z)[0], d, d)                  # in place
        out["dswish"] = d.copy_to_host()
        g, u = dev(z)[0], nan_like((n, m2 // 2), z.dtype)
        KFC.bias_glu(g, dev(b)[0], u)
        out["glu_pre"], out["glu"] = host(g, u)
        g = dev(zg)[0]
        KFC.glu_backward(g, dev(du)[0], g)                   # in place
        out["dglu"] = g.copy_to_host()
        x = dev(dy)[0]
        KFC.add_scaled(x, dev(z)[0], 0.5, x)                 # out is x
        out["res"] = x.copy_to_host()
        x = dev(z)[0]
        KFC.add_bias(x, dev(b)[0])
        out["bias"] = x.copy_to_host()
        return out

    def elementwise_case(seed, n=9, m=20):
        """35 columns would need two warps; 2M = 40 here: one full warp and a partial one."""
        rng = np.random.default_rng(seed)
        z = (3 * rng.standard_normal((n, 2 * m))).astype(np.float32)
        z[0, :4] = [30, -30, 0, 1e-3]   # saturated sigmoids, a zero
        b = rng.standard_normal((1, 2 * m)).astype(np.float32)
        dy = rng.standard_normal((n, 2 * m)).astype(np.float32)
        du = rng.standard_normal((n, m)).astype(np.float32)
        zg = (3 * rng.standard_normal((n, 2 * m))).astype(np.float32)
        return z, b, dy, du, zg

    def test_elementwise_kernels_match_the_reference_and_the_cpu():
        z, b, dy, du, zg = elementwise_case(0)
        got = elementwise(z, b, dy, du, zg)
        m = z.shape[1] // 2
        v = a64(z) + a64(b)
        v32 = z + b                                          # the float32 sum the kernels keep
        # the CPU kernels (float32)
        pre, y = z.copy(), np.empty_like(z)
        KF.bias_swish(pre, b, y)
        ys = np.empty_like(z)
        KF.swish_forward(z, ys)
        dsw = dy.copy()
        KF.swish_backward(z, dsw, dsw)
        gp, gu = z.copy(), np.empty((len(z), m), np.float32)
        KF.bias_glu(gp, b, gu)
        dg = zg.copy()
        KF.glu_backward(dg, du, dg)
        res = np.empty_like(z)
        KF.add_scaled(dy, z, np.float32(0.5), res)
        bias = z.copy()
        KF.add_bias(bias, b)
        np.testing.assert_array_equal(got["pre"], pre)
        np.testing.assert_array_equal(got["glu_pre"], gp)
        np.testing.assert_array_equal(got["res"], res)
        np.testing.assert_array_equal(got["bias"], bias)
        exact = a64(dy) + 0.5 * a64(z)
        assert np.all(np.abs(got["res"] - exact) <= U * np.abs(exact))
        assert np.all(np.abs(got["bias"] - v) <= U * np.abs(v))
        checks = [
            (got["swish_b"], y, KF.ref_swish(v), 8 * U * np.abs(KF.ref_swish(v))
             + 2 * U * np.abs(v)),
            (got["swish"], ys, KF.ref_swish(z), 8 * U * np.abs(KF.ref_swish(z))
             + 2 * U * np.abs(z)),
            (got["dswish"], dsw, KF.ref_swish_backward(z, dy),
             20 * U * np.abs(dy) * (1 + np.abs(z))),
            (got["glu"], gu, KF.ref_glu(v), U * np.abs(v32[:, :m]) * (8 + np.abs(v32[:, m:]))),
            (got["dglu"], dg, KF.ref_glu_backward(zg, du),
             np.concatenate([8 * U * np.abs(du), 12 * U * np.abs(du * zg[:, :m])], axis=1))]
        for name, (gpu, cpu, ref, tol) in zip(("swish_b", "swish", "dswish", "glu", "dglu"),
                                              checks):
            assert np.all(np.abs(gpu - ref) <= tol), name
            assert np.all(np.abs(gpu - cpu) <= 2 * tol), name

    @pytest.mark.parametrize("storage", ["float16", "bfloat16"])
    def test_elementwise_16bit_storage_is_the_float32_result_rounded_once(storage):
        args16 = [to16(a, storage) for a in elementwise_case(1)]
        got16 = elementwise(*args16)
        got32 = elementwise(*[widened(a) for a in args16])
        for name in got32:
            np.testing.assert_array_equal(got16[name], rounded(got32[name], storage),
                                          err_msg=name)

    # ---- depthwise convolution ------------------------------------------------------------

    FRAMES = [9, 7, 2, 1]

    def depthwise(x, w, b, dy, frames, left):
        nb = len(frames)
        lengths = cuda.to_device(np.array(frames, np.int64))
        dx_, dw, db, ddy = dev(x, w, b, dy)
        y = nan_like(x.shape, x.dtype)
        KFC.depthwise_forward(dx_, dw, db, y, nb, lengths, left)
        dx = nan_like(x.shape, x.dtype)
        gw = cuda.to_device(np.full(w.shape, np.nan, np.float32))
        gb = cuda.to_device(np.full(b.shape, np.nan, np.float32))
        KFC.depthwise_backward(dx_, ddy, dw, dx, gw, gb, nb, lengths, left)
        return host(y, dx, gw, gb)

    def depthwise_case(seed, m=37, kernel=5):
        rng = np.random.default_rng(seed)
        x = padded(rng, FRAMES, m)
        dy = padded(rng, FRAMES, m)
        w = rng.standard_normal((kernel, m)).astype(np.float32)
        b = rng.standard_normal((1, m)).astype(np.float32)
        return x, w, b, dy

    @pytest.mark.parametrize("kernel,left", [(5, 2), (3, 1)])
    def test_depthwise_matches_the_reference_and_the_cpu(kernel, left):
        """37 channels: more than a column tile (32); a one-step utterance; garbage in the
        padding, which neither pass reads."""
        x, w, b, dy = depthwise_case(2, kernel=kernel)
        nb, lengths = len(FRAMES), np.array(FRAMES)
        y, dx, gw, gb = depthwise(x, w, b, dy, FRAMES, left)
        yc, dxc = np.empty_like(x), np.empty_like(x)
        gwc, gbc = np.empty_like(w), np.empty_like(b)
        KF.depthwise_forward(x, w, b, yc, nb, lengths, left)
        KF.depthwise_backward(x, dy, w, dxc, gwc, gbc, nb, lengths, left,
                              np.empty((16, kernel + 1, x.shape[1])))
        np.testing.assert_array_equal(y, yc)       # the same float32 operations in order
        np.testing.assert_array_equal(dx, dxc)
        pad = ~valid_rows(FRAMES)
        assert not y[pad].any() and not dx[pad].any()
        ok = valid_rows(FRAMES)
        xa = np.where(ok[:, None], np.abs(x), 0)
        mag_y = KF.ref_depthwise(xa, np.abs(w), np.abs(b), nb, FRAMES, left)
        assert np.all(np.abs(y - KF.ref_depthwise(x, w, b, nb, FRAMES, left))
                      <= (kernel + 1) * U * mag_y)
        ref = KF.ref_depthwise_backward(x, dy, w, nb, FRAMES, left)
        mag = KF.ref_depthwise_backward(xa, np.where(ok[:, None], np.abs(dy), 0), np.abs(w),
                                        nb, FRAMES, left)
        rows = len(x)
        tols = (kernel * U * mag[0], (2 * U + rows * 2.0 ** -52) * mag[1],
                (2 * U + rows * 2.0 ** -52) * mag[2])
        for got, cpu, want, tol in zip((dx, gw, gb), (dxc, gwc, gbc), ref, tols):
            assert np.all(np.abs(got - want) <= tol)
            assert np.all(np.abs(got - cpu) <= 2 * tol)

    @pytest.mark.parametrize("storage", ["float16", "bfloat16"])
    def test_depthwise_16bit_storage_is_the_float32_result_rounded_once(storage):
        x, w, b, dy = (to16(a, storage) for a in depthwise_case(3, m=12))
        got16 = depthwise(x, w, b, dy, FRAMES, 2)
        got32 = depthwise(*(widened(a) for a in (x, w, b, dy)), FRAMES, 2)
        for a16, a32 in zip(got16[:2], got32[:2]):
            np.testing.assert_array_equal(a16, rounded(a32, storage))
        for a16, a32 in zip(got16[2:], got32[2:]):   # the float32 parameter gradients
            np.testing.assert_array_equal(a16, a32)

    # ---- attention --------------------------------------------------------------------------

    HEADS, DK = 2, 6
    ATT_FRAMES = [7, 5, 5, 1]

    def attention(qkv, blocks, s, dp, frames, p_back=None):
        """to_heads (q: rotary and scaled, v: plain), from_heads (rotary and scaled, plain),
        the masked softmax of s and its backward (in place, as the layer calls them) from
        its own p or from p_back."""
        lengths = Lengths(frames)
        ops = CudaOps(8, 8, np.float32)
        nb, steps, d = len(frames), frames[0], HEADS * DK
        dt = qkv.dtype
        out = {}
        src = dev(qkv)[0]
        for name, col, rotate, scale in (("q", 0, True, 1 / np.sqrt(DK)), ("v", 2 * d, False,
                                                                           1.0)):
            h = nan_like((nb, HEADS, steps, DK), dt)
            ops.to_heads(src, col, h, lengths, rotate, scale)
            out[name] = h.copy_to_host()
        blk = dev(blocks)[0]
        for name, rotate, scale in (("back_rot", True, 0.7), ("back", False, 1.0)):
            dst = cuda.to_device(to16(np.full((steps * nb, 3 * d), 7.0), STORAGE_OF[dt]))
            ops.from_heads(blk, dst, d, lengths, rotate, scale)
            out[name] = dst.copy_to_host()
        p = dev(s)[0]
        ops.masked_softmax(p, p, lengths)
        out["p"] = p.copy_to_host()
        d_dp = dev(dp)[0]
        if p_back is not None:
            p = dev(p_back)[0]
        ops.masked_softmax_backward(p, d_dp, d_dp, lengths)
        out["ds"] = d_dp.copy_to_host()
        return out

    def attention_case(seed):
        rng = np.random.default_rng(seed)
        nb, steps, d = len(ATT_FRAMES), ATT_FRAMES[0], HEADS * DK
        qkv = padded(rng, ATT_FRAMES, 3 * d)
        blocks = rng.standard_normal((nb, HEADS, steps, DK)).astype(np.float32)
        s = (3 * rng.standard_normal((nb, HEADS, steps, steps))).astype(np.float32)
        dp = rng.standard_normal(s.shape).astype(np.float32)
        return qkv, blocks, s, dp

    def cpu_attention(qkv, blocks, s, dp, frames, dtype):
        """The CPU kernels' outputs on the same arrays in dtype (float64: the reference, its
        rotary tables rounded from float64 once, as the kernels' float32 ones)."""
        lengths = Lengths(frames)
        ops = CpuOps(8, 8, dtype)
        nb, steps, d = len(frames), frames[0], HEADS * DK
        qkv, blocks, s, dp = (np.asarray(a, dtype) for a in (qkv, blocks, s, dp))
        out = {}
        for name, col, rotate, scale in (("q", 0, True, 1 / np.sqrt(DK)), ("v", 2 * d, False,
                                                                           1.0)):
            h = np.empty((nb, HEADS, steps, DK), dtype)
            ops.to_heads(qkv, col, h, lengths, rotate, scale)
            out[name] = h
        for name, rotate, scale in (("back_rot", True, 0.7), ("back", False, 1.0)):
            dst = np.full((steps * nb, 3 * d), 7, dtype)
            ops.from_heads(blocks, dst, d, lengths, rotate, scale)
            out[name] = dst
        p = s.copy()
        ops.masked_softmax(p, p, lengths)
        out["p"] = p
        ds = dp.copy()
        ops.masked_softmax_backward(p, ds, ds, lengths)
        out["ds"] = ds
        return out

    def test_attention_kernels_match_the_reference_and_the_cpu():
        """Utterances of 7, 5, 5 and 1 steps, 2 heads of 6: the copies and rotations give
        the CPU's bits, the softmax and its backward its values within the bounds; padding
        rows and keys 0, the destination's other columns untouched."""
        qkv, blocks, s, dp = attention_case(4)
        got = attention(qkv, blocks, s, dp, ATT_FRAMES)
        cpu = cpu_attention(qkv, blocks, s, dp, ATT_FRAMES, np.float32)
        ref = cpu_attention(qkv, blocks, s, dp, ATT_FRAMES, np.float64)
        for name in ("q", "v", "back_rot", "back"):
            np.testing.assert_array_equal(got[name], cpu[name], err_msg=name)
        # magnitudes: the same kernels on |a| with |cos|, |sin| bound |a c| + |b s|
        d = HEADS * DK
        lengths = Lengths(ATT_FRAMES)
        ops = CpuOps(8, 8, np.float64)
        cos, sin = ops.rope(ATT_FRAMES[0], DK, np.float64)
        mag_q = np.empty_like(ref["q"])
        KF.to_heads(np.abs(a64(qkv)), 0, mag_q, lengths.nb, HEADS, lengths.lengths,
                    np.abs(cos), np.abs(sin), False, 1.0)
        half = DK // 2
        pair = mag_q + np.concatenate([mag_q[..., half:], mag_q[..., :half]], axis=-1)
        assert np.all(np.abs(got["q"] - ref["q"]) <= 5 * U * pair / np.sqrt(DK))
        assert np.all(np.abs(got["v"] - ref["v"]) <= U * np.abs(ref["v"]))
        mag_b = np.empty((len(qkv), d))
        KF.from_heads(np.abs(a64(blocks)), mag_b, 0, lengths.nb, lengths.lengths, cos, sin,
                      False, 1.0)
        pair_b = mag_b + np.concatenate(
            [np.concatenate([mag_b[:, h * DK + half:(h + 1) * DK], mag_b[:, h * DK:h * DK + half]],
                            axis=1) for h in range(HEADS)], axis=1)
        assert np.all(np.abs(got["back_rot"][:, d:2 * d] - ref["back_rot"][:, d:2 * d])
                      <= 5 * U * 0.7 * pair_b)
        for name in ("back_rot", "back"):
            keep = np.ones(3 * d, bool)
            keep[d:2 * d] = False
            assert np.all(got[name][:, keep] == 7)
            assert not got[name][~valid_rows(ATT_FRAMES), d:2 * d].any()
        # the softmax: bounds from the float64 row's spread
        mask = np.zeros(s.shape, bool)
        for b, f in enumerate(ATT_FRAMES):
            mask[b, :, :f, :f] = True
        p64 = ref["p"]
        x = np.where(mask, a64(s), -np.inf)
        mx = x.max(-1, keepdims=True)
        spread = np.where(mask, np.abs(a64(s) - np.where(np.isfinite(mx), mx, 0)), 0)
        tol_p = U * p64 * (10 + spread + spread.max(-1, keepdims=True))
        assert np.all(np.abs(got["p"] - p64) <= tol_p)
        assert np.all(np.abs(got["p"] - cpu["p"]) <= 2 * tol_p)
        assert not got["p"][~mask].any() and not got["ds"][~mask].any()
        # the backward from the GPU's own p (the reference's formula in float64 on it)
        p = a64(got["p"])
        dpv = np.where(mask, a64(dp), 0)
        dot = (p * dpv).sum(-1, keepdims=True)
        want = np.where(mask, p * (dpv - dot), 0)
        tol_ds = U * np.abs(p) * (3 * np.abs(p * dpv).sum(-1, keepdims=True)
                                  + 2 * np.abs(dpv - dot))
        assert np.all(np.abs(got["ds"] - want) <= tol_ds)

    @pytest.mark.parametrize("storage", ["float16", "bfloat16"])
    def test_attention_16bit_storage_is_the_float32_result_rounded_once(storage):
        args16 = [to16(a, storage) for a in attention_case(5)]
        got16 = attention(*args16, ATT_FRAMES)
        # the backward from the 16-bit p, as the 16-bit run reads it
        got32 = attention(*(widened(a) for a in args16), ATT_FRAMES,
                          p_back=widened(got16["p"]))
        for name in got32:
            np.testing.assert_array_equal(got16[name], rounded(got32[name], storage),
                                          err_msg=name)

    @pytest.mark.parametrize("storage", STORAGES)
    @pytest.mark.parametrize("trans_a,trans_b", [(False, True), (False, False), (True, False)])
    def test_batched_matmul_in_the_simulator(storage, trans_a, trans_b):
        """The attention's three kinds of products on (2, 3) stacks: float32 the host's
        NumPy product (the CPU ranks' bits), 16-bit operands widened, float32 sums rounded
        once (as cuBLAS with CUBLAS_COMPUTE_32F)."""
        rng = np.random.default_rng(6)
        n, k, m = 5, 4, 5
        a = rng.standard_normal((2, 3) + ((k, n) if trans_a else (n, k))).astype(np.float32)
        b = rng.standard_normal((2, 3) + ((m, k) if trans_b else (k, m))).astype(np.float32)
        a, b = to16(a, storage), to16(b, storage)
        out = nan_like((2, 3, n, m), a.dtype)
        device.batched_matmul(*dev(a, b), out, trans_a=trans_a, trans_b=trans_b)
        wa, wb = widened(a), widened(b)
        want = np.empty((2, 3, n, m), np.float32)
        device.batched_matmul(wa, wb, want, trans_a=trans_a, trans_b=trans_b)   # the host's
        np.testing.assert_array_equal(out.copy_to_host(), rounded(want, storage))

    # ---- the subsampling front end ----------------------------------------------------------

    def test_unfold2d_and_fold2d_match_the_reference_and_the_cpu():
        rng = np.random.default_rng(7)
        frames, f_in, ch = [7, 6, 3], 5, 2
        nb, steps = len(frames), frames[0]
        x = padded(rng, frames, f_in * ch)
        x[~valid_rows(frames)] = 0   # unfold2d reads zeros there (the Network masks them)
        want, steps_out, f_out = KF.ref_unfold2d(x, nb, steps, f_in, ch)
        shape = (nb, steps, steps_out, f_in, f_out, ch)
        cols = nan_like(want.shape, np.float32)
        KFC.unfold2d(dev(x)[0], cols, *shape)
        np.testing.assert_array_equal(cols.copy_to_host(), want.astype(np.float32))
        dcols = rng.standard_normal(want.shape).astype(np.float32)
        dx = nan_like(x.shape, np.float32)
        KFC.fold2d(dev(dcols)[0], dx, *shape)
        cpu = np.empty_like(x)
        KF.fold2d(dcols, cpu, *shape)
        np.testing.assert_array_equal(dx.copy_to_host(), cpu)
        ref, mag = np.empty(x.shape), np.empty(x.shape)
        KF.fold2d(a64(dcols), ref, *shape)
        KF.fold2d(np.abs(a64(dcols)), mag, *shape)
        assert np.all(np.abs(dx.copy_to_host() - ref) <= 3 * U * mag)
        for storage in ("float16", "bfloat16"):   # a copy of the bits; one rounding
            x16, d16 = to16(x, storage), to16(dcols, storage)
            cols16 = nan_like(want.shape, x16.dtype)
            KFC.unfold2d(dev(x16)[0], cols16, *shape)
            np.testing.assert_array_equal(cols16.copy_to_host(),
                                          to16(KF.ref_unfold2d(widened(x16), nb, steps, f_in,
                                                               ch)[0], storage))
            dx16, dx32 = nan_like(x.shape, x16.dtype), nan_like(x.shape, np.float32)
            KFC.fold2d(dev(d16)[0], dx16, *shape)
            KFC.fold2d(dev(widened(d16))[0], dx32, *shape)
            np.testing.assert_array_equal(dx16.copy_to_host(),
                                          rounded(dx32.copy_to_host(), storage))

    # ---- a GPU Network with the Conformer's layers -------------------------------------------

    def network_batch(rng, lens, dim):
        from hpcsgd.data.utterances import Targets
        x = np.zeros((max(lens), len(lens), dim), np.float32)
        for b, n in enumerate(lens):
            x[:n, b] = rng.standard_normal((n, dim))
        ids = np.array([1, 2, 3, 1, 4][:2 * len(lens) - 1], np.int32)
        counts = [2] * (len(lens) - 1) + [1]
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return x.reshape(-1, dim), Targets(np.array(lens, np.int64), ids, offsets,
                                           np.arange(3, 3 + len(lens), dtype=np.uint64))

    def test_a_conformer_network_on_the_gpu_equals_the_cpu_one():
        """A CTC model over a Conv2d front end (2 channels, 5 features) and a Conformer block
        (width 8, 2 heads, feed-forward 12, 3 taps, the instance norm after its depthwise
        convolution; the layer norm there is the mixed precision test's) on utterances of
        13, 11 and 8 frames (4, 3 and 2 after subsampling), dropout 0.3 inside the block (the
        same masks from the same utterance keys): the GPU's loss, gradient and posteriors
        against the CPU's float32 and float64 models (the module docstring's bound). One
        pass each: the simulator runs a thread of every kernel in Python."""
        from hpcsgd.model.ctc import ctc
        enc, dropout = ["conv2d 2 8", "conformer 8 h2 f12 k3 in"], 0.3
        nets = {name: ctc(5, enc, 5, max_batch=64, dtype=dtype, device=dev_)
                for name, dtype, dev_ in (("gpu", np.float32, "cuda"),
                                          ("cpu", np.float32, "cpu"),
                                          ("cpu64", np.float64, "cpu"))}
        for net in nets.values():
            net.set_dropout(dropout)
        block = nets["gpu"].layers[1]
        assert block.device == "cuda" and block.storage == np.float32
        params = nets["cpu64"].new_params()
        nets["cpu64"].init(params, np.random.default_rng(0))
        p32 = nets["cpu"].new_params()
        p32.flat[...] = params.flat
        pg = nets["gpu"].new_params()
        pg.flat.copy_to_device(p32.flat)
        x, y = network_batch(np.random.default_rng(1), [13, 11, 8], 5)
        out = {}
        for name, p in (("gpu", pg), ("cpu", p32), ("cpu64", params)):
            net = nets[name]
            g = net.new_params()
            xs = x.astype(net.dtype)
            loss, tokens = net.forward_backward(p, g, xs, y, len(xs))
            assert tokens == len(y.ids)
            post = np.array(net.forward(p, xs, len(xs), lengths=y.frames), np.float64)
            grads = g.flat.copy_to_host() if name == "gpu" else g.flat.copy()
            out[name] = (loss, grads, post)
        assert block._att and all(device.is_device(a) for a in block._att.values())
        (lg, gg, pg_), (l32, g32, p32_), (l64, g64, p64_) = out["gpu"], out["cpu"], \
            out["cpu64"]
        assert np.all(np.isfinite(gg)) and np.abs(gg).max() > 0
        assert_float32_close([lg], [l32], [l64])
        assert_float32_close(gg, g32, g64)
        out_lengths = Lengths([13, 11, 8]).strided(2).strided(2)
        valid = valid_rows(out_lengths.lengths.tolist())
        assert_float32_close(pg_[valid], p32_[valid], p64_[valid])
        for m in params.matrices:
            sl = slice(m.offset, m.offset + m.size)
            noise = np.linalg.norm(g32[sl] - g64[sl]) + 8 * U * np.linalg.norm(g64[sl])
            assert np.linalg.norm(gg[sl] - g64[sl]) <= 10 * noise, m.name

    @pytest.mark.parametrize("precision", ["mixed", "bf16"])
    def test_16bit_conformer_on_the_gpu_equals_the_cpu_emulation(precision):
        """train.precision=mixed (a static loss scale of 256) and bf16: 16-bit arrays on the
        GPU (float16; uint16 bfloat16 bits; the attention's products among them), the
        float32-buffer emulation on the CPU. bfloat16 keeps 8 significand bits where float16
        keeps 11: the same argument gives 2^-4 of each gradient's norm."""
        from hpcsgd.model.ctc import ctc
        enc = ["conv2d 2 8", "conformer 8 h2 f12 k3"]
        cpu = ctc(5, enc, 5, max_batch=64, precision=precision)
        gpu = ctc(5, enc, 5, max_batch=64, device="cuda", precision=precision)
        assert gpu.layers[1].storage == (np.float16 if precision == "mixed" else np.uint16)
        bound = 2.0 ** -7 if precision == "mixed" else 2.0 ** -4
        scale = 256.0 if precision == "mixed" else 1.0
        params = cpu.new_params()
        cpu.init(params, np.random.default_rng(2))
        d_params = gpu.new_params()
        d_params.flat.copy_to_device(params.flat)
        x, y = network_batch(np.random.default_rng(3), [13, 11, 8], 5)
        g_cpu, g_gpu = cpu.new_params(), gpu.new_params()
        loss_cpu, _ = cpu.forward_backward(params, g_cpu, x, y, len(x), loss_scale=scale)
        loss_gpu, _ = gpu.forward_backward(d_params, g_gpu, x, y, len(x), loss_scale=scale)
        assert abs(loss_cpu - loss_gpu) <= bound * abs(loss_cpu)
        if precision == "mixed":
            cpu.unscale(g_cpu, scale)
            gpu.unscale(g_gpu, scale)
        got = g_gpu.flat.copy_to_host()
        assert np.all(np.isfinite(got))
        for m in g_cpu.matrices:
            want = g_cpu.flat[m.offset:m.offset + m.size]
            have = got[m.offset:m.offset + m.size]
            assert np.linalg.norm(have - want) <= bound * np.linalg.norm(want) + 1e-7, m.name

    @pytest.mark.parametrize("storage", ["float16", "bfloat16"])
    def test_scaling_a_16bit_gradient_scales_its_values(storage):
        """ops.scale (half.scale) on a 16-bit device array, as a Conformer's feed-forward
        backward halves its stored gradient: the values times s, rounded once."""
        from hpcsgd import half
        rng = np.random.default_rng(8)
        a = to16(rng.standard_normal((3, 5)) * 100, storage)
        d = dev(a)[0]
        half.scale(d, 0.5)
        np.testing.assert_array_equal(d.copy_to_host(), to16(widened(a) * np.float32(0.5),
                                                              storage))
        half.scale(d, 3.0)
        np.testing.assert_array_equal(d.copy_to_host(),
                                      to16(widened(a) * np.float32(0.5) * np.float32(3),
                                           storage))
