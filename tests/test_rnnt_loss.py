"""The RNN-T loss kernels (hpcsgd.model.kernels_rnnt): the float64 reference against brute-force
enumeration of alignments, finite differences and FastEmit's definition, and the Numba CPU
kernel against the reference.

Tolerances (float32 against the float64 reference) are derived, not tuned; u = 2^-24 is
float32's unit roundoff, X the largest |z| of the batch, and for utterance b: f frames, U
targets, D = f + U anti-diagonals (t + u = d) in its lattice, n = min(f, U + 1) nodes on the
longest one, L its loss. Every alignment crosses each diagonal at exactly one node, and
first-order errors reach log P weighted by posteriors (dlogP/dalpha(t, u) = gamma(t, u), the
node's occupancy; dlogP/dlp of an edge = the edge's posterior xi; each sums to 1 over a
diagonal). alpha, beta and the log-probabilities are <= 0, so alpha(t, u) >= log P + log gamma
and |alpha| <= L - log gamma (the same for beta and for an edge's alpha + lp).
- A log-probability lp = z - (max + log sum exp) is off by at most
  d_lp = u (9X + V + 4 ln V + 4): tests/test_ctc_loss.py's bound (it counts a bias add this
  kernel does not make): each x - max (2uX) and exp (CUDA's expf: 2 ulp = 4u) in every term
  of the sum, V - 1 additions, the log (2u ln V), and the roundings of max + log and x - lse.
- A diagonal's alphas: the two sums alpha + lp (u |alpha + lp| each), the log of a sum in
  [1, 2] (10u, as kernels_ctc's three-term one), the rounded result (u |alpha|), and the
  lp's d_lp; weighted by the posteriors: u (2L + 2 ln(2n) + 10) + d_lp per diagonal (the
  entropy of the edges into a diagonal is at most ln(2n)). Over D diagonals, plus the last
  sum's uL: tol_loss = D [u (2L + 2 ln(2n) + 11) + d_lp] + uL (11, not 10: the next item).
- The same argument on the sub-lattice that ends at (t, u) bounds alpha(t, u)'s error with
  -alpha(t, u) in place of L; an edge posterior e <= gamma of both its ends, and
  gamma (L - log gamma) <= L + 1/e, so e times the error of its exponent's alpha, beta or
  log P is at most tol_loss each (the 2u/e per diagonal is in its 11). With d_lp for the lp, the
  three roundings of the exponent (e (L - log e) <= L + 1/e each) and exp's 4u:
  E = 3 tol_loss + d_lp + u (3L + 7) bounds |e - exact| absolutely.
- A gradient entry p_k (e0 + lam1 ey) - [blank] e0 - [label] lam1 ey (lam1 = 1 + lam, rounded
  to float32): e0 and ey enter at most 3 (1 + lam) times, p_k's relative error is d_lp + 4u,
  and the products, sums and lam1's rounding add 11u (1 + lam) (every term is <= 1 + lam):
  tol_grad = scale (1 + lam) (3E + d_lp + 11u); the scale, a power of two, is exact.
The relative loss bound is thus ~ 2 D u (1 + (ln n + ...)/L): linear in the lattice's
diagonals, as a log-sum-exp chain of D steps must be.
"""
import itertools
import math

import numba
import numpy as np
import pytest

from hpcsgd.model import kernels_rnnt as KR

U32 = 2.0 ** -24


def lp_tol(x_max, v):
    return U32 * (9 * x_max + v + 4 * math.log(v) + 4)


def loss_tol(loss, f, u, x_max, v):
    """The float32 kernels' bound on |loss - exact| per utterance (the module docstring)."""
    n = min(f, u + 1)
    return (f + u) * (U32 * (2 * loss + 2 * math.log(2 * n) + 11) + lp_tol(x_max, v)) + U32 * loss


def grad_tol(loss, f, u, x_max, v, lam=0.0, scale=1.0):
    """The bound on |grad - exact| per entry of the utterance's rows."""
    d_lp = lp_tol(x_max, v)
    edge = 3 * loss_tol(loss, f, u, x_max, v) + d_lp + U32 * (3 * loss + 7)
    return scale * (1 + lam) * (3 * edge + d_lp + 11 * U32)


# ---------------------------------------------------------------------------------------------
# batches


