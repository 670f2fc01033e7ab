"""The CTC loss kernels (hpcsgd.model.kernels_ctc): the float64 reference against brute-force
enumeration of alignments and against finite differences, the Numba CPU kernel against the
reference, and `hpcsgd bench ctc --small`.

Tolerances (float32 against the float64 reference) are derived, not tuned; u = 2^-24 is
float32's unit roundoff, X the largest |z + bias| of the batch, and for sequence b: f frames,
S = 2U + 1 states, L its loss.
- A log-probability lp = (z + b) - (max + log sum exp) is off by at most
  d_lp = u (9X + V + 4 ln V + 4): the rounding of z + b (uX), of each x - max (2uX) and of
  exp (CUDA's expf: 2 ulp = 4u) enter every term of the sum, V - 1 additions add (V - 1)u,
  log adds 2u ln V, and the roundings of max + log and of x - lse add u(3X + 2 ln V).
- A step alpha_t(s) = lse3(...) + lp rounds twice, each by u |alpha_t(s)|, and its log of a
  sum in [1, 3] is good to 10u. To first order the error of log Z is the sum of these
  errors weighted by dlogZ/dalpha_t(s) = gamma_t(s) (the posterior, summing to 1 over s),
  and gamma_t(s) |alpha_t(s)| summed over s is at most L + ln S (alpha_t(s) >= log Z +
  log gamma_t(s)). So per step u(2L + 2 ln S + 10) + d_lp, over f steps, plus the last
  log-sum-exp's u(L + 10):  tol_loss = u [f (2L + 2 ln S + 9X + V + 4 ln V + 14) + L + 10].
- A gradient entry exp(lp) - sum of gammas: each gamma's exponent holds one alpha and one beta
  (each within the analogue of tol_loss for that state) and log Z, and the state order of the
  subtractions adds u per state: tol_grad = scale (3 tol_loss + u (S + 4)).
The relative bound is thus ~ 2 f u (1 + (ln S + ...)/L): linear in the frames, as a
log-sum-exp chain over T steps must be.
"""
import itertools
import math
import sys

import numba
import numpy as np
import pytest

from hpcsgd.model import kernels as K
from hpcsgd.model import kernels_ctc as KC

U32 = 2.0 ** -24


def loss_tol(loss, frames, n_states, x_max, v):
    """The float32 kernels' bound on |loss - exact| per sequence (the module docstring)."""
    d = 2 * loss + 2 * np.log(n_states) + 9 * x_max + v + 4 * math.log(v) + 14
    return U32 * (frames * d + loss + 10)


def grad_tol(loss, frames, n_states, x_max, v, scale=1.0):
    """The bound on |grad - exact| per entry of sequence b's rows."""
    return scale * (3 * loss_tol(loss, frames, n_states, x_max, v) + U32 * (n_states + 4))


# ---------------------------------------------------------------------------------------------
# batches


def batch(rng, frames, targets, v, t_max=None, spread=3.0):
    """(z, bias, nb, frames, ids, tgt_offsets) for the given frames and targets, time-major,
    logits ~ spread * N(0, 1)."""
    nb = len(frames)
    t_max = t_max or max(max(frames), 1)
    ids = np.array([k for t in targets for k in t], np.int32)
    offsets = np.zeros(nb + 1, np.int64)
    offsets[1:] = np.cumsum([len(t) for t in targets])
    z = (rng.standard_normal((t_max * nb, v)) * spread).astype(np.float32)
    bias = rng.standard_normal((1, v)).astype(np.float32)
    return z, bias, nb, np.array(frames, np.int64), ids, offsets


def run_kernel(z, bias, nb, frames, ids, offsets, scale=1.0):
    """ctc_loss_grad on a copy of z: (grad, loss, feasible, alpha, beta, ws_offsets)."""
    ws = KC.workspace_offsets(frames, offsets)
    alpha = np.full(ws[-1], np.nan, np.float32)   # NaN: a value never written shows
    beta = np.full(ws[-1], np.nan, np.float32)
    loss = np.full(nb, np.nan)
    feasible = np.full(nb, 7, np.uint8)
    g = z.copy()
    KC.ctc_loss_grad(g, bias, nb, frames, ids, offsets, scale, ws, alpha, beta, loss, feasible)
    return g, loss, feasible, alpha, beta, ws


