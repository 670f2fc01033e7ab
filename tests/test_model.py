"""hpcsgd.model: flat buffers, kernels against their NumPy references, finite-difference
gradient checks (float64), learning a separable problem, and the `bench train --small` smoke."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from hpcsgd.model import kernels as K
from hpcsgd.model.dnn import dnn, gemm_flop_per_frame, layout
from hpcsgd.optim import Optimizer


def test_fexp_float32_within_one_ulp():
    x = np.linspace(-87, 88, 1_000_001, dtype=np.float32)
    out = np.empty_like(x)
    K.exp_kernel(x, out)
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(out - ref) / ref) < 1.2e-7
    far = np.array([-1e4, -100, 100, 1e4, np.float32(np.inf)], np.float32)
    out = np.empty_like(far)
    K.exp_kernel(far, out)
    assert np.isfinite(out).all() and out[0] < 2e-38 and out[-1] > 1e38


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("act", ["sigmoid", "relu"])
def test_activation_kernels_match_numpy(dtype, act):
    rng = np.random.default_rng(1)
    kind = K.ACTIVATIONS[act]
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    z = (rng.standard_normal((37, 53)) * 4).astype(dtype)
    b = rng.standard_normal((1, 53)).astype(dtype)
    h = z.copy()
    K.FORWARD[kind](h, b)
    np.testing.assert_allclose(h, K.ref_bias_act_forward(z, b, kind), **tol)
    d = rng.standard_normal(h.shape).astype(dtype)
    partial = np.empty((K.NCHUNK, 53), dtype)
    gb = np.empty((1, 53), dtype)
    ref_dz, ref_gb = K.ref_act_backward(h, d, kind)
    dz = h.copy()
    K.BACKWARD[kind](dz, d, dz, gb, partial)          # aliased h/dz, as the DNN calls it
    np.testing.assert_allclose(dz, ref_dz, **tol)
    np.testing.assert_allclose(gb, ref_gb, rtol=1e-5 if dtype == np.float32 else 1e-12,
                               atol=1e-5 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_xent_kernel_matches_numpy(dtype):
    rng = np.random.default_rng(2)
    n, m = 45, 301
    z = (rng.standard_normal((n, m)) * 5).astype(dtype)
    z[3, :] = 0                        # a tie: argmax must be the first index
    z[4, 7] = 200                      # a confident frame
    b = rng.standard_normal((1, m)).astype(dtype)
    y = rng.integers(0, m, n).astype(np.int32)
    y[:20] = np.argmax(z[:20] + b, axis=1)[:20]
    ref_g, ref_gb, ref_ce, ref_correct, ref_logpost = K.ref_softmax_xent(z, b, y)
    g, gb = z.copy(), np.empty((1, m), dtype)
    ce_part, correct_part = np.empty(K.NCHUNK), np.empty(K.NCHUNK, np.int64)
    K.softmax_xent_backward(g, b, y, gb, np.empty((K.NCHUNK, m), dtype),
                            np.empty((K.NCHUNK, K.LANES), dtype), ce_part, correct_part)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(g, ref_g, rtol=tol, atol=tol)
    np.testing.assert_allclose(gb, ref_gb, rtol=tol, atol=10 * tol)
    assert abs(ce_part.sum() - ref_ce) <= tol * abs(ref_ce)
    assert correct_part.sum() == ref_correct
    for log in (True, False):
        out = z.copy()
        K.log_softmax_forward(out, b, np.empty((n, K.LANES), dtype))
        if not log:
            K.exp_inplace(out)
        want = ref_logpost if log else np.exp(ref_logpost)
        np.testing.assert_allclose(out, want, rtol=tol, atol=tol * 10)
        if not log:
            np.testing.assert_allclose(out.sum(axis=1), 1.0, rtol=tol * 10)


def _small(act, dtype=np.float64, max_batch=16):
    model = dnn(7, [6, 5], 4, act, max_batch=max_batch, dtype=dtype)
    params = model.new_params()
    model.init(params, np.random.default_rng(3))
    rng = np.random.default_rng(4)
    params.flat[:] += rng.standard_normal(params.size) * 0.1   # non-zero biases too
    x = rng.standard_normal((max_batch, 7)).astype(dtype)
    y = rng.integers(0, 4, max_batch).astype(np.int32)   # the loader's dtype: its compiled kernels
    return model, params, x, y


@pytest.mark.parametrize("act", ["sigmoid", "relu"])
def test_gradient_matches_finite_differences(act):
    model, params, x, y = _small(act)
    n = 13                                          # < max_batch: views of the workspaces
    grads = model.new_params()
    model.forward_backward(params, grads, x, y, n)
    scratch = model.new_params()
    eps = 1e-6
    worst = 0.0
    for i in range(params.size):                    # every parameter, every layer and bias
        old = params.flat[i]
        params.flat[i] = old + eps
        plus, _ = model.forward_backward(params, scratch, x, y, n)
        params.flat[i] = old - eps
        minus, _ = model.forward_backward(params, scratch, x, y, n)
        params.flat[i] = old
        fd = (plus - minus) / (2 * eps)
        # central differences: O(eps^2) truncation, ~1e-16 * CE / eps rounding (~1e-9)
        worst = max(worst, abs(fd - grads.flat[i]) - 1e-6 * abs(fd))
    assert worst < 1e-8, worst


def test_summed_gradient_and_smaller_batches():
    """Gradients and CE are sums over frames: batch [0, n) = batch [0, k) + batch [k, n)."""
    model, params, x, y = _small("sigmoid")
    g_all, g_a, g_b = model.new_params(), model.new_params(), model.new_params()
    ce_all, c_all = model.forward_backward(params, g_all, x, y, 12)
    ce_a, c_a = model.forward_backward(params, g_a, x[:5].copy(), y[:5], 5)
    ce_b, c_b = model.forward_backward(params, g_b, x[5:12].copy(), y[5:12], 7)
    np.testing.assert_allclose(g_all.flat, g_a.flat + g_b.flat, rtol=1e-12, atol=1e-14)
    assert abs(ce_all - ce_a - ce_b) < 1e-12 and c_all == c_a + c_b
    # forward-only log-posteriors agree with the training path's CE
    logpost = model.forward(params, x, 12)
    assert abs(-logpost[np.arange(12), y[:12]].sum() - ce_all) < 1e-10
    post = model.forward(params, x, 12, out=np.empty((16, 4)), log=False)
    np.testing.assert_allclose(post.sum(axis=1), 1.0, rtol=1e-12)
    assert c_all == int((logpost.argmax(axis=1) == y[:12]).sum())


def test_progress_is_called_after_every_gemm_and_changes_nothing():
    """Double buffering's MPI_Test hook: called once after each of the 3L + 2 GEMMs of a
    forward + backward (L = 2 hidden layers: 8), with the same gradient bits as without."""
    model, params, x, y = _small("sigmoid")
    plain, poked = model.new_params(), model.new_params()
    calls = []
    ce0, c0 = model.forward_backward(params, plain, x, y, 12)
    ce1, c1 = model.forward_backward(params, poked, x, y, 12, lambda: calls.append(1))
    assert len(calls) == 3 * 2 + 2
    assert (ce0, c0) == (ce1, c1) and np.array_equal(plain.flat, poked.flat)


def test_float32_model_agrees_with_float64():
    model64, params64, x, y = _small("sigmoid")
    model32 = dnn(7, [6, 5], 4, "sigmoid", max_batch=16, dtype=np.float32)
    params32 = model32.new_params()
    params32.flat[:] = params64.flat
    g64, g32 = model64.new_params(), model32.new_params()
    ce64, _ = model64.forward_backward(params64, g64, x, y, 16)
    ce32, _ = model32.forward_backward(params32, g32, x.astype(np.float32), y, 16)
    assert abs(ce32 - ce64) < 1e-5 * ce64
    np.testing.assert_allclose(g32.flat, g64.flat, rtol=1e-4, atol=1e-5)


def test_bad_inputs_are_rejected():
    model, params, x, y = _small("relu")
    with pytest.raises(ValueError, match="minibatch"):
        model.forward_backward(params, model.new_params(), x, y, 17)
    with pytest.raises(ValueError, match="input"):
        model.forward(params, x.astype(np.float32), 4)
    with pytest.raises(ValueError, match="labels"):
        model.forward_backward(params, model.new_params(), x, np.full(16, 4), 16)
    with pytest.raises(ValueError, match="activation"):
        dnn(3, [2], 2, "tanh")


@pytest.mark.parametrize("act", ["sigmoid", "relu"])
def test_tiny_model_learns_separable_problem(act):
    """4 Gaussian blobs in 10-D, well separated: the model must get >= 98% frame accuracy."""
    rng = np.random.default_rng(5)
    centres = rng.standard_normal((4, 10)) * 3
    labels = rng.integers(0, 4, 4096).astype(np.int32)
    feats = (centres[labels] + rng.standard_normal((4096, 10))).astype(np.float32)
    model = dnn(10, [32, 32], 4, act, max_batch=128)
    params, grads = model.new_params(), model.new_params()
    model.init(params, np.random.default_rng(6))
    opt = Optimizer(params.size, momentum_time_constant=1200.0)
    for epoch in range(3):
        for s in range(0, 4096, 128):
            x = feats[s:s + 128]
            model.forward_backward(params, grads, x, labels[s:s + 128], 128)
            opt.step(params.flat, grads.flat, 2e-3, 128)   # lr per sample
    logpost = model.forward(params, feats[:128], 128).copy()   # a view of the workspace
    ce, correct = model.forward_backward(params, grads, feats, labels, 128)
    assert correct / 128 >= 0.98 and ce / 128 < 0.1
    assert (logpost.argmax(axis=1) == labels[:128]).mean() >= 0.98


def test_flop_count_of_the_paper_model():
    assert layout(440, [2048] * 7, 9304)[-1] == ("out.b", (1, 9304))
    n = sum(a * b for _, (a, b) in layout(440, [2048] * 7, 9304))
    assert 45e6 < n < 46e6                        # the paper's "46M"
    assert gemm_flop_per_frame(440, [2048] * 7, 9304) == 2 * (3 * (n - 2048 * 7 - 9304) - 440 * 2048)


def test_bench_train_small_runs(tmp_path):
    exe = shutil.which("hpcsgd")
    cmd = [exe] if exe else [sys.executable, "-m", "hpcsgd.cli"]
    out = tmp_path / "bench.json"
    proc = subprocess.run(cmd + ["bench", "train", "--small", "--steps", "2", "--batch", "256",
                                 "--json", str(out)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "fraction of the GEMM roofline" in proc.stdout
    res = json.loads(out.read_text())
    assert res["frames_per_s"] > 0 and 0 < res["roofline_fraction"] and res["batch"] == 256
