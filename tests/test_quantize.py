"""Fake quantization (hpcsgd.model.kernels_quant, hpcsgd.model.quantize): the grids' level
sets, the clip rules' formulas, the CPU kernels against their NumPy references (bit for bit:
the same float32 operations), idempotence, the straight-through and PACT gradients by finite
differences of the clip they stand for, and a quantization-aware network's gradient against
the float network's at the quantized weights.

Tolerances: the grid kernels do exactly the reference's float32 operations, so equality; the
reductions add float64 in another order than the reference: |error| <= n eps64 sum|terms|;
max |x| is exact."""
import numpy as np
import pytest

from hpcsgd.model import build
from hpcsgd.model import kernels_quant as KQ
from hpcsgd.model import quantize as Q

EPS64 = np.finfo(np.float64).eps


def values(shape, seed=0, scale=1.0):
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def quantized(x, grid):
    out = np.empty_like(x)
    KQ.fake_quant(x, out, grid.step, grid.inv, grid.klo, grid.khi)
    return out


@pytest.mark.parametrize("bits,levels", [(2, 1), (4, 7), (8, 127)])
def test_the_symmetric_grid_has_2_to_the_b_minus_1_levels_and_an_exact_zero(bits, levels):
    x = values((64, 300), scale=3.0)
    x[0, :5] = 0.0
    alpha = float(np.abs(x).max())
    grid = Q.symmetric_grid(alpha, bits)
    out = quantized(x, grid)
    codes = np.rint(out * grid.inv)
    np.testing.assert_array_equal(codes * grid.step, out)   # every value step * an integer
    found = set(np.unique(codes).astype(int))
    assert found <= set(range(-levels, levels + 1)) and 0 in found
    assert bits == 8 or len(found) == 2 * levels + 1
    assert (out[0, :5] == 0).all()
    # MAX: the largest magnitude is the top level, alpha to within an ulp of the step
    assert np.rint(np.abs(codes).max()) == levels
    assert abs(np.abs(out).max() - alpha) <= 2 * np.spacing(np.float32(alpha))


def test_the_affine_grid_of_a_one_signed_range_uses_2_to_the_b_levels():
    x = np.random.default_rng(1).uniform(0, 1, (50, 40)).astype(np.float32)
    grid = Q.affine_grid(0.0, 1.0, 4)
    out = quantized(x, grid)
    assert set(np.unique(np.rint(out * grid.inv)).astype(int)) == set(range(16))
    assert grid.klo == 0 and grid.khi == 15 and out.min() == 0
    # a signed learned range: 2^b levels with zero among them
    grid = Q.affine_grid(-0.7, 1.3, 3)
    assert grid.khi - grid.klo == 7 and grid.klo <= 0 <= grid.khi
    assert quantized(np.zeros((1, 3), np.float32), grid).tolist() == [[0, 0, 0]]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_cpu_kernel_equals_the_reference_and_is_idempotent(layout, dtype):
    x = values((37, 90), seed=2, scale=2.0).astype(dtype)
    if layout == "strided":   # a direction's columns of an LSTM output, as lstm.py passes it
        x = x[:, 20:65]
    for grid in (Q.symmetric_grid(1.5, 4, dtype), Q.affine_grid(-1.0, 2.5, 8, dtype)):
        out = np.empty_like(x)
        KQ.fake_quant(x, out, grid.step, grid.inv, grid.klo, grid.khi)
        want = KQ.ref_fake_quant(x, grid.step, grid.inv, grid.klo, grid.khi)
        assert want.dtype == dtype
        np.testing.assert_array_equal(out, want)
        again = np.empty_like(out)
        KQ.fake_quant(out, again, grid.step, grid.inv, grid.klo, grid.khi)
        np.testing.assert_array_equal(again, out)
        # every value within half a step of its clipped input
        clipped = np.clip(x, grid.klo * grid.step, grid.khi * grid.step)
        assert np.abs(out - clipped).max() <= grid.step * (0.5 + 1e-6)


