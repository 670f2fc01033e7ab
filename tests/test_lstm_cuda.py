"""CUDA LSTM kernels (hpcsgd.model.kernels_cuda: lstm_forward_step, lstm_backward_step) against
their NumPy references, the masked CUDA softmax, and a whole BLSTM on a GPU model against the
CPU model, under the CUDA simulator (re-run in a child process, as tests/test_model_cuda.py).

Tolerances: every value is O(1) and a few float32 roundings from its inputs (CUDA's expf and
tanhf are within 2 ulp), so 1e-5 relative / 1e-6 absolute per kernel, as test_model_cuda's
TOL; a network's gradient is a sum over T x B rows of such values: 1e-4 of its scale."""
import os

import numpy as np
import pytest

from conftest import run_cuda_tests_in_child

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_cuda_lstm_kernels_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

else:
    from numba import cuda

    from hpcsgd.model import kernels as K
    from hpcsgd.model import kernels_cuda as KC
    from hpcsgd.model import kernels_lstm as KL

    TOL = dict(rtol=1e-5, atol=1e-6)
    B, H = 3, 5

    def test_step_kernels_on_strided_views_equal_the_references():
        """The second direction's columns of a (B, 8H) gate block and a (B, 2H) output, as
        the BLSTM launches them."""
        rng = np.random.default_rng(1)
        gates = (rng.standard_normal((B, 8 * H)) * 3).astype(np.float32)
        r = rng.standard_normal((B, 4 * H)).astype(np.float32)
        b = rng.standard_normal((1, 8 * H)).astype(np.float32)
        c_prev = rng.standard_normal((B, H)).astype(np.float32)
        d_gates, d_r, d_b, d_cp = (cuda.to_device(v) for v in (gates, r, b, c_prev))
        d_c, d_h = cuda.to_device(np.zeros((B, 2 * H), np.float32)), \
            cuda.to_device(np.zeros((B, 2 * H), np.float32))
        KC.lstm_forward_step(d_gates[:, 4 * H:], d_r, d_b[:, 4 * H:], d_cp, d_c[:, H:],
                             d_h[:, H:])   # strided views, as CudaOps passes a direction
        want_gates, want_c, want_h = KL.ref_forward_step(gates[:, 4 * H:], r, b[:, 4 * H:],
                                                         c_prev)
        got = d_gates.copy_to_host()
        np.testing.assert_allclose(got[:, 4 * H:], want_gates, **TOL)
        np.testing.assert_array_equal(got[:, :4 * H], gates[:, :4 * H])   # untouched
        np.testing.assert_allclose(d_c.copy_to_host()[:, H:], want_c, **TOL)
        np.testing.assert_allclose(d_h.copy_to_host()[:, H:], want_h, **TOL)
        assert not d_h.copy_to_host()[:, :H].any()
        dh, dr, dc = (rng.standard_normal((B, H)).astype(np.float32) for _ in range(3))
        d_dc = cuda.to_device(dc)
        c = d_c.copy_to_host()[:, H:]
        want_da, want_dc = KL.ref_backward_step(got[:, 4 * H:], c_prev, c, dh, dr, dc)
        KC.lstm_backward_step(d_gates[:, 4 * H:], d_cp, d_c[:, H:], cuda.to_device(dh),
                              cuda.to_device(dr), d_dc)
        np.testing.assert_allclose(d_gates.copy_to_host()[:, 4 * H:], want_da, **TOL)
        np.testing.assert_allclose(d_dc.copy_to_host(), want_dc, **TOL)

    def test_masked_rows_of_the_softmax_add_nothing():
        rng = np.random.default_rng(2)
        n, m = 6, 7
        z = (rng.standard_normal((n, m)) * 3).astype(np.float32)
        b = rng.standard_normal((1, m)).astype(np.float32)
        y = rng.integers(0, m, n).astype(np.int32)
        y[[1, 4]] = -1
        grad, gb, ce, correct, _ = K.ref_softmax_xent(z, b, y)
        dz, dgb = cuda.to_device(z), cuda.to_device(np.zeros((1, m), np.float32))
        got_ce, got_correct = KC.softmax_xent_backward(
            dz, cuda.to_device(b), cuda.to_device(y), dgb, cuda.to_device(np.zeros(n)),
            cuda.to_device(np.zeros(n, np.int32)))
        out = dz.copy_to_host()
        assert not out[[1, 4]].any()
        np.testing.assert_allclose(out, grad, **TOL)
        np.testing.assert_allclose(dgb.copy_to_host(), gb, **TOL)
        assert abs(got_ce - ce) <= 1e-5 * abs(ce) and got_correct == correct

    def test_a_gpu_blstm_gives_the_cpu_models_gradient():
        from hpcsgd.model.lstm import lstm
        steps, nb = 3, 2
        rng = np.random.default_rng(5)
        x = rng.standard_normal((steps * nb, 4)).astype(np.float32)
        y = rng.integers(0, 3, steps * nb).astype(np.int32)
        y[0] = -1
        out = []
        for device in ("cpu", "cuda"):
            model = lstm(4, [3], 3, True, [4], "sigmoid", steps=steps, max_batch=steps * nb,
                         device=device)
            params, grads = model.new_params(), model.new_params()
            model.init(params, np.random.default_rng(1))
            ce, correct = model.forward_backward(params, grads, x, y, steps * nb)
            logp = model.forward(params, x, steps * nb).copy()
            flat = grads.flat if device == "cpu" else grads.flat.copy_to_host()
            out.append((ce, correct, flat, logp))
        assert abs(out[1][0] - out[0][0]) <= 1e-5 * abs(out[0][0]) and out[1][1] == out[0][1]
        scale = np.abs(out[0][2]).max()
        assert np.abs(out[1][2] - out[0][2]).max() <= 1e-4 * scale
        np.testing.assert_allclose(out[1][3], out[0][3], rtol=1e-5, atol=1e-5)

    @pytest.mark.parametrize("shape", [(1, 1), (4, 33)])
    def test_step_kernels_cover_every_cell_of_any_shape(shape):
        """Grid-stride launches: shapes not a multiple of the block (33 > 32 cells)."""
        nb, hc = shape
        rng = np.random.default_rng(3)
        a = rng.standard_normal((nb, 4 * hc)).astype(np.float32)
        zeros = np.zeros((nb, 4 * hc), np.float32)
        d_a = cuda.to_device(a)
        d_c, d_h = (cuda.to_device(np.zeros((nb, hc), np.float32)) for _ in range(2))
        c0 = np.zeros((nb, hc), np.float32)
        KC.lstm_forward_step(d_a, cuda.to_device(zeros), cuda.to_device(zeros[:1]),
                             cuda.to_device(c0), d_c, d_h)
        _, want_c, want_h = KL.ref_forward_step(a, zeros, zeros[:1], c0)
        np.testing.assert_allclose(d_h.copy_to_host(), want_h, **TOL)
        np.testing.assert_allclose(d_c.copy_to_host(), want_c, **TOL)