def random_target(rng, u, v, repeats=0.2):
    """u labels in 1..V-1, each a repeat of the one before with probability `repeats`."""
    t = []
    for _ in range(u):
        t.append(t[-1] if t and rng.random() < repeats else int(rng.integers(1, v)))
    return t


def mixed_batch(rng, v):
    """Sequences of different lengths sorted by frames: long targets with repeats, an empty
    target, an infeasible one (frames < U + repeats), frames 0, and padding."""
    t_max = 90
    specs = [(90, 40), (84, 31), (70, 0), (55, 12), (30, 29), (12, 4), (0, 3)]
    frames, targets = [], []
    for f, u in specs:
        frames.append(f)
        targets.append(random_target(rng, u, v))
    targets[4] = [1, 1, 1] + random_target(rng, 26, v)   # >= 2 repeats: 30 < 29 + repeats
    return batch(rng, frames, targets, v, t_max)


# ---------------------------------------------------------------------------------------------
# the reference


def brute_force_loss(lp, target):
    """-log of the summed probability of every path of len(lp) labels that collapses (merge
    repeats, drop blanks) to target: V^T paths; None if none does."""
    f, v = lp.shape
    total = 0.0
    for path in itertools.product(range(v), repeat=f):
        out = [k for i, k in enumerate(path) if k != KC.BLANK and (i == 0 or path[i - 1] != k)]
        if out == list(target):
            total += math.exp(sum(lp[t, k] for t, k in enumerate(path)))
    return -math.log(total) if total > 0 else None


@pytest.mark.parametrize("f,v,target", [
    (1, 2, []), (1, 3, [2]), (3, 2, [1, 1]), (2, 2, [1, 1]), (4, 3, [1, 2]), (5, 4, [3, 3, 1]),
    (6, 3, [2, 1, 2]), (6, 4, [1, 1, 1]), (5, 4, [1, 1, 1]), (6, 4, []), (3, 4, [1, 2, 3]),
])
def test_reference_equals_brute_force(f, v, target):
    rng = np.random.default_rng(f * 100 + v * 10 + len(target))
    z, bias, nb, frames, ids, off = batch(rng, [f], [target], v)
    loss, grad, feasible = KC.ref_ctc(z, bias, nb, frames, ids, off)
    want = brute_force_loss(KC.ref_log_softmax(z, bias), target)
    if want is None:                      # no path: the infeasible rule
        assert not feasible[0] and loss[0] == 0 and not grad.any()
        assert f < len(target) + sum(a == b for a, b in zip(target, target[1:]))
    else:
        assert feasible[0]
        assert loss[0] == pytest.approx(want, rel=1e-12)


def test_reference_gradient_by_central_differences():
    """dLoss/dz of the float64 reference, every entry of two sequences (one padded) with a
    repeat: h = 1e-5 leaves a truncation error h^2/6 |L'''| ~ 1e-11 and a rounding error
    ~ 1e-16 L / h ~ 1e-10, so 1e-7 is a safe bound."""
    rng = np.random.default_rng(3)
    z, bias, nb, frames, ids, off = batch(rng, [6, 4], [[1, 2, 2], [3]], 4)
    z = z.astype(np.float64)
    _, grad, _ = KC.ref_ctc(z, bias, nb, frames, ids, off)
    h = 1e-5
    num = np.zeros_like(z)
    for i, j in itertools.product(range(z.shape[0]), range(z.shape[1])):
        zp, zm = z.copy(), z.copy()
        zp[i, j] += h
        zm[i, j] -= h
        num[i, j] = (KC.ref_ctc(zp, bias, nb, frames, ids, off)[0].sum()
                     - KC.ref_ctc(zm, bias, nb, frames, ids, off)[0].sum()) / (2 * h)
    np.testing.assert_allclose(grad, num, rtol=0, atol=1e-7)
    assert not grad[4 * nb + 1:: nb].any()   # sequence 1's padded rows


def test_workspace_offsets():
    off = KC.workspace_offsets(np.array([5, 3, 0]), np.array([0, 2, 2, 7]))
    assert off.dtype == np.int64 and list(off) == [0, 25, 28, 28]


# ---------------------------------------------------------------------------------------------
# the CPU kernel against the reference


