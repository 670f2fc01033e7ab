"""Layer normalization (hpcsgd.model.kernels_norm and its CUDA twin kernels_norm_cuda) against
the float64 NumPy reference; the CUDA kernels under Numba's simulator in a child process (as
tests/test_ctc_cuda.py; on a real GPU with HPCSGD_TEST_GPU=1) and compiled for sm_80 and
sm_90 by NVVM.

Bounds (u = 2^-24, float32's unit roundoff). Forward: the mean and variance are float64 sums
rounded once (relative error u), z - mean and its product with 1/std are rounded once each,
so xh is within 3u |xh| + u |mean| / std of the exact value; gamma * xh and + beta add a
rounding each: |y - exact| <= 8u (|gamma| (|xh| + |mean| / std) + |beta|) elementwise (ReLU is
1-Lipschitz, sigmoid 1/4-Lipschitz, plus its exp's 2 ulp: 4u y). Backward, with the same
activation mask as the kernel (the reference is given the kernel's y): g = gamma dh is rounded
once; its row means m1, m2 are float64 sums of float32 terms rounded once; dz = r (g - m1 -
xh m2) adds four roundings: |dz - exact| <= 16u r (|g| + mean|g| + (|xh| + a) mean(|g|(|xh| +
a))) with a = |mean| r (xh's absolute error term). The parameter sums: each term dh xh within
8u |dh| (|xh| + a), float64 sums, one final rounding. CPU and CUDA are each within these of
the exact value, so within twice of each other.
"""
import os

import numpy as np
import pytest

from conftest import ptx_compiler, run_cuda_tests_in_child
from hpcsgd.model import kernels_norm as KN
from hpcsgd.model.kernels import NCHUNK, RELU, SIGMOID

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"
U = 2.0 ** -24


def case(seed, n=37, m=23, dtype=np.float32):
    """Rows with an offset (the mean matters), a zero row (padding) and a constant row."""
    rng = np.random.default_rng(seed)
    z = (rng.standard_normal((n, m)) * 3 + 1.5).astype(dtype)
    z[5] = 0
    z[9] = 2.5
    gamma = (rng.standard_normal((1, m)) * 0.5 + 1).astype(dtype)
    beta = (rng.standard_normal((1, m)) * 0.5).astype(dtype)
    dy = rng.standard_normal((n, m)).astype(dtype)
    return z, gamma, beta, dy


def stats64(z):
    z = z.astype(np.float64)
    mean = z.mean(1, keepdims=True)
    r = 1 / np.sqrt(z.var(1, keepdims=True) + KN.EPS)
    return mean, r, (z - mean) * r


def forward_tol(z, gamma, beta, kind):
    mean, r, xh = stats64(z)
    tol = 8 * U * (np.abs(gamma) * (np.abs(xh) + np.abs(mean) * r) + np.abs(beta))
    return tol if kind == RELU else tol / 4 + 4 * U * KN.ref_layer_norm(z, gamma, beta, kind)


def backward_tols(z, gamma, y, dy, kind):
    """(dz, dgamma, dbeta) tolerances, the activation's derivative taken from y."""
    mean, r, xh = stats64(z)
    y, dy = y.astype(np.float64), dy.astype(np.float64)
    dh = dy * (y > 0) if kind == RELU else dy * y * (1 - y)
    g = np.abs(gamma * dh)
    a = np.abs(mean) * r
    t_dz = 16 * U * r * (g + g.mean(1, keepdims=True)
                         + (np.abs(xh) + a) * (g * (np.abs(xh) + a)).mean(1, keepdims=True))
    t_dg = 8 * U * (np.abs(dh) * (np.abs(xh) + a)).sum(0, keepdims=True)
    t_db = 4 * U * np.abs(dh).sum(0, keepdims=True)
    return t_dz, t_dg + U * np.abs((dh * xh).sum(0)), t_db + U * np.abs(dh.sum(0))