def test_statistics_and_the_sawb_rule():
    x = values((123, 77), seed=3)
    part = np.empty((len(x), 3))
    KQ.abs_stats(x, part, np.empty(len(x), np.uint64))
    mx, msq, mab = KQ.reduce_stats(part, x.shape)
    want = KQ.ref_stats(x)
    assert mx == want[0]
    bound = x.size * EPS64 * 2
    assert abs(msq - want[1]) <= bound * want[1] and abs(mab - want[2]) <= bound * want[2]
    for bits, (c1, c2) in Q.SAWB.items():
        alpha = Q.sawb_alpha(msq, mab, mx, bits)
        assert alpha == pytest.approx(min(c1 * np.sqrt(msq) - c2 * mab, mx), rel=1e-12)
    # 4 bits: the 15-level coefficients; Gaussian weights clip at about 2.5 sigma
    assert Q.SAWB[4] == (12.035, 12.03) and 2.0 < Q.sawb_alpha(msq, mab, mx, 4) < 3.2
    with pytest.raises(ValueError, match="SAWB's coefficients"):
        Q.check({"weights": "sawb", "weight_bits": 5})
    with pytest.raises(ValueError, match="bounded activations"):
        Q.check({"weights": "bac"})


def test_a_clip_value_per_output_unit():
    """qat.weight_scale=channel: column j of W on its own grid, alpha_j = max |W[:, j]| (MAX)
    or SAWB's formula over the column: bit for bit the scalar kernel applied to that column
    alone; the statistics kernel against the reference (float64 sums in row order: n eps64)."""
    W = values((57, 150), seed=4) * np.linspace(0.1, 3.0, 150, dtype=np.float32)
    W[:, 7] = 0.0                                      # an all-zero unit: quantized to zero
    out = np.empty((150, 3))
    KQ.column_abs_stats(W, out)
    mx, msq, mab = KQ.ref_column_stats(W)
    assert np.array_equal(out[:, 0], mx)
    assert np.all(np.abs(out[:, 1] / 57 - msq) <= 57 * EPS64 * msq)
    assert np.all(np.abs(out[:, 2] / 57 - mab) <= 57 * EPS64 * mab)
    for rule in ("max", "sawb"):
        model = build({**DNN, "qat": {"weights": rule, "weight_bits": 4,
                                      "weight_scale": "channel"}}, max_batch=8)
        params = model.new_params()
        model.init(params, np.random.default_rng(0))
        params["enc.0.w"][...] = W[:DNN["input_dim"], :DNN["hidden"][0]]
        model.quant.quantize_weights(params, model.wq, model.ops)
        for name in ("enc.0.w", "enc.1.w"):
            w, wq = params[name], model.wq[name]
            for j in range(w.shape[1]):
                col = np.ascontiguousarray(w[:, j:j + 1])
                m, sq, ab = KQ.ref_stats(col)
                alpha = m if rule == "max" else Q.sawb_alpha(sq, ab, m, 4)
                want = quantized(col, Q.symmetric_grid(alpha, 4))
                assert np.array_equal(wq[:, j:j + 1], want), (rule, name, j)
            assert len(np.unique(wq)) > 15     # more levels than one grid of 15 has
        assert not model.wq["enc.0.w"][:, 7].any()
        again = np.empty_like(model.wq["enc.0.w"])
        grid = model.quant.w_grids["enc.0.w"]
        KQ.fake_quant_channels(model.wq["enc.0.w"], again, grid.step, grid.inv, grid.klo, grid.khi)
        assert np.array_equal(again, model.wq["enc.0.w"])                        # idempotent
        assert np.array_equal(again, KQ.ref_fake_quant(model.wq["enc.0.w"], grid.step, grid.inv,
                                                       grid.klo, grid.khi))
    with pytest.raises(ValueError, match="learned clip per"):
        Q.check({"weights": "pact", "weight_scale": "channel"})
    with pytest.raises(ValueError, match="weight_scale"):
        Q.check({"weights": "max", "weight_scale": "row"})