def check_against_reference(z, bias, nb, frames, ids, off, scale=1.0):
    """The kernel's loss, gradient and workspace against the reference, within the bounds."""
    g, loss, feasible, alpha, beta, ws = run_kernel(z, bias, nb, frames, ids, off, scale)
    ref_loss, ref_grad, ref_feasible = KC.ref_ctc(z, bias, nb, frames, ids, off)
    np.testing.assert_array_equal(feasible, ref_feasible.astype(np.uint8))
    lp = KC.ref_log_softmax(z, bias)
    v = z.shape[1]
    x_max = float(np.abs(z.astype(np.float64) + bias).max())
    t_max = z.shape[0] // nb
    for b in range(nb):
        f, u = int(frames[b]), int(off[b + 1] - off[b])
        rows = g[b::nb]
        if not ref_feasible[b]:
            assert loss[b] == 0 and not rows.any(), b     # infeasible: exactly 0
            continue
        assert not rows[f:].any(), b                       # padding: exactly 0
        tl = loss_tol(ref_loss[b], f, 2 * u + 1, x_max, v)
        assert abs(loss[b] - ref_loss[b]) <= tl, (b, loss[b], ref_loss[b], tl)
        tg = grad_tol(ref_loss[b], f, 2 * u + 1, x_max, v, scale)
        err = np.abs(rows[:f] - scale * ref_grad[b::nb][:f]).max()
        assert err <= tg, (b, err, tg)
        # the workspace holds alpha and beta: -inf exactly where they are (unreachable
        # states), and log Z = logsumexp_s(alpha_t + beta_t) at every step
        ra, rb, _ = KC.ref_alpha_beta(lp[b::nb][:f], ids[off[b]:off[b + 1]])
        a = alpha[ws[b]:ws[b + 1]].reshape(f, 2 * u + 1).astype(np.float64)
        bt = beta[ws[b]:ws[b + 1]].reshape(f, 2 * u + 1).astype(np.float64)
        np.testing.assert_array_equal(np.isneginf(a), np.isneginf(ra))
        np.testing.assert_array_equal(np.isneginf(bt), np.isneginf(rb))
        per_step = -np.logaddexp.reduce(a + bt, axis=1)
        assert np.abs(per_step - ref_loss[b]).max() <= 2 * tl
    assert t_max * nb == z.shape[0]
    return g, loss


@pytest.mark.parametrize("v", [5, 41, 500])
def test_cpu_kernel_equals_reference(v):
    rng = np.random.default_rng(v)
    z, bias, nb, frames, ids, off = mixed_batch(rng, v)
    g, loss = check_against_reference(z, bias, nb, frames, ids, off)
    assert loss[2] > 0 and loss[4] == 0 and loss[6] == 0     # empty target; infeasible; 0 frames


def test_feasibility_rule_at_its_edge():
    """frames = U + repeats is feasible (one path), one frame fewer is not; an empty target
    needs one frame."""
    rng = np.random.default_rng(7)
    targets = [[1, 1, 2, 2], [1, 1, 2, 2], [], []]
    z, bias, nb, frames, ids, off = batch(rng, [6, 5, 1, 0], targets, 3, t_max=6)
    g, loss, feasible, *_ = run_kernel(z, bias, nb, frames, ids, off)
    assert list(feasible) == [1, 0, 1, 0]
    check_against_reference(z, bias, nb, frames, ids, off)


def test_an_empty_batch_is_a_no_op():
    z = np.zeros((0, 5), np.float32)
    empty = np.zeros(0, np.int64)
    loss, feasible = np.zeros(0), np.zeros(0, np.uint8)
    KC.ctc_loss_grad(z, np.zeros((1, 5), np.float32), 0, empty, np.zeros(0, np.int32),
                     np.zeros(1, np.int64), 1.0, np.zeros(1, np.int64), np.zeros(0, np.float32),
                     np.zeros(0, np.float32), loss, feasible)


def test_scale_multiplies_the_gradient_exactly():
    rng = np.random.default_rng(11)
    z, bias, nb, frames, ids, off = mixed_batch(rng, 41)
    g1, loss1, *_ = run_kernel(z, bias, nb, frames, ids, off, 1.0)
    g256, loss256, *_ = run_kernel(z, bias, nb, frames, ids, off, 256.0)
    np.testing.assert_array_equal(g256, g1 * np.float32(256))
    np.testing.assert_array_equal(loss256, loss1)
    check_against_reference(z, bias, nb, frames, ids, off, scale=256.0)