def ref_backward(z, gamma, beta, y, dy, kind):
    """The reference backward with the activation's derivative taken from y (the kernel's)."""
    mean, r, xh = stats64(z)
    y, dy = y.astype(np.float64), dy.astype(np.float64)
    dh = dy * (y > 0) if kind == RELU else dy * y * (1 - y)
    g = gamma.astype(np.float64) * dh
    dz = r * (g - g.mean(1, keepdims=True) - xh * (g * xh).mean(1, keepdims=True))
    return dz, (dh * xh).sum(0, keepdims=True), dh.sum(0, keepdims=True)


def cpu(z, gamma, beta, dy, kind):
    y = np.empty_like(z)
    KN.layer_norm_forward(z, gamma, beta, y, kind)
    dz = y.copy()
    gg, gb = np.empty_like(gamma), np.empty_like(beta)
    KN.layer_norm_backward(z, dz, dy, gamma, dz, gg, gb,
                           np.empty((2, NCHUNK, z.shape[1])), kind)   # dz written over y
    return y, dz, gg, gb


if not CHILD:
    @pytest.mark.parametrize("kind", [RELU, SIGMOID])
    def test_cpu_kernels_match_float64_reference_within_bound(kind):
        z, gamma, beta, dy = case(0)
        y, dz, gg, gb = cpu(z, gamma, beta, dy, kind)
        assert (np.abs(y - KN.ref_layer_norm(z, gamma, beta, kind))
                <= forward_tol(z, gamma, beta, kind)).all()
        ref = ref_backward(z, gamma, beta, y, dy, kind)
        for got, want, tol in zip((dz, gg, gb), ref, backward_tols(z, gamma, y, dy, kind)):
            assert (np.abs(got - want) <= tol).all()

    def test_float64_kernels_equal_reference():
        """float64 arrays: the same formulas, 1e-12 relative (the gradient checks' dtype)."""
        z, gamma, beta, dy = case(1, dtype=np.float64)
        y, dz, gg, gb = cpu(z, gamma, beta, dy, SIGMOID)
        np.testing.assert_allclose(y, KN.ref_layer_norm(z, gamma, beta, SIGMOID), rtol=1e-12)
        for got, want in zip((dz, gg, gb), KN.ref_layer_norm_backward(z, gamma, beta, dy,
                                                                      SIGMOID)):
            np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12)

    def test_zero_and_constant_rows_normalize_to_the_shift():
        """A padding row (zeros) or a constant one has variance 0: xh = 0, y = f(beta), and
        its gradient is finite (1/std = 1/sqrt(EPS))."""
        z, gamma, beta, dy = case(2)
        y, dz, _, _ = cpu(z, gamma, beta, dy, RELU)
        for row in (5, 9):
            np.testing.assert_array_equal(y[row], np.maximum(beta[0], 0))
        assert np.isfinite(dz).all()

    def test_bits_do_not_depend_on_threads():
        import numba
        z, gamma, beta, dy = case(3, n=301, m=64)
        out = []
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            try:
                out.append(cpu(z, gamma, beta, dy, RELU))
            finally:
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        for a, b in zip(*out):
            np.testing.assert_array_equal(a, b)

    def test_norm_cuda_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    def test_norm_kernels_compile_for_sm80_and_sm90(monkeypatch):
        """NVVM compiles the four kernels with float32, float16 and bfloat16 (uint16) arrays;
        ptxas reports no spills."""
        cuda, types, bench_cuda = ptx_compiler(monkeypatch)
        from hpcsgd.model import kernels_norm_cuda as KNC

        def a2(dt):
            return types.Array(dt, 2, "C")
        f32 = a2(types.float32)
        sigs = []
        for dt in (types.float32, types.float16, types.uint16):
            x = a2(dt)
            sigs += [(KNC._forward_kernel, (x, x, x, x, types.int64)),
                     (KNC._stats_kernel, (x, f32)),
                     (KNC._param_sums_kernel, (x, x, x, f32, f32, f32, types.int64)),
                     (KNC._backward_kernel, (x, x, x, x, f32, x, types.int64))]
        for cc in (80, 90):
            monkeypatch.setattr(bench_cuda._Target, "compute_capability", divmod(cc, 10))
            for kernel, sig in sigs:
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=divmod(cc, 10))
                rep = bench_cuda.ptxas_report(ptx, cc)
                assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (cc, sig, rep)