def batch(rng, frames, targets, v, spread=3.0):
    """(z, frames, ids, tgt_offsets, row_offsets) for the given frames and targets, logits
    ~ spread * N(0, 1)."""
    ids = np.array([k for t in targets for k in t], np.int32)
    off = np.zeros(len(frames) + 1, np.int64)
    off[1:] = np.cumsum([len(t) for t in targets])
    frames = np.array(frames, np.int64)
    rows = KR.lattice_offsets(frames, np.diff(off))
    z = (rng.standard_normal((rows[-1], v)) * spread).astype(np.float32)
    return z, frames, ids, off, rows


def mixed_batch(rng, v):
    """Utterances of different shapes: long and short targets, one frame, repeats, an empty
    target (skipped) and frames 0 (infeasible)."""
    specs = [(30, 12), (25, 20), (12, 0), (1, 5), (7, 1), (0, 3), (18, 6)]
    targets = [[int(k) for k in rng.integers(1, v, u)] for _, u in specs]
    targets[1][3:6] = [2, 2, 2]
    return batch(rng, [f for f, _ in specs], targets, v)


def run_kernel(z, frames, ids, off, rows, scale=1.0, lam=0.0):
    """rnnt_loss_grad on a copy of z: (grad, loss, feasible, alpha, beta)."""
    alpha = np.full(rows[-1], np.nan, np.float32)    # NaN: a value never written shows
    beta = np.full(rows[-1], np.nan, np.float32)
    loss = np.full(len(frames), np.nan)
    feasible = np.full(len(frames), 7, np.uint8)
    g = z.copy()
    KR.rnnt_loss_grad(g, frames, ids, off, rows, scale, alpha, beta, loss, feasible, lam)
    return g, loss, feasible, alpha, beta


def lattice(z, rows, b, f, u):
    """Utterance b's rows as (f, U1, V)."""
    return z[rows[b]:rows[b + 1]].reshape(f, u + 1, z.shape[1])


# ---------------------------------------------------------------------------------------------
# the reference


def brute_force(lp, target):
    """Every alignment of the lattice lp (f, U1, V): the U label emissions placed among the
    first f + U - 1 symbols, the last symbol the final blank. -> (-log P, e0, ey): the loss
    and each node's blank and label edge posteriors (f, U1)."""
    f, u1, _ = lp.shape
    nu = u1 - 1
    e0, ey = np.zeros((f, u1)), np.zeros((f, u1))
    total = 0.0
    for labels in itertools.combinations(range(f + nu - 1), nu):
        t = u = 0
        logp, used = 0.0, []
        for i in range(f + nu):
            if i in labels:
                logp += lp[t, u, target[u]]
                used.append((ey, t, u))
                u += 1
            else:
                logp += lp[t, u, KR.BLANK]
                used.append((e0, t, u))
                t += 1
        assert (t, u) == (f, nu)
        p = math.exp(logp)
        total += p
        for arr, t, u in used:
            arr[t, u] += p
    return -math.log(total), e0 / total, ey / total


@pytest.mark.parametrize("f,u,v", [(1, 1, 2), (1, 3, 4), (2, 1, 3), (3, 2, 4), (4, 3, 5),
                                   (5, 1, 3), (2, 4, 6)])
def test_reference_equals_brute_force(f, u, v):
    rng = np.random.default_rng(f * 100 + u * 10 + v)
    target = [int(k) for k in rng.integers(1, v, u)]
    z, frames, ids, off, rows = batch(rng, [f], [target], v)
    lp = lattice(KR.ref_log_softmax(z, 0.0), rows, 0, f, u)
    want, w0, wy = brute_force(lp, target)
    loss, _, feasible = KR.ref_rnnt(z, frames, ids, off, rows)
    assert feasible[0] and loss[0] == pytest.approx(want, rel=1e-12)
    e0, ey, logp = KR.ref_edge_posteriors(lp, np.array(target))
    np.testing.assert_allclose(e0, w0, rtol=0, atol=1e-12)
    np.testing.assert_allclose(ey, wy, rtol=0, atol=1e-12)
    alpha, beta, _ = KR.ref_alpha_beta(lp, np.array(target))
    assert beta[0, 0] == pytest.approx(-want, rel=1e-12)


