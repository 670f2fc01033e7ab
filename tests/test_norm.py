"""Layer and instance normalization (hpcsgd.model.kernels_norm and its CUDA twin
kernels_norm_cuda) against the float64 NumPy reference; the CUDA kernels under Numba's simulator in a child process (as
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
the exact value, so within twice of each other. Instance norm is the same algebra over a
sequence's steps instead of a row's channels: its bounds are the same formulas applied to
each sequence's valid rows transposed (in_tols). No activation (IDENTITY, the Conformer's
norms): ReLU's bounds (the identity is 1-Lipschitz, no exp) with dh = dy.
"""
import os

import numpy as np
import pytest

from conftest import ptx_compiler, run_cuda_tests_in_child
from hpcsgd.model import kernels_norm as KN
from hpcsgd.model.kernels import IDENTITY, NCHUNK, RELU, SIGMOID

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
    if kind in (RELU, IDENTITY):
        return tol
    return tol / 4 + 4 * U * KN.ref_layer_norm(z, gamma, beta, kind)


def dh_of(y, dy, kind):
    """dLoss/dh float64 from the kernel's y (the activation's derivative taken from it)."""
    y, dy = np.asarray(y, np.float64), np.asarray(dy, np.float64)
    if kind == IDENTITY:
        return dy
    return dy * (y > 0) if kind == RELU else dy * y * (1 - y)


def backward_tols(z, gamma, y, dy, kind):
    """(dz, dgamma, dbeta) tolerances, the activation's derivative taken from y."""
    mean, r, xh = stats64(z)
    dh = dh_of(y, dy, kind)
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
    dh = dh_of(y, dy, kind)
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


LENGTHS = np.array([9, 9, 6, 1, 0])   # equal, shorter, a single step (variance 0), empty


def seq_case(seed, m=23, lengths=LENGTHS, dtype=np.float32):
    """A time-major batch of len(lengths) sequences, garbage (not zeros) in the padding."""
    z, gamma, beta, dy = case(seed, n=int(lengths[0]) * len(lengths), m=m, dtype=dtype)
    return z, gamma, beta, dy, len(lengths), lengths


def rows_of(nb, lengths):
    return [np.arange(int(n)) * nb + b for b, n in enumerate(lengths)]


def in_tols(z, gamma, beta, y, dy, kind, nb, lengths):
    """(y, dz, dgamma, dbeta) tolerances of instance norm: the layer norm bounds of each
    sequence's rows transposed (its channels as rows); the parameter sums' terms added."""
    t_y, t_dz = np.zeros(z.shape), np.zeros(z.shape)
    t_dg, t_db = np.zeros(gamma.shape), np.zeros(gamma.shape)
    for rows in rows_of(nb, lengths):
        if len(rows):
            zs, ys, dys = z[rows].T, y[rows].T, dy[rows].T
            t_y[rows] = forward_tol(zs, gamma.T, beta.T, kind).T
            mean, r, xh = stats64(zs)
            dh = dh_of(ys, dys, kind)
            g = np.abs(gamma.T * dh)
            a = np.abs(mean) * r
            t_dz[rows] = (16 * U * r * (g + g.mean(1, keepdims=True) + (np.abs(xh) + a) * (
                g * (np.abs(xh) + a)).mean(1, keepdims=True))).T
            t_dg += 8 * U * (np.abs(dh) * (np.abs(xh) + a)).sum(1)[None]
            t_db += 4 * U * np.abs(dh).sum(1)[None]
    ref = KN.ref_instance_norm_backward(z, gamma, beta, dy, kind, nb, lengths, y=y)
    return t_y, t_dz, t_dg + U * np.abs(ref[1]), t_db + U * np.abs(ref[2])


def cpu_in(z, gamma, beta, dy, kind, nb, lengths):
    y = np.full_like(z, np.nan)
    scratch = np.empty((nb, 6, z.shape[1]))
    KN.instance_norm_forward(z, gamma, beta, y, kind, nb, lengths, scratch)
    dz = y.copy()
    gg, gb = np.empty_like(gamma), np.empty_like(beta)
    KN.instance_norm_backward(z, dz, dy, gamma, dz, gg, gb, kind, nb, lengths, scratch)
    return y, dz, gg, gb