else:
    from numba import cuda

    from hpcsgd.bfloat16 import bits as bf16_bits
    from hpcsgd.bfloat16 import values as bf16_values
    from hpcsgd.model import kernels_norm_cuda as KNC

    def run_cuda(z, gamma, beta, dy, kind):
        dev = [cuda.to_device(a) for a in (z, gamma, beta, dy)]
        y = cuda.device_array_like(dev[0])
        KNC.layer_norm_forward(dev[0], dev[1], dev[2], y, kind)
        y_host = y.copy_to_host()
        gg = cuda.to_device(np.full(gamma.shape, np.nan, np.float32))
        gb = cuda.to_device(np.full(beta.shape, np.nan, np.float32))
        stats = cuda.to_device(np.zeros((len(z), 2), np.float32))
        KNC.layer_norm_backward(dev[0], y, dev[3], dev[1], y, gg, gb, stats, kind)  # dz over y
        return y_host, y.copy_to_host(), gg.copy_to_host(), gb.copy_to_host()

    @pytest.mark.parametrize("kind,m", [(RELU, 23), (SIGMOID, 23), (RELU, 300)])
    def test_float32_matches_reference_and_cpu(kind, m):
        """m = 300: more columns than a block's threads (strided), the column pass tiled."""
        z, gamma, beta, dy = case(4, n=19, m=m)
        y, dz, gg, gb = run_cuda(z, gamma, beta, dy, kind)
        tol_y = forward_tol(z, gamma, beta, kind)
        assert (np.abs(y - KN.ref_layer_norm(z, gamma, beta, kind)) <= tol_y).all()
        ref = ref_backward(z, gamma, beta, y, dy, kind)
        tols = backward_tols(z, gamma, y, dy, kind)
        for got, want, tol in zip((dz, gg, gb), ref, tols):
            assert (np.abs(got - want) <= tol).all()
        y_c, dz_c, gg_c, gb_c = cpu(z, gamma, beta, dy, kind)
        assert (np.abs(y - y_c) <= 2 * tol_y).all()
        if (y > 0).tolist() == (y_c > 0).tolist():   # the same activation mask
            for got, want, tol in zip((dz, gg, gb), (dz_c, gg_c, gb_c), tols):
                assert (np.abs(got - want) <= 2 * tol).all()

    def test_empty_batch_zeroes_the_parameter_gradients():
        z = np.zeros((0, 8), np.float32)
        gamma, beta = np.ones((1, 8), np.float32), np.zeros((1, 8), np.float32)
        _, _, gg, gb = run_cuda(z, gamma, beta, z.copy(), RELU)
        assert not gg.any() and not gb.any()

    @pytest.mark.parametrize("storage", ["float16", "bfloat16"])
    def test_16bit_storage_is_the_float32_result_rounded_once(storage):
        """16-bit arrays in, the same float32 arithmetic on their values, one rounding at the
        store: bit for bit the float32 kernel's output on the widened inputs, rounded."""
        z, gamma, beta, dy = case(5, n=11, m=40)
        if storage == "float16":
            to16, back = (lambda a: a.astype(np.float16)), (lambda a: a.astype(np.float32))
            rnd = to16
        else:
            to16, back, rnd = bf16_bits, bf16_values, bf16_bits
        args16 = [to16(a) for a in (z, gamma, beta, dy)]
        y16, dz16, gg16, gb16 = run_cuda(*args16, RELU)
        y32, dz32, gg32, gb32 = run_cuda(*[back(a) for a in args16], RELU)
        np.testing.assert_array_equal(y16, rnd(y32))
        np.testing.assert_array_equal(dz16, rnd(dz32))
        np.testing.assert_array_equal(gg16, gg32)   # float32 sums of the same values
        np.testing.assert_array_equal(gb16, gb32)