def test_reference_gradient_by_central_differences():
    """dLoss/dz of the float64 reference, every entry of two utterances and a skipped empty
    one: h = 1e-5 leaves a truncation error h^2/6 |L'''| ~ 1e-11 and a rounding error
    ~ 1e-16 L / h ~ 1e-10, so 1e-7 is a safe bound."""
    rng = np.random.default_rng(3)
    z, frames, ids, off, rows = batch(rng, [3, 2, 2], [[1, 3], [2], []], 4)
    z = z.astype(np.float64)
    _, grad, feasible = KR.ref_rnnt(z, frames, ids, off, rows)
    assert list(feasible) == [True, True, False]
    h = 1e-5
    num = np.zeros_like(z)
    for i, j in itertools.product(range(z.shape[0]), range(z.shape[1])):
        zp, zm = z.copy(), z.copy()
        zp[i, j] += h
        zm[i, j] -= h
        num[i, j] = (KR.ref_rnnt(zp, frames, ids, off, rows)[0].sum()
                     - KR.ref_rnnt(zm, frames, ids, off, rows)[0].sum()) / (2 * h)
    np.testing.assert_allclose(grad, num, rtol=0, atol=1e-7)
    assert not grad[rows[2]:].any()


def test_reference_fastemit_is_its_definition():
    """FastEmit: -log P differentiated (central differences) with respect to each
    log-probability as a free variable, the label emissions' derivatives times (1 + lam), the
    blanks' as they are, carried through the log-softmax (dz = dlp - p sum(dlp)); and
    NeMo's per-logit expression, grad_k = p_k occupancy + lam p_k ey - [blank] e0 -
    [label] (1 + lam) ey with occupancy = exp(alpha + beta - log P). h = 1e-6: a rounding
    error ~ 1e-16 L / h ~ 1e-9 per derivative, V = 5 of them summed by the Jacobian: 1e-8."""
    lam = 0.37
    rng = np.random.default_rng(4)
    f, u, v = 3, 2, 5
    z, frames, ids, off, rows = batch(rng, [f], [[4, 1]], v)
    z = z.astype(np.float64)
    _, grad, _ = KR.ref_rnnt(z, frames, ids, off, rows, lam)
    lp = lattice(KR.ref_log_softmax(z, 0.0), rows, 0, f, u)
    target = np.array([4, 1])

    def nll(x):
        return -KR.ref_alpha_beta(x, target)[2]
    h = 1e-6
    dlp = np.zeros_like(lp)
    for idx in itertools.product(range(f), range(u + 1), range(v)):
        xp, xm = lp.copy(), lp.copy()
        xp[idx] += h
        xm[idx] -= h
        dlp[idx] = (nll(xp) - nll(xm)) / (2 * h)
    for t, uu in itertools.product(range(f), range(u)):
        dlp[t, uu, target[uu]] *= 1 + lam
    want = dlp - np.exp(lp) * dlp.sum(axis=2, keepdims=True)
    np.testing.assert_allclose(lattice(grad, rows, 0, f, u), want, rtol=0, atol=1e-8)

    alpha, beta, logp = KR.ref_alpha_beta(lp, target)
    e0, ey, _ = KR.ref_edge_posteriors(lp, target)
    p = np.exp(lp)
    nemo = p * (np.exp(alpha + beta - logp) + lam * ey)[:, :, None]
    nemo[:, :, KR.BLANK] -= e0
    for t, uu in itertools.product(range(f), range(u)):
        nemo[t, uu, target[uu]] -= (1 + lam) * ey[t, uu]
    np.testing.assert_allclose(lattice(grad, rows, 0, f, u), nemo, rtol=0, atol=1e-12)


def test_lattice_offsets():
    off = KR.lattice_offsets(np.array([5, 3, 0, 2]), np.array([2, 0, 7, 1]))
    assert off.dtype == np.int64 and list(off) == [0, 15, 18, 18, 22]


# ---------------------------------------------------------------------------------------------
# the CPU kernel against the reference


