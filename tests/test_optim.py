"""hpcsgd.optim: momentum convention, each AdaGrad placement against a plain NumPy
implementation of the update equations, the distributed (striped) composition, per-sample
learning rates, schedules, and state round trips."""
import math

import numpy as np
import pytest

from hpcsgd.comm.stripes import stripe_ranges
from hpcsgd.model.dnn import dnn
from hpcsgd.model.flat import FlatParams
from hpcsgd.optim import (Optimizer, learning_rate, momentum_per_minibatch,
                          momentum_time_constant, newbob_lr, step_decay_lr)


class RefOptimizer:
    """The docstring's equations, line by line, in float64 NumPy. Local gradients come per
    rank; with one rank "local" is AdaGrad on the whole gradient before the exchange."""

    def __init__(self, size, ranks, T, place, Ta, eps, wd):
        self.T, self.place, self.Ta, self.eps, self.wd = T, place, Ta, eps, wd
        self.v = np.zeros(size)
        self.s = np.zeros(size) if place != "local" else np.zeros((ranks, size))
        self.q = 0.0 if place != "local" else np.zeros(ranks)

    def _ada(self, x, s, q, n):
        rho, c = (1.0, n) if math.isinf(self.Ta) else (math.exp(-n / self.Ta),
                                                       1 - math.exp(-n / self.Ta))
        s[...] = rho * s + c * (x / n) ** 2
        q = rho * q + c
        return x / (np.sqrt(s / q) + self.eps), q

    def step(self, W, local_grads, lr):
        ns = [n for _, n in local_grads]
        n = sum(ns)
        parts = []
        for r, (g, nr) in enumerate(local_grads):
            g = g.astype(np.float64)
            if self.place == "local":
                g, self.q[r] = self._ada(g, self.s[r], self.q[r], nr)
            parts.append(g)
        g = sum(parts) + self.wd * n * W
        if self.place == "aggregate":
            g, self.q = self._ada(g, self.s, self.q, n)
        if self.T > 0:
            m = math.exp(-n / self.T)
            self.v = m * self.v + (1 - m) * g
            g = self.v
        if self.place == "after_momentum":
            g, self.q = self._ada(g, self.s, self.q, n)
        return W - lr * g


PLACES = ["off", "local", "aggregate", "after_momentum"]


def _grads(rng, size, ns):
    # per-rank summed gradients: scale ~ n, some parameters never see a gradient
    out = []
    for n in ns:
        g = rng.standard_normal(size) * 0.01 * n
        g[:7] = 0
        out.append((g, n))
    return out