def test_the_backward_kernel_equals_the_reference():
    x, dy = values((45, 31), seed=4, scale=2.0), values((45, 31), seed=5)
    dx, part = dy.copy(), np.empty((len(x), 2))
    KQ.fake_quant_backward(x, dx, np.float32(-1.0), np.float32(1.5), part)
    want_dx, want_lo, want_hi = KQ.ref_fake_quant_backward(x, dy, np.float32(-1.0),
                                                           np.float32(1.5))
    np.testing.assert_array_equal(dx, want_dx)
    bound = x.size * EPS64 * np.abs(dy).sum()
    assert abs(part[:, 0].sum() - want_lo) <= bound and abs(part[:, 1].sum() - want_hi) <= bound
    assert (dx[(x < -1) | (x > 1.5)] == 0).all() and want_lo != 0 and want_hi != 0


def test_straight_through_and_pact_gradients_are_those_of_the_clip_by_finite_differences():
    """The surrogate f = sum(g * clip(x, lo, hi)) (what the STE differentiates): its
    derivatives in x, lo and hi by central differences, away from the thresholds, equal the
    backward kernel's dx and clip sums (float64)."""
    rng = np.random.default_rng(6)
    x = rng.uniform(-3, 3, (20, 15))
    g = rng.standard_normal((20, 15))
    lo, hi = -1.2, 1.7
    x[np.abs(x - lo) < 0.05] += 0.1   # away from the thresholds
    x[np.abs(x - hi) < 0.05] += 0.1

    def f(x, lo, hi):
        return float((g * np.clip(x, lo, hi)).sum())

    h = 1e-6
    dx, part = g.copy(), np.empty((len(x), 2))
    KQ.fake_quant_backward(x, dx, lo, hi, part)
    fd_lo = (f(x, lo + h, hi) - f(x, lo - h, hi)) / (2 * h)
    fd_hi = (f(x, lo, hi + h) - f(x, lo, hi - h)) / (2 * h)
    assert part[:, 0].sum() == pytest.approx(fd_lo, rel=1e-7, abs=1e-7)
    assert part[:, 1].sum() == pytest.approx(fd_hi, rel=1e-7, abs=1e-7)
    for i, j in [(0, 0), (3, 7), (19, 14), (10, 2)]:
        e = np.zeros_like(x)
        e[i, j] = h
        fd = (f(x + e, lo, hi) - f(x - e, lo, hi)) / (2 * h)
        assert dx[i, j] == pytest.approx(fd, rel=1e-7, abs=1e-7)


DNN = {"input_dim": 12, "hidden": [9, 7], "num_labels": 5, "activation": "sigmoid"}


def batch(n=30, dim=12, labels=5, seed=7):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, dim)) * 2).astype(np.float32)
    return x, rng.integers(0, labels, n).astype(np.int32)   # the loader's dtype: its kernels


def test_a_qat_network_computes_the_float_networks_gradient_at_the_quantized_weights():
    """Weights MAX (straight through to every weight): the gradient is the float model's at
    wq, bit for bit; weights PACT: the same masked to |W| <= alpha, and the clip's gradient
    the sum of the gradient where W > alpha minus where W < -alpha."""
    x, y = batch()
    flat_model = build(DNN, max_batch=30)
    for rule in ("max", "pact"):
        model = build({**DNN, "qat": {"weights": rule, "weight_bits": 3}}, max_batch=30)
        params, grads = model.new_params(), model.new_params()
        model.init(params, np.random.default_rng(0))
        model.forward_backward(params, grads, x, y, 30)
        flat_params, flat_grads = flat_model.new_params(), flat_model.new_params()
        for name in flat_params.views:
            flat_params[name][...] = model.wq[name]
        flat_model.forward_backward(flat_params, flat_grads, x, y, 30)
        for name in ("enc.0.w", "enc.1.w", "out.w"):
            W, want = params[name], flat_grads[name].copy()
            assert not np.array_equal(model.wq[name], W)   # really quantized
            if rule == "pact":
                alpha = params[f"clip_{name}"][0, 0]
                assert 0 < alpha < np.abs(W).max()   # SAWB's start clips some weights
                want[np.abs(W) > alpha] = 0
                clip = (flat_grads[name][W > alpha].astype(np.float64).sum()
                        - flat_grads[name][W < -alpha].astype(np.float64).sum()
                        + model.quant.clip_decay * 30 * np.float64(alpha))
                assert grads[f"clip_{name}"][0, 0] == pytest.approx(clip, rel=1e-6)
            np.testing.assert_array_equal(grads[name], want, err_msg=f"{rule} {name}")
        for name in ("enc.0.b", "enc.1.b", "out.b"):
            np.testing.assert_array_equal(grads[name], flat_grads[name])