def check_against_reference(z, frames, ids, off, rows, scale=1.0, lam=0.0):
    """The kernel's loss, gradient and workspace against the reference, within the bounds."""
    g, loss, feasible, alpha, beta = run_kernel(z, frames, ids, off, rows, scale, lam)
    ref_loss, ref_grad, ref_feasible = KR.ref_rnnt(z, frames, ids, off, rows, lam)
    np.testing.assert_array_equal(feasible, ref_feasible.astype(np.uint8))
    lp_all = KR.ref_log_softmax(z, 0.0)
    v = z.shape[1]
    x_max = float(np.abs(z).max()) if z.size else 0.0
    assert not np.isnan(loss).any() and not np.isnan(g).any()
    for b in range(len(frames)):
        f, u = int(frames[b]), int(off[b + 1] - off[b])
        mine = g[rows[b]:rows[b + 1]]
        if not ref_feasible[b]:
            assert loss[b] == 0 and not mine.any(), b                    # exactly 0
            assert np.isnan(alpha[rows[b]:rows[b + 1]]).all()             # not written
            continue
        tl = loss_tol(ref_loss[b], f, u, x_max, v)
        assert abs(loss[b] - ref_loss[b]) <= tl, (b, loss[b], ref_loss[b], tl)
        tg = grad_tol(ref_loss[b], f, u, x_max, v, lam, scale)
        err = np.abs(mine - scale * ref_grad[rows[b]:rows[b + 1]]).max()
        assert err <= tg, (b, err, tg)
        # the workspace holds alpha and beta (finite at every node), and every diagonal
        # t + u = d gives log P = logsumexp over its nodes of alpha + beta
        lp = lattice(lp_all, rows, b, f, u)
        ra, rb, _ = KR.ref_alpha_beta(lp, ids[off[b]:off[b + 1]].astype(np.int64))
        a = alpha[rows[b]:rows[b + 1]].reshape(f, u + 1).astype(np.float64)
        bt = beta[rows[b]:rows[b + 1]].reshape(f, u + 1).astype(np.float64)
        assert np.isfinite(a).all() and np.isfinite(bt).all()
        assert a[0, 0] == 0 and abs(bt[0, 0] + ref_loss[b]) <= tl
        tt, uu = np.indices((f, u + 1))
        for d in range(f + u):
            on = tt + uu == d
            assert abs(np.logaddexp.reduce((a + bt)[on]) + ref_loss[b]) <= 2 * tl, (b, d)
    return g, loss


@pytest.mark.parametrize("v,lam", [(5, 0.0), (41, 0.0), (300, 0.0), (41, 0.5)])
def test_cpu_kernel_equals_reference(v, lam):
    rng = np.random.default_rng(v)
    z, frames, ids, off, rows = mixed_batch(rng, v)
    g, loss = check_against_reference(z, frames, ids, off, rows, lam=lam)
    assert list(loss > 0) == [True, True, False, True, True, False, True]


def test_infeasible_utterances_give_zeros_and_no_nan():
    """Frames 0 (no rows), an empty target (f rows, zeroed), next to a feasible one; a batch
    of only infeasible utterances; an empty batch."""
    rng = np.random.default_rng(7)
    z, frames, ids, off, rows = batch(rng, [0, 4, 2, 3], [[1, 2], [], [1], []], 3)
    g, loss, feasible, alpha, _ = run_kernel(z, frames, ids, off, rows)
    assert list(feasible) == [0, 0, 1, 0] and loss[2] > 0
    assert list(loss[[0, 1, 3]]) == [0, 0, 0] and np.isfinite(g).all()
    assert not g[rows[1]:rows[2]].any() and not g[rows[3]:].any()
    check_against_reference(z, frames, ids, off, rows)
    z, frames, ids, off, rows = batch(rng, [0, 5], [[2], []], 3)
    g, loss, feasible, *_ = run_kernel(z, frames, ids, off, rows)
    assert not g.any() and not loss.any() and not feasible.any()
    z, frames, ids, off, rows = batch(rng, [], [], 3)
    g, loss, feasible, *_ = run_kernel(np.zeros((0, 3), np.float32), frames, ids, off, rows)
    assert g.shape == (0, 3) and loss.shape == (0,)


def test_scale_multiplies_the_gradient_exactly():
    rng = np.random.default_rng(11)
    z, frames, ids, off, rows = mixed_batch(rng, 41)
    for lam in (0.0, 0.25):
        g1, loss1, *_ = run_kernel(z, frames, ids, off, rows, 1.0, lam)
        g256, loss256, *_ = run_kernel(z, frames, ids, off, rows, 256.0, lam)
        np.testing.assert_array_equal(g256, g1 * np.float32(256))
        np.testing.assert_array_equal(loss256, loss1)
    check_against_reference(z, frames, ids, off, rows, scale=256.0, lam=0.25)