@pytest.mark.parametrize("place", PLACES)
@pytest.mark.parametrize("Ta", [math.inf, 5000.0])
def test_single_process_step_matches_reference(place, Ta):
    rng = np.random.default_rng(0)
    size = 1003
    W0 = rng.standard_normal(size)
    ref = RefOptimizer(size, 1, 3000.0, place, Ta, 1e-8, 1e-4)
    opt = Optimizer(size, 3000.0, place, Ta, 1e-8, 1e-4, dtype=np.float64)
    W_ref, W = W0.copy(), W0.copy()
    for step, n in enumerate([256, 512, 128, 1024, 256]):      # varying minibatch sizes
        (g, _), = _grads(rng, size, [n])
        lr = 1e-4 / (step + 1)
        W_ref = ref.step(W_ref, [(g, n)], lr)
        opt.step(W, g.copy(), lr, n)
        np.testing.assert_allclose(W, W_ref, rtol=1e-12, atol=1e-14)
    # float32 buffers follow the same equations to float32 accuracy
    opt32 = Optimizer(size, 3000.0, place, Ta, 1e-8, 1e-4, dtype=np.float32)
    ref = RefOptimizer(size, 1, 3000.0, place, Ta, 1e-8, 1e-4)
    W32, W_ref = W0.astype(np.float32), W0.astype(np.float32).astype(np.float64)
    for n in [256, 512, 1024]:
        (g, _), = _grads(rng, size, [n])
        W_ref = ref.step(W_ref, [(g.astype(np.float32), n)], 1e-4)
        opt32.step(W32, g.astype(np.float32), 1e-4, n)
    np.testing.assert_allclose(W32, W_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("place", PLACES)
def test_striped_distributed_composition_matches_reference(place):
    """K = 3 ranks: begin_step/pre_exchange everywhere, post_exchange by the owner of each
    stripe range only, apply everywhere; replicas stay bit-identical and follow the reference."""
    K = 3
    lay = [("W0", (5, 7)), ("b0", (1, 7)), ("W1", (7, 4)), ("b1", (1, 4))]
    mats = FlatParams(lay, np.float64).matrices
    size = sum(m.size for m in mats)
    rng = np.random.default_rng(1)
    W0 = rng.standard_normal(size)
    opts = [Optimizer(size, 2000.0, place, 4000.0, 1e-8, 1e-4, np.float64) for _ in range(K)]
    Ws = [W0.copy() for _ in range(K)]
    ref = RefOptimizer(size, K, 2000.0, place, 4000.0, 1e-8, 1e-4)
    W_ref = W0.copy()
    for _ in range(4):
        local = _grads(rng, size, [100, 60, 90])        # unequal local minibatches
        n = sum(nr for _, nr in local)
        lr = 3e-4
        W_ref = ref.step(W_ref, local, lr)
        sent = []
        for r in range(K):
            opts[r].begin_step(n, local[r][1])
            g = local[r][0].copy()
            opts[r].pre_exchange(g)
            sent.append(g)
        agg = sum(sent)                                  # the exchange (exact here)
        update = np.full(size, np.nan)
        for r in range(K):
            for lo, hi in stripe_ranges(mats, r, K):
                piece = agg.copy()
                update[lo:hi] = opts[r].post_exchange(piece, Ws[r], lo, hi)
        assert not np.isnan(update).any()
        for r in range(K):
            opts[r].apply(Ws[r], update, lr)
        for r in range(1, K):
            np.testing.assert_array_equal(Ws[r], Ws[0])
        np.testing.assert_allclose(Ws[0], W_ref, rtol=1e-12, atol=1e-14)


def test_momentum_time_constant_convention():
    assert momentum_per_minibatch(0, 1024) == 0.0
    m = momentum_per_minibatch(9719.0, 1024)
    assert abs(m - 0.9) < 1e-4 and abs(momentum_time_constant(0.9, 1024) - 9719.0) < 0.1
    # unit gain: a constant gradient moves W by lr * g per step in the steady state, any T
    for T in (500.0, 5000.0):
        opt = Optimizer(1, T, dtype=np.float64)
        W = np.zeros(1)
        for _ in range(1500):                       # m^1500 = exp(-30) at T = 5000
            before = W.copy()
            opt.step(W, np.array([2.0]), 0.1, 100)
        assert abs((before - W)[0] - 0.2) < 1e-9
    # equal to classic momentum mu = m, eta = lr (1 - m)
    rng = np.random.default_rng(2)
    opt = Optimizer(3, 800.0, dtype=np.float64)
    W, Wc, vc = np.zeros(3), np.zeros(3), np.zeros(3)
    mu = math.exp(-64 / 800.0)
    for _ in range(10):
        g = rng.standard_normal(3)
        opt.step(W, g.copy(), 0.01, 64)
        vc = mu * vc + g
        Wc -= 0.01 * (1 - mu) * vc
    np.testing.assert_allclose(W, Wc, rtol=1e-12)


def test_per_sample_learning_rate_with_a_real_model():
    """The gradient of a minibatch is the sum of its frames' gradients, and lr is per sample:
    one step on n frames equals lr times the sum of the per-frame gradients, so a step on 2n
    frames of the same kind is twice as long as one on n."""
    model = dnn(5, [4], 3, "sigmoid", max_batch=8, dtype=np.float64)
    params = model.new_params()
    model.init(params, np.random.default_rng(3))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8, 5))
    y = rng.integers(0, 3, 8).astype(np.int32)
    total = np.zeros(params.size)
    g1 = model.new_params()
    for i in range(8):
        model.forward_backward(params, g1, x[i:i + 1].copy(), y[i:i + 1], 1)
        total += g1.flat
    g = model.new_params()
    model.forward_backward(params, g, x, y, 8)
    W = params.flat.copy()
    Optimizer(params.size, dtype=np.float64).step(W, g.flat, 0.05, 8)
    np.testing.assert_allclose(W, params.flat - 0.05 * total, rtol=1e-12, atol=1e-15)
    # same frames twice: twice the step
    x2, y2 = np.concatenate([x[:4], x[:4]]), np.concatenate([y[:4], y[:4]])
    model.forward_backward(params, g, x[:4].copy(), y[:4], 4)
    step4 = g.flat.copy()
    model.forward_backward(params, g, x2, y2, 8)
    np.testing.assert_allclose(g.flat, 2 * step4, rtol=1e-12, atol=1e-15)