def test_pact_inputs_learn_their_range_and_pass_the_gradient_inside_it():
    """A learned input range narrower than the features: the first layer's input is clipped,
    the clip values get the gradient outside, and the layer sees the quantized input."""
    x, y = batch()
    qat = {"activations": "pact", "activation_bits": 4, "pact_init": 1.0, "clip_decay": 0.0}
    model = build({**DNN, "qat": qat}, max_batch=30)
    params, grads = model.new_params(), model.new_params()
    model.init(params, np.random.default_rng(0))
    assert params["clip_in0"].tolist() == [[-1.0, 1.0]]
    assert params["clip_in1"].tolist() == [[0.0, 1.0]]   # a sigmoid's bounds
    model.forward_backward(params, grads, x, y, 30)
    xq = model.aq[0][:30]
    grid = Q.affine_grid(-1.0, 1.0, 4)
    np.testing.assert_array_equal(xq, KQ.ref_fake_quant(x, grid.step, grid.inv, grid.klo,
                                                        grid.khi))
    d_lo, d_hi = grads["clip_in0"][0]
    assert d_lo != 0 and d_hi != 0
    assert grads["clip_in1"].tolist() == [[0.0, 0.0]]   # a sigmoid never leaves [0, 1]
    # the input gradient the model computed for it: dLoss/dxq masked outside [-1, 1]
    dx = model.delta[:30 * 12].reshape(30, 12)
    assert (dx[(x < -1) | (x > 1)] == 0).all() and dx[(x > -1) & (x < 1)].any()


def test_bac_uses_the_fixed_bounds_and_the_lstm_quantizes_its_hidden_state():
    qat = {"weights": "sawb", "weight_bits": 4, "activations": "bac", "activation_bits": 4}
    shape = {"type": "lstm", "input_dim": 6, "cells": [5], "num_labels": 4,
             "bidirectional": True, "bottleneck": [7], "activation": "relu", "steps": 3,
             "qat": qat}
    model = build(shape, max_batch=12)
    # the features and the ReLU's output (no bound) learn; the LSTM's output has [-1, 1]
    assert model.quant.rules == ["pact", "fixed", "pact"]
    params, grads = model.new_params(), model.new_params()
    model.init(params, np.random.default_rng(0))
    x, y = batch(12, 6, 4)
    model.forward_backward(params, grads, x, y, 12)
    hq = model.workspaces[0]["hq"][:12]
    grid = Q.symmetric_grid(1.0, 4)   # +-7 levels of 1/7
    codes = np.rint(hq * grid.inv)
    np.testing.assert_array_equal(codes * grid.step, hq)
    assert np.abs(codes).max() <= 7
    assert np.abs(hq).max() <= 1 and len(np.unique(hq)) > 3
    float_model = build({k: v for k, v in shape.items() if k != "qat"}, max_batch=12)
    fp = float_model.new_params()
    float_model.init(fp, np.random.default_rng(0))
    assert not np.allclose(model.forward(params, x, 12), float_model.forward(fp, x, 12))

