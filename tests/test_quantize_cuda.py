"""CUDA fake-quantization kernels (hpcsgd.model.kernels_cuda: fake_quant, fake_quant_backward,
abs_stats) against the CPU kernels' NumPy references, and a quantization-aware DNN and BLSTM
on a GPU model against the CPU model, under the CUDA simulator (re-run in a child process,
as tests/test_model_cuda.py).

Tolerances: the grid rounding is the same float32 operations (clip before rounding on the GPU:
the same value, the bounds being integers), so equality; reductions add float64 in another
order: n eps64 sum|terms|. The models' gradients as tests/test_lstm_cuda.py: 1e-4 of their
scale (CUDA's expf and tanhf against the CPU's; no activation lands on a rounding boundary of
its grid in these fixed inputs, so the quantized values agree exactly)."""
import os

import numpy as np
import pytest

from conftest import run_cuda_tests_in_child

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_cuda_quantization_kernels_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

else:
    from numba import cuda

    from hpcsgd.model import build
    from hpcsgd.model import kernels_cuda as KC
    from hpcsgd.model import kernels_quant as KQ
    from hpcsgd.model import quantize as Q

    EPS64 = np.finfo(np.float64).eps

    @pytest.mark.parametrize("strided", [False, True])
    def test_the_grid_kernel_equals_the_reference(strided):
        x = (np.random.default_rng(1).standard_normal((9, 70)) * 2).astype(np.float32)
        d_x = cuda.to_device(x)
        d_out = cuda.to_device(np.zeros_like(x))
        if strided:
            x, d_x, d_out = x[:, 10:45], d_x[:, 10:45], d_out[:, 10:45]
        for grid in (Q.symmetric_grid(1.5, 4), Q.affine_grid(-1.0, 2.5, 8),
                     Q.affine_grid(0.0, 1.0, 2)):
            KC.fake_quant(d_x, d_out, grid.step, grid.inv, grid.klo, grid.khi)
            want = KQ.ref_fake_quant(x, grid.step, grid.inv, grid.klo, grid.khi)
            np.testing.assert_array_equal(d_out.copy_to_host(), want)

    def test_the_backward_and_statistics_kernels_equal_the_references():
        rng = np.random.default_rng(2)
        x = (rng.standard_normal((11, 37)) * 2).astype(np.float32)
        dy = rng.standard_normal((11, 37)).astype(np.float32)
        d_dx = cuda.to_device(dy)
        part = cuda.to_device(np.zeros((11, 3)))
        lo, hi = np.float32(-1.0), np.float32(1.5)
        got_lo, got_hi = KC.fake_quant_backward(cuda.to_device(x), d_dx, lo, hi, part)
        want_dx, want_lo, want_hi = KQ.ref_fake_quant_backward(x, dy, lo, hi)
        np.testing.assert_array_equal(d_dx.copy_to_host(), want_dx)
        bound = x.size * EPS64 * np.abs(dy).sum()
        assert abs(got_lo - want_lo) <= bound and abs(got_hi - want_hi) <= bound
        mx, msq, mab = KC.abs_stats(cuda.to_device(x), part)
        want = KQ.ref_stats(x)
        assert mx == want[0]
        assert abs(msq - want[1]) <= 2 * x.size * EPS64 * want[1]
        assert abs(mab - want[2]) <= 2 * x.size * EPS64 * want[2]

    def test_the_per_channel_kernels_equal_the_cpu_ones():
        x = (np.random.default_rng(3).standard_normal((13, 70)) * 2).astype(np.float32)
        part = cuda.to_device(np.zeros((70, 3)))
        got = KC.column_abs_stats(cuda.to_device(x), part)
        want = np.empty((70, 3))
        KQ.column_abs_stats(x, want)
        np.testing.assert_array_equal(got, want)            # the same sums in the same order
        grid = Q.channel_grid(want[:, 0], 4)
        d_out = cuda.to_device(np.zeros_like(x))
        KC.fake_quant_channels(cuda.to_device(x), d_out, grid.step, grid.inv, grid.klo, grid.khi)
        np.testing.assert_array_equal(d_out.copy_to_host(),
                                      KQ.ref_fake_quant(x, grid.step, grid.inv, grid.klo,
                                                        grid.khi))

    QAT = {"weights": "pact", "weight_bits": 4, "activations": "bac", "activation_bits": 4}

    @pytest.mark.parametrize("shape", [
        {"input_dim": 4, "hidden": [5], "num_labels": 3, "activation": "sigmoid", "qat": QAT},
        {"type": "lstm", "input_dim": 4, "cells": [3], "num_labels": 3, "bidirectional": True,
         "bottleneck": [4], "activation": "sigmoid", "steps": 3, "qat": QAT}])
    def test_a_gpu_qat_model_gives_the_cpu_models_gradient(shape):
        n = 6
        rng = np.random.default_rng(5)
        x = rng.standard_normal((n, 4)).astype(np.float32)
        y = rng.integers(0, 3, n).astype(np.int32)
        out = []
        for device in ("cpu", "cuda"):
            model = build(shape, max_batch=n, device=device)
            params, grads = model.new_params(), model.new_params()
            model.init(params, np.random.default_rng(1))
            ce, correct = model.forward_backward(params, grads, x, y, n)
            logp = model.forward(params, x, n).copy()
            flat = grads.flat if device == "cpu" else grads.flat.copy_to_host()
            out.append((ce, correct, flat, logp))
        assert abs(out[1][0] - out[0][0]) <= 1e-5 * abs(out[0][0]) and out[1][1] == out[0][1]
        scale = np.abs(out[0][2]).max()
        assert np.abs(out[1][2] - out[0][2]).max() <= 1e-4 * scale
        np.testing.assert_allclose(out[1][3], out[0][3], rtol=1e-5, atol=1e-5)