def test_slices_compose_and_state_round_trip():
    rng = np.random.default_rng(5)
    size = 1000
    W0 = rng.standard_normal(size).astype(np.float32)
    gs = [rng.standard_normal(size).astype(np.float32) * 50 for _ in range(6)]
    a = Optimizer(size, 3000.0, "aggregate", 8000.0, 1e-8, 1e-5)
    W_a = W0.copy()
    for g in gs:
        a.step(W_a, g.copy(), 1e-3, 512)
    # same via post_exchange over uneven slices + apply, with a checkpoint in the middle
    b = Optimizer(size, 3000.0, "aggregate", 8000.0, 1e-8, 1e-5)
    W_b = W0.copy()
    for k, g in enumerate(gs):
        if k == 3:
            state = {key: (v.copy() if isinstance(v, np.ndarray) else v)
                     for key, v in b.state_dict().items()}
            b = Optimizer(size, 3000.0, "aggregate", 8000.0, 1e-8, 1e-5)
            b.load_state_dict(state)
        b.begin_step(512)
        u = g.copy()
        for lo, hi in [(0, 1), (1, 333), (333, 1000)]:
            b.post_exchange(u, W_b, lo, hi)
        b.apply(W_b, u, 1e-3)
    np.testing.assert_array_equal(W_b, W_a)     # same kernels, same order: the same bits
    with pytest.raises(ValueError, match="velocity"):
        Optimizer(10, 100.0).load_state_dict({"velocity": np.zeros(9), "sqr": np.zeros(1),
                                              "sqr_weight": 0.0})
    with pytest.raises(ValueError, match="adagrad"):
        Optimizer(10, adagrad="everywhere")


def test_schedules():
    assert learning_rate("constant", 0.01, frames=10 ** 9) == 0.01
    assert step_decay_lr(0.01, 2_999_999, 1_000_000, 0.5) == 0.01 * 0.25
    assert learning_rate("step", 0.01, frames=3_000_000, decay_frames=10 ** 6,
                         decay_factor=0.1) == pytest.approx(1e-5)
    assert newbob_lr(1.0, []) == 1.0 and newbob_lr(1.0, [0.30]) == 1.0
    assert newbob_lr(1.0, [0.30, 0.40, 0.45]) == 1.0          # still improving by >= 0.005
    assert newbob_lr(1.0, [0.30, 0.40, 0.402]) == 0.5         # stalled: halve
    assert newbob_lr(1.0, [0.30, 0.40, 0.402, 0.43]) == 0.25  # and keep halving (ramping)
    assert newbob_lr(1.0, [0.30, 0.29], factor=0.7) == pytest.approx(0.7)
    assert learning_rate("newbob", 0.1, cv_acc_history=[0.3, 0.3001]) == pytest.approx(0.05)
    with pytest.raises(ValueError, match="schedule"):
        learning_rate("cosine", 0.1)


def test_a_warmup_ramps_any_schedule_from_zero():
    """schedule.warmup_frames: the schedule's rate times frames / warmup until then."""
    assert learning_rate("constant", 0.01, frames=0, warmup_frames=1000) == 0.0
    assert learning_rate("constant", 0.01, frames=250, warmup_frames=1000) == 0.0025
    assert learning_rate("constant", 0.01, frames=1000, warmup_frames=1000) == 0.01
    assert learning_rate("linear", 0.01, frames=500, total_frames=1000,
                         warmup_frames=1000) == pytest.approx(0.005 * 0.5)
    assert learning_rate("linear", 0.01, frames=1500, total_frames=2000,
                         warmup_frames=1000) == pytest.approx(0.0025)


def test_local_adagrad_on_a_rank_without_frames_keeps_its_state():
    """At an epoch's tail a rank may get 0 frames: its gradient is zero and AdaGrad "local"
    must neither divide by zero nor change its accumulated statistics."""
    from hpcsgd.optim import Optimizer
    opt = Optimizer(8, adagrad="local")
    g = np.linspace(-1, 1, 8).astype(np.float32)
    opt.begin_step(20, 10)
    opt.pre_exchange(g.copy())
    sqr, weight = opt.sqr.copy(), opt.sqr_weight
    zero = np.zeros(8, np.float32)
    opt.begin_step(10, 0)
    opt.pre_exchange(zero)
    assert np.all(zero == 0) and np.array_equal(opt.sqr, sqr) and opt.sqr_weight == weight