def test_fastemit_changes_only_the_gradient():
    """lambda = 0 is the default (the same bits); lambda > 0 leaves the loss (-log P) and the
    workspace alone and moves the gradient by lam (p ey - ey at the label) per node."""
    rng = np.random.default_rng(12)
    z, frames, ids, off, rows = mixed_batch(rng, 41)
    plain = run_kernel(z, frames, ids, off, rows)
    g = z.copy()
    alpha, beta = np.zeros(rows[-1], np.float32), np.zeros(rows[-1], np.float32)
    loss, feasible = np.zeros(len(frames)), np.zeros(len(frames), np.uint8)
    KR.rnnt_loss_grad(g, frames, ids, off, rows, 1.0, alpha, beta, loss, feasible)
    np.testing.assert_array_equal(g, plain[0])
    np.testing.assert_array_equal(loss, plain[1])
    fe = run_kernel(z, frames, ids, off, rows, lam=0.5)
    np.testing.assert_array_equal(fe[1], plain[1])
    live = np.repeat(plain[2].astype(bool), np.diff(rows))
    for a, b in zip(fe[3:], plain[3:]):
        np.testing.assert_array_equal(a[live], b[live])
    assert np.abs(fe[0] - plain[0]).max() > 1e-3


def test_a_packed_batch_equals_each_utterance_alone():
    rng = np.random.default_rng(13)
    z, frames, ids, off, rows = mixed_batch(rng, 41)
    g, loss, feasible, alpha, beta = run_kernel(z, frames, ids, off, rows, lam=0.1)
    for b in range(len(frames)):
        one_off = np.array([0, off[b + 1] - off[b]], np.int64)
        one_rows = np.array([0, rows[b + 1] - rows[b]], np.int64)
        one = run_kernel(z[rows[b]:rows[b + 1]], frames[b:b + 1], ids[off[b]:off[b + 1]],
                         one_off, one_rows, lam=0.1)
        np.testing.assert_array_equal(one[0], g[rows[b]:rows[b + 1]])
        assert one[1][0] == loss[b] and one[2][0] == feasible[b]
        if feasible[b]:
            np.testing.assert_array_equal(one[3], alpha[rows[b]:rows[b + 1]])
            np.testing.assert_array_equal(one[4], beta[rows[b]:rows[b + 1]])


def test_bits_do_not_depend_on_threads():
    rng = np.random.default_rng(14)
    z, frames, ids, off, rows = mixed_batch(rng, 41)
    threads = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = run_kernel(z, frames, ids, off, rows)
    finally:
        numba.set_num_threads(threads)
    many = run_kernel(z, frames, ids, off, rows)
    for a, b in zip(one[:3], many[:3]):
        np.testing.assert_array_equal(a, b)


def test_extreme_logits_give_finite_numbers():
    """Logits of +-80 over 300 labels: log-probabilities down to -160 - ln 300, far below
    fexp's floor; the loss and gradient stay finite and within the bound."""
    rng = np.random.default_rng(15)
    z, frames, ids, off, rows = mixed_batch(rng, 300)
    z = np.where(rng.random(z.shape) < 0.5, -80.0, 80.0).astype(np.float32)
    g, loss = check_against_reference(z, frames, ids, off, rows, lam=0.01)
    assert np.isfinite(g).all() and np.isfinite(loss).all()


# ---------------------------------------------------------------------------------------------
# the benchmark's smoke test


def test_bench_rnnt_small_runs_without_torchaudio(capsys):
    """`hpcsgd bench rnnt --small` without a torchaudio interpreter (it is never a
    dependency): the table, the bandwidth figures, ours' exact memory, and a line saying the
    torchaudio columns are skipped."""
    import argparse

    from hpcsgd.bench import report, rnnt
    parser = argparse.ArgumentParser()
    rnnt.add_arguments(parser)
    res = rnnt.run(parser.parse_args(["--small", "--repeats", "1"]))
    assert "torchaudio's columns are skipped" in capsys.readouterr().out
    assert len(res["rows"]) == 2
    for r in res["rows"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["frac_triad"] > 0
        assert r["vs_torchaudio"] is None and r["bytes"] == (16 * r["V"] + 8) * r["nodes"]
        assert r["memory_bytes"] == (4 * r["V"] + 8) * r["nodes"]
    figs = report.headline(rnnt, report.clean(res))
    assert figs and all(math.isfinite(x) for x in figs.values())