def test_bits_do_not_depend_on_threads():
    rng = np.random.default_rng(12)
    z, bias, nb, frames, ids, off = mixed_batch(rng, 41)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run_kernel(z, bias, nb, frames, ids, off)
    finally:
        numba.set_num_threads(threads)
    many = run_kernel(z, bias, nb, frames, ids, off)
    for a, b in zip(one[:3], many[:3]):
        np.testing.assert_array_equal(a, b)


def test_logprobs_kernel_gives_the_same_loss_bits():
    """From the model's log-softmax output (kernels.log_softmax_forward, whose arithmetic the
    CTC kernel's in-place log-softmax repeats) the forward-only kernel gives ctc_loss_grad's
    loss bit for bit, and leaves its input alone."""
    rng = np.random.default_rng(13)
    for v in (5, 41, 500):
        z, bias, nb, frames, ids, off = mixed_batch(rng, v)
        _, loss, feasible, alpha, *_ = run_kernel(z, bias, nb, frames, ids, off)
        lp = z.copy()
        K.log_softmax_forward(lp, bias, np.zeros((lp.shape[0], K.LANES), np.float32))
        before = lp.copy()
        ws = KC.workspace_offsets(frames, off)
        alpha2 = np.full(ws[-1], np.nan, np.float32)
        loss2, feasible2 = np.full(nb, np.nan), np.zeros(nb, np.uint8)
        KC.ctc_loss_logprobs(lp, nb, frames, ids, off, ws, alpha2, loss2, feasible2)
        np.testing.assert_array_equal(loss2, loss)
        np.testing.assert_array_equal(feasible2, feasible)
        live = np.repeat(feasible.astype(bool), np.diff(ws))
        np.testing.assert_array_equal(alpha2[live], alpha[live])
        np.testing.assert_array_equal(lp, before)


def test_extreme_logits_give_finite_numbers():
    """Logits of +-80 over 500 labels: log-probabilities down to -160 - ln 500, far below
    fexp's floor; the loss and gradient stay finite and within the bound."""
    rng = np.random.default_rng(14)
    z, bias, nb, frames, ids, off = mixed_batch(rng, 500)
    z = np.where(rng.random(z.shape) < 0.5, -80.0, 80.0).astype(np.float32)
    bias[:] = 0
    g, loss = check_against_reference(z, bias, nb, frames, ids, off)
    assert np.isfinite(g).all() and np.isfinite(loss).all()
    lp = z.copy()
    K.log_softmax_forward(lp, bias, np.zeros((lp.shape[0], K.LANES), np.float32))
    ws = KC.workspace_offsets(frames, off)
    loss2 = np.zeros(nb)
    KC.ctc_loss_logprobs(lp, nb, frames, ids, off, ws, np.zeros(ws[-1], np.float32), loss2,
                         np.zeros(nb, np.uint8))
    np.testing.assert_array_equal(loss2, loss)


# ---------------------------------------------------------------------------------------------
# the benchmark's smoke test


def test_bench_ctc_small_runs_without_torch(monkeypatch, capsys):
    """`hpcsgd bench ctc --small` in process with PyTorch hidden (not a dependency): the table
    and the bandwidth figures, and a line saying the PyTorch column is skipped."""
    import argparse

    from hpcsgd.bench import ctc, report
    monkeypatch.setitem(sys.modules, "torch", None)    # `import torch` raises ImportError
    parser = argparse.ArgumentParser()
    ctc.add_arguments(parser)
    res = ctc.run(parser.parse_args(["--small", "--repeats", "1"]))
    out = capsys.readouterr().out
    assert "PyTorch is not installed" in out
    assert res["torch"] is None and res["triad_GBps"] > 0 and len(res["rows"]) >= 2
    for r in res["rows"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["frac_triad"] > 0 and r["vs_torch"] is None
        assert r["bytes"] == 8 * r["B"] * r["T"] * r["V"] + r["workspace_bytes"]
    figs = report.headline(ctc, report.clean(res))
    assert figs and all(math.isfinite(x) for x in figs.values())