# --- Adam (optim.type=adam, issue 18) ------------------------------------------------------------

def adam_reference(w, grads, lr, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0, freeze=None):
    """Adam in float64 with the per-sample conventions: y = (g + wd n w) / n (the per-sample
    mean), m and v its bias-corrected moments, W -= lr * n * m_hat / (sqrt(v_hat) + eps);
    from step `freeze` on (1-based) v_hat stays as it was after the step before."""
    w = w.astype(np.float64).copy()
    m, v = np.zeros_like(w), np.zeros_like(w)
    for t, (g, n) in enumerate(grads, start=1):
        y = (g + wd * n * w) / n
        m = beta1 * m + (1 - beta1) * y
        if freeze is None or t < freeze:
            v_hat = (v := beta2 * v + (1 - beta2) * y * y) / (1 - beta2 ** t)
        w -= lr * n * (m / (1 - beta1 ** t)) / (np.sqrt(v_hat) + eps)
    return w


@pytest.mark.parametrize("wd", [0.0, 1e-3])
def test_adam_equals_its_float64_definition(wd):
    rng = np.random.default_rng(11)
    size = 1000
    w0 = rng.standard_normal(size)
    grads = [(rng.standard_normal(size) * n * 0.01, n) for n in (256, 512, 128, 256, 64)]
    grads[0][0][:5] = 0.0                        # a parameter without gradient: eps guards it
    want = adam_reference(w0, grads, 1e-4, wd=wd)
    # float64 kernels: the same arithmetic up to float64 rounding (a few ulps per step)
    for stripes in ([(0, size)], [(0, 300), (300, 300), (300, size)]):
        opt = Optimizer(size, kind="adam", weight_decay=wd, dtype=np.float64)
        w = w0.copy()
        for g, n in grads:
            g = g.copy()
            opt.begin_step(n, n)
            for lo, hi in stripes:
                opt.post_exchange(g, w, lo, hi)
            opt.apply(w, g, 1e-4)
        np.testing.assert_allclose(w, want, rtol=1e-12, atol=1e-14)
    fused = Optimizer(size, kind="adam", weight_decay=wd, dtype=np.float64)
    w = w0.copy()
    for g, n in grads:
        fused.step(w, g.copy(), 1e-4, n)
    np.testing.assert_allclose(w, want, rtol=1e-12, atol=1e-14)


def test_adam_refuses_adagrad_and_momentum_and_its_state_round_trips():
    with pytest.raises(ValueError, match="own moments"):
        Optimizer(10, kind="adam", adagrad="aggregate")
    with pytest.raises(ValueError, match="own moments"):
        Optimizer(10, kind="adam", momentum_time_constant=100.0)
    a, b = Optimizer(10, kind="adam"), Optimizer(10, kind="adam")
    w = np.ones(10, np.float32)
    for _ in range(3):
        a.begin_step(64, 64)
        a.post_exchange(np.full(10, 0.5, np.float32), w)
    b.load_state_dict(a.host_state_dict())
    assert b.adam_p == a.adam_p > 0 and b.sqr_weight == a.sqr_weight
    g1, g2 = np.full(10, 0.3, np.float32), np.full(10, 0.3, np.float32)
    for opt, g in ((a, g1), (b, g2)):
        opt.begin_step(64, 64)
        opt.post_exchange(g, w)
    np.testing.assert_array_equal(g1, g2)