def check_in(got, z, gamma, beta, dy, kind, nb, lengths, factor=1):
    """got = (y, dz, dgamma, dbeta) within factor x the bounds of the reference; the padding
    rows exactly 0."""
    y, dz, gg, gb = got
    tols = in_tols(z, gamma, beta, y, dy, kind, nb, lengths)
    want = (KN.ref_instance_norm(z, gamma, beta, kind, nb, lengths),
            *KN.ref_instance_norm_backward(z, gamma, beta, dy, kind, nb, lengths, y=y))
    for a, b, tol in zip((y, dz, gg, gb), want, tols):
        assert (np.abs(a - b) <= factor * tol).all()
    pad = np.ones(len(z), bool)
    pad[np.concatenate(rows_of(nb, lengths))] = False
    assert not y[pad].any() and not dz[pad].any() and np.abs(dz[~pad]).sum() > 0


if not CHILD:
    @pytest.mark.parametrize("kind", [RELU, SIGMOID, IDENTITY])
    def test_instance_norm_cpu_matches_reference_within_bound(kind):
        z, gamma, beta, dy, nb, lengths = seq_case(6)
        check_in(cpu_in(z, gamma, beta, dy, kind, nb, lengths), z, gamma, beta, dy, kind, nb,
                 lengths)

    def test_instance_norm_float64_and_threads():
        """float64: the reference's values (1e-12); float32: the same bits for 1 thread or
        all of them (a sequence per thread, the parameter sums in sequence order)."""
        import numba
        z, gamma, beta, dy, nb, lengths = seq_case(7, dtype=np.float64)
        y, dz, gg, gb = cpu_in(z, gamma, beta, dy, SIGMOID, nb, lengths)
        np.testing.assert_allclose(y, KN.ref_instance_norm(z, gamma, beta, SIGMOID, nb,
                                                           lengths), rtol=1e-12, atol=1e-15)
        for a, b in zip((dz, gg, gb), KN.ref_instance_norm_backward(z, gamma, beta, dy,
                                                                    SIGMOID, nb, lengths)):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
        z, gamma, beta, dy, nb, lengths = seq_case(8, m=64)
        out = []
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            try:
                out.append(cpu_in(z, gamma, beta, dy, RELU, nb, lengths))
            finally:
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        for a, b in zip(*out):
            np.testing.assert_array_equal(a, b)

    @pytest.mark.parametrize("kind", [RELU, SIGMOID, IDENTITY])
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
        """NVVM compiles every kernel (layer norm's four, instance norm's five) with float32,
        float16 and bfloat16 (uint16) arrays; ptxas reports no spills."""
        cuda, types, bench_cuda = ptx_compiler(monkeypatch)
        from hpcsgd.model import kernels_norm_cuda as KNC

        def a2(dt):
            return types.Array(dt, 2, "C")
        f32 = a2(types.float32)
        i64 = types.Array(types.int64, 1, "C")
        st = types.Array(types.float64, 3, "C")
        sigs = []
        for dt in (types.float32, types.float16, types.uint16):
            x = a2(dt)
            sigs += [(KNC._forward_kernel, (x, x, x, x, types.int64)),
                     (KNC._stats_kernel, (x, f32)),
                     (KNC._param_sums_kernel, (x, x, x, f32, f32, f32, types.int64)),
                     (KNC._backward_kernel, (x, x, x, x, f32, x, types.int64)),
                     (KNC._in_forward_kernel, (x, x, x, x, types.int64, i64, st, types.int64)),
                     (KNC._in_sums_kernel, (x, x, x, x, types.int64, i64, st, types.int64)),
                     (KNC._in_backward_kernel, (x, x, x, x, types.int64, i64, st, x,
                                                types.int64))]
        sigs += [(KNC._in_stats_kernel, (a2(dt), types.int64, i64, st))
                 for dt in (types.float32, types.float16, types.uint16)]
        sigs.append((KNC._in_param_sums_kernel, (st, types.int64, f32, f32)))
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

    @pytest.mark.parametrize("kind,m", [(RELU, 23), (SIGMOID, 23), (RELU, 300), (IDENTITY, 23)])
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
        if kind != RELU or (y > 0).tolist() == (y_c > 0).tolist():   # the same ReLU mask
            for got, want, tol in zip((dz, gg, gb), (dz_c, gg_c, gb_c), tols):
                assert (np.abs(got - want) <= 2 * tol).all()

    def test_empty_batch_zeroes_the_parameter_gradients():
        z = np.zeros((0, 8), np.float32)
        gamma, beta = np.ones((1, 8), np.float32), np.zeros((1, 8), np.float32)
        _, _, gg, gb = run_cuda(z, gamma, beta, z.copy(), RELU)
        assert not gg.any() and not gb.any()

    @pytest.mark.parametrize("kind", [RELU, IDENTITY])
    @pytest.mark.parametrize("storage", ["float16", "bfloat16"])
    def test_16bit_storage_is_the_float32_result_rounded_once(storage, kind):
        """16-bit arrays in, the same float32 arithmetic on their values, one rounding at the
        store: bit for bit the float32 kernel's output on the widened inputs, rounded."""
        z, gamma, beta, dy = case(5, n=11, m=40)
        if storage == "float16":
            to16, back = (lambda a: a.astype(np.float16)), (lambda a: a.astype(np.float32))
            rnd = to16
        else:
            to16, back, rnd = bf16_bits, bf16_values, bf16_bits
        args16 = [to16(a) for a in (z, gamma, beta, dy)]
        y16, dz16, gg16, gb16 = run_cuda(*args16, kind)
        y32, dz32, gg32, gb32 = run_cuda(*[back(a) for a in args16], kind)
        np.testing.assert_array_equal(y16, rnd(y32))
        np.testing.assert_array_equal(dz16, rnd(dz32))
        np.testing.assert_array_equal(gg16, gg32)   # float32 sums of the same values
        np.testing.assert_array_equal(gb16, gb32)

    def run_cuda_in(z, gamma, beta, dy, kind, nb, lengths):
        dev = [cuda.to_device(a) for a in (z, gamma, beta, dy)]
        lens = cuda.to_device(np.asarray(lengths, np.int64))
        st = cuda.to_device(np.full((nb, 6, z.shape[1]), np.nan))
        y = cuda.to_device(np.full(z.shape, np.nan, z.dtype))
        KNC.instance_norm_forward(dev[0], dev[1], dev[2], y, kind, nb, lens, st)
        y_host = y.copy_to_host()
        gg = cuda.to_device(np.full(gamma.shape, np.nan, np.float32))
        gb = cuda.to_device(np.full(beta.shape, np.nan, np.float32))
        KNC.instance_norm_backward(dev[0], y, dev[3], dev[1], y, gg, gb, kind, nb, lens, st)
        return y_host, y.copy_to_host(), gg.copy_to_host(), gb.copy_to_host()

    @pytest.mark.parametrize("kind,m", [(RELU, 23), (SIGMOID, 40), (IDENTITY, 23)])
    def test_instance_norm_matches_reference_and_cpu(kind, m):
        """m = 40: more channels than a column tile of 32."""
        z, gamma, beta, dy, nb, lengths = seq_case(9, m=m)
        got = run_cuda_in(z, gamma, beta, dy, kind, nb, lengths)
        check_in(got, z, gamma, beta, dy, kind, nb, lengths)
        cpu_out = cpu_in(z, gamma, beta, dy, kind, nb, lengths)
        tols = in_tols(z, gamma, beta, got[0], dy, kind, nb, lengths)
        assert (np.abs(got[0] - cpu_out[0]) <= 2 * tols[0]).all()
        if kind != RELU or (got[0] > 0).tolist() == (cpu_out[0] > 0).tolist():
            for a, b, tol in zip(got[1:], cpu_out[1:], tols[1:]):
                assert (np.abs(a - b) <= 2 * tol).all()

    def test_instance_norm_16bit_storage_is_the_float32_result_rounded_once():
        z, gamma, beta, dy, nb, lengths = seq_case(10, m=16)
        args16 = [a.astype(np.float16) for a in (z, gamma, beta, dy)]
        y16, dz16, gg16, gb16 = run_cuda_in(*args16, RELU, nb, lengths)
        y32, dz32, gg32, gb32 = run_cuda_in(*[a.astype(np.float32) for a in args16], RELU, nb,
                                            lengths)
        np.testing.assert_array_equal(y16, y32.astype(np.float16))
        np.testing.assert_array_equal(dz16, dz32.astype(np.float16))
        np.testing.assert_array_equal(gg16, gg32)
        np.testing.assert_array_equal(gb16, gb32)