@pytest.mark.parametrize("wd", [0.0, 1e-3])
def test_adam_with_its_second_moment_frozen_equals_its_definition(wd):
    """freeze_variance (optim.adam_freeze_variance, 1-bit Adam's rule): from the next step on
    the second moment and its bias correction stay; the first moment goes on. Fused and
    striped steps alike, to float64 rounding."""
    rng = np.random.default_rng(12)
    size = 600
    w0 = rng.standard_normal(size)
    grads = [(rng.standard_normal(size) * n * 0.01, n) for n in (256, 512, 128, 256, 64, 300)]
    want = adam_reference(w0, grads, 1e-4, wd=wd, freeze=4)
    assert not np.allclose(want, adam_reference(w0, grads, 1e-4, wd=wd), rtol=1e-6)
    for fused in (False, True):
        opt = Optimizer(size, kind="adam", weight_decay=wd, dtype=np.float64)
        w = w0.copy()
        for t, (g, n) in enumerate(grads, start=1):
            if t == 4:
                opt.freeze_variance()
                sqr, weight = opt.sqr.copy(), opt.sqr_weight
            if fused:
                opt.step(w, g.copy(), 1e-4, n)
            else:
                g = g.copy()
                opt.begin_step(n, n)
                for lo, hi in [(0, 250), (250, size)]:
                    opt.post_exchange(g, w, lo, hi)
                opt.apply(w, g, 1e-4)
        np.testing.assert_allclose(w, want, rtol=1e-12, atol=1e-14)
        assert np.array_equal(opt.sqr, sqr) and opt.sqr_weight == weight
    with pytest.raises(ValueError, match="Adam's second moment at the owner only"):
        Optimizer(10).freeze_variance()
    with pytest.raises(ValueError, match="Adam's second moment at the owner only"):
        Optimizer(10, kind="adam", adam_variance="local").freeze_variance()


# --- Adam's second moment on each rank's own gradient (optim.adam_variance=local) ---------------

def adam_local_reference(w, steps, lr, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0):
    """The optim docstring's "local" equations in float64: steps[t] is one (g_k, n_k) per
    rank; rank k's v_k from y_k = g_k / n_k (a rank without frames: y_k = 0), the sum of the
    normalised g_k plus decay, m of its per-sample mean, W -= lr * n * m / (1 - beta1^t)."""
    w = w.astype(np.float64).copy()
    m, v = np.zeros_like(w), np.zeros((len(steps[0]), w.size))
    for t, ranks in enumerate(steps, start=1):
        n = sum(nk for _, nk in ranks)
        x = wd * n * w
        for k, (g, nk) in enumerate(ranks):
            y = g / nk if nk else np.zeros_like(g)
            v[k] = beta2 * v[k] + (1 - beta2) * y * y
            x = x + g / (np.sqrt(v[k] / (1 - beta2 ** t)) + eps)
        m = beta1 * m + (1 - beta1) * x / n
        w -= lr * n * m / (1 - beta1 ** t)
    return w


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("wd", [0.0, 1e-3])
def test_adam_with_local_second_moments_equals_its_float64_definition(K, wd):
    """Each rank normalises its own gradient by its own second moment (pre_exchange), the
    owners of two stripes keep the first moment of the sum (post_exchange): to float64
    rounding, including a rank without frames in one step (its v decays, it sends zeros)."""
    rng = np.random.default_rng(13)
    size = 700
    w0 = rng.standard_normal(size)
    ns = [(256, 128, 64), (512, 0, 100), (128, 128, 128), (64, 300, 16)]
    steps = [[(rng.standard_normal(size) * n * 0.01 * (k + 1), n) for k, n in enumerate(row[:K])]
             for row in ns]
    steps[0][0][0][:5] = 0.0                     # never a gradient on rank 0: eps guards it
    want = adam_local_reference(w0, steps, 1e-4, wd=wd)
    assert not np.allclose(want, adam_reference(w0, [(sum(g for g, _ in r), sum(n for _, n in r))
                                                      for r in steps], 1e-4, wd=wd), rtol=1e-6)
    opts = [Optimizer(size, kind="adam", adam_variance="local", weight_decay=wd,
                      dtype=np.float64) for _ in range(K)]
    w = w0.copy()
    for ranks in steps:
        n = sum(nk for _, nk in ranks)
        total = np.zeros(size)
        for opt, (g, nk) in zip(opts, ranks):
            opt.begin_step(n, nk)
            g = g.copy()
            opt.pre_exchange(g)
            total += g
        for owner, (lo, hi) in enumerate([(0, 250), (250, size)]):   # stripes, 2 owners
            opts[owner % K].post_exchange(total, w, lo, hi)
        opts[0].apply(w, total, 1e-4)
    np.testing.assert_allclose(w, want, rtol=1e-11, atol=1e-14)
    assert opts[0].sqr.size == size and opts[0].local
    if K == 1:   # one process: the fused step is the same arithmetic
        fused = Optimizer(size, kind="adam", adam_variance="local", weight_decay=wd,
                          dtype=np.float64)
        w = w0.copy()
        for ((g, n),) in steps:
            fused.step(w, g.copy(), 1e-4, n)
        np.testing.assert_allclose(w, want, rtol=1e-11, atol=1e-14)
