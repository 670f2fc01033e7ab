"""The RNN-Transducer loss (Graves 2012) and its gradient with respect to the joint network's
logits, fused per utterance (warp-transducer's "function merging", Li et al. 2019: the
log-softmax computed in place, the gradient written in place of the logits), on the CPU
(Numba), and the float64 NumPy reference the CPU and CUDA kernels (kernels_rnnt_cuda.py) are
tested against.

Shape key: B = len(frames) utterances, V = labels (blank = 0), f = frames[b] encoder steps of
utterance b, U = its target length, U1 = U + 1; its lattice has f x U1 nodes (t, u),
0 <= t < f, 0 <= u <= U, each a row of V logits. Packed, no padding: z (N, V) holds the rows
of every utterance, utterance b's from row_offsets[b] = lattice_offsets(...)[b], node (t, u)
at row row_offsets[b] + t*U1 + u; N = row_offsets[-1]. Targets are concatenated as in
kernels_ctc: utterance b's are y_1..y_U = ids[tgt_offsets[b]:tgt_offsets[b+1]] (int32,
1..V-1). The float32 workspaces alpha and beta hold one value per node, indexed like the rows
(alpha[r] is node r's), so row_offsets sizes them too. Losses and gradients are SUMS over
utterances (a loss per utterance; each utterance's rows are its own).

The recursion, in log space, with lp(t, u, k) = log softmax(z[row of (t, u)])[k]:

    alpha(0, 0) = 0
    alpha(t, u) = logsumexp(alpha(t-1, u) + lp(t-1, u, blank), alpha(t, u-1) + lp(t, u-1, y_u))
    beta(t, u)  = logsumexp(beta(t+1, u) + lp(t, u, blank), beta(t, u+1) + lp(t, u, y_{u+1}))
                  with beta(f, U) = 0 (the final blank leaves the lattice), other terms outside
                  the lattice -inf: beta INCLUDES the node's own outgoing emission
                  (warp-transducer's convention, not kernels_ctc's)
    log P = alpha(f-1, U) + lp(f-1, U, blank) = beta(0, 0),   loss = -log P
    e0(t, u) = exp(alpha(t, u) + lp(t, u, blank) + beta(t+1, u) - log P)   blank edge posterior
    ey(t, u) = exp(alpha(t, u) + lp(t, u, y_{u+1}) + beta(t, u+1) - log P) label edge (u < U)
    dLoss/dlp(t, u, blank) = -e0,  dLoss/dlp(t, u, y_{u+1}) = -(1 + lam) ey,  0 elsewhere
    dLoss/dz(t, u, k) = p_k (e0 + (1 + lam) ey) - [k = blank] e0 - [k = y_{u+1}] (1 + lam) ey

with p_k = exp(lp(t, u, k)) (the last line is the log-softmax's Jacobian applied to the one
before). lam is FastEmit's lambda (Yu et al. 2021, arXiv:2010.11148, eqs. 9-10): the gradient
of every label emission's log-probability scaled by (1 + lam), the blanks' left alone; lam = 0
is plain RNN-T. This is warp-transducer's and NeMo's definition (NeMo's Numba
compute_grad_kernel: grad_k = p_k occupancy + lam p_k ey - [blank] e0 - [label] (1 + lam) ey,
the same expression since the occupancy alpha + beta - log P is e0 + ey). It is a gradient
modification, not the gradient of a scalar: the loss returned here is the plain -log P
whatever lam (NeMo reports (1 + lam)(-log P); multiply if that figure is wanted).

Every node of the lattice is on some alignment, so alpha and beta are finite for finite
logits; -inf enters only as the absent term at the lattice's edges. The log-sum-exp is
kernels_ctc's (max-subtracted, -inf safe: an all -inf input gives -inf, no NaN from any input;
its third term -inf here, one wasted exp per call). alpha and beta are float32 (the caller's
workspace, one value per node each), the loss float64.

In place, two passes over the utterance's rows:
- forward, rows in memory order: row (t, u) -> its log-softmax, then alpha(t, u) (its two
  predecessors' rows, (t-1, u) and (t, u-1), come earlier in memory: already normalised);
- backward, rows in reverse order: beta(t, u) (the last reader of the row's log-probabilities),
  the two edge posteriors, then the row -> scale * its gradient.
No log-sum-exp per row is kept: the log-softmax replaces the logits, so z is read and written
twice (16 bytes per logit) against the 12 of a variant that keeps each row's log-sum-exp
in a third workspace (f*U1 floats) and writes z once; the log-probabilities never take
memory of their own (another N*V floats, as large as z).

Cost per node: 2V exps (softmax, gradient; vectorized over V) and a log, against two
log-sum-exps (alpha, beta: 3 exps and a log each, scalar calls) and two exps (the edge
posteriors): by count the lattice recursion is ~1 % of the exps at V = 500 (not timed).
Utterances run in parallel (prange); inside one, nodes run in order (alpha(t, u) needs
alpha(t, u-1)).

Infeasible utterances: f < 1, or an empty target (U = 0: feasible in RNN-T, all blanks, but
skipped here as the issue asks): loss 0, every row 0, feasible[b] = 0, workspace not written.

The CUDA twin (kernels_rnnt_cuda.py) is the same arithmetic with one thread block per
utterance: block reductions for each row's softmax, the anti-diagonal wavefront (nodes with
t + u = d in parallel, a barrier per diagonal) for alpha and beta; CUDA's exp and log, another
softmax summation order: the two agree to a bound (tests/test_rnnt_cuda.py), not bit for bit.
"""
import math

import numpy as np
from numba import njit, prange

from hpcsgd.model.kernels import fexp, log_softmax_inplace
from hpcsgd.model.kernels_ctc import BLANK, _lse3_call, _scratch, ref_log_softmax

_f = np.float32
_NEG_INF, _ZERO = _f(-np.inf), _f(0)


def lattice_offsets(frames, tgt_lengths):
    """Row offsets of each utterance's lattice in z (and in the alpha and beta workspaces):
    utterance b owns frames[b] * (tgt_lengths[b] + 1) rows from offsets[b]; offsets[-1] is
    the number of rows. Infeasible utterances keep their rows (zeroed by the kernel)."""
    frames = np.asarray(frames, np.int64)
    u1 = np.asarray(tgt_lengths, np.int64) + 1
    out = np.zeros(len(frames) + 1, np.int64)
    np.cumsum(frames * u1, out=out[1:])
    return out


def feasible_rule(u, f):
    """Is utterance (U = u targets, f frames) trained: f >= 1 and U >= 1? (Plain Python,
    compiled for the CPU kernel here and for the CUDA one.)"""
    return f >= 1 and u >= 1


_feasible = njit(inline="always")(feasible_rule)


@njit(inline="always")
def _grad_row(row, v, lp0, lpy, y, e0, ey, lam1, sc):
    """row (V,): log-probabilities in, sc * (p (e0 + lam1 ey) - e0 at blank - lam1 ey at y)
    out; y < 0: no label edge (u = U). Each entry is rounded to float32 (fexp of a float32 is
    a float64), then scaled: a power of two, so exact even where the entry is subnormal."""
    c = e0 + lam1 * ey
    for k in range(v):                          # vectorized
        row[k] = _f(fexp(row[k]) * c) * sc
    row[BLANK] = _f(fexp(lp0) * c - e0) * sc
    if y >= 0:
        row[y] = _f(fexp(lpy) * c - lam1 * ey) * sc


# ---------------------------------------------------------------------------------------------
# the kernel


@njit(parallel=True, cache=True)
def rnnt_loss_grad(z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, loss,
                   feasible, fastemit_lambda=0.0):
    """z (N, V) float32: the joint's logits in, scale * dLoss/dz out (in place). frames (B,)
    int64; ids int32 and tgt_offsets (B+1,) int64: the targets; row_offsets (B+1,) int64 =
    lattice_offsets(frames, target lengths); scale: the loss scale (a power of two: the
    gradient's bits are scale times the unscaled ones). alpha, beta: float32 workspaces of N
    values each, out (log alpha, log beta per node). loss (B,) float64 out: -log P per
    utterance (0 where infeasible); feasible (B,) uint8 out. fastemit_lambda: FastEmit's
    lambda (0: plain RNN-T). Allocates nothing."""
    nb = frames.shape[0]
    v = z.shape[1]
    sc = _f(scale)
    lam1 = _f(1.0 + fastemit_lambda)
    for b in prange(nb):
        lane = _scratch()[0]
        f = frames[b]
        off = tgt_offsets[b]
        nu = tgt_offsets[b + 1] - off
        u1 = nu + 1
        r0 = row_offsets[b]
        if not _feasible(nu, f):
            z[r0:row_offsets[b + 1], :] = 0
            loss[b] = 0.0
            feasible[b] = 0
            continue
        # forward: each row's log-softmax, then its node's alpha
        for t in range(f):
            for u in range(u1):
                r = r0 + t * u1 + u
                log_softmax_inplace(z[r], v, lane)
                if t == 0 and u == 0:
                    alpha[r] = _ZERO
                    continue
                stay = alpha[r - u1] + z[r - u1, BLANK] if t > 0 else _NEG_INF
                emit = alpha[r - 1] + z[r - 1, ids[off + u - 1]] if u > 0 else _NEG_INF
                alpha[r] = _lse3_call(stay, emit, _NEG_INF)
        last = r0 + f * u1 - 1
        logp = alpha[last] + z[last, BLANK]
        # backward: beta, the edge posteriors, the row's gradient
        for t in range(f - 1, -1, -1):
            for u in range(nu, -1, -1):
                r = r0 + t * u1 + u
                row = z[r]
                a = alpha[r]
                lp0 = row[BLANK]
                if t < f - 1:
                    b_next = beta[r + u1]              # beta(t+1, u)
                else:
                    b_next = _ZERO if u == nu else _NEG_INF
                y, lpy, b_up = -1, _NEG_INF, _NEG_INF
                if u < nu:
                    y = ids[off + u]
                    lpy = row[y]
                    b_up = beta[r + 1]                 # beta(t, u+1)
                beta[r] = _lse3_call(lp0 + b_next, lpy + b_up, _NEG_INF)
                e0 = _f(fexp(((a + lp0) + b_next) - logp)) if b_next != _NEG_INF else _ZERO
                ey = _f(fexp(((a + lpy) + b_up) - logp)) if y >= 0 else _ZERO
                _grad_row(row, v, lp0, lpy, y, e0, ey, lam1, sc)
        loss[b] = -np.float64(logp)
        feasible[b] = 1


# ---------------------------------------------------------------------------------------------
# NumPy reference (float64; clarity first)


def ref_alpha_beta(lp, target):
    """One utterance: lp (f, U1, V) float64 log-probabilities, target (U,) -> alpha, beta
    (f, U1) in log space (beta with the node's own emission) and log P."""
    f, u1, _ = lp.shape
    blank = lp[:, :, BLANK]
    label = np.full((f, u1), -np.inf)               # lp(t, u, y_{u+1}), -inf at u = U
    label[:, :-1] = lp[:, np.arange(u1 - 1), target]
    alpha = np.full((f, u1), -np.inf)
    beta = np.full((f, u1), -np.inf)
    for t in range(f):
        for u in range(u1):
            if t == 0 and u == 0:
                alpha[t, u] = 0.0
                continue
            stay = alpha[t - 1, u] + blank[t - 1, u] if t else -np.inf
            emit = alpha[t, u - 1] + label[t, u - 1] if u else -np.inf
            alpha[t, u] = np.logaddexp(stay, emit)
    for t in range(f - 1, -1, -1):
        for u in range(u1 - 1, -1, -1):
            nxt = beta[t + 1, u] if t < f - 1 else (0.0 if u == u1 - 1 else -np.inf)
            up = beta[t, u + 1] if u < u1 - 1 else -np.inf
            beta[t, u] = np.logaddexp(nxt + blank[t, u], up + label[t, u])
    return alpha, beta, alpha[f - 1, u1 - 1] + blank[f - 1, u1 - 1]


def ref_edge_posteriors(lp, target):
    """-> (e0, ey, log P): the posteriors (f, U1) of each node's blank and label edges (ey 0
    at u = U)."""
    f, u1, _ = lp.shape
    alpha, beta, logp = ref_alpha_beta(lp, target)
    nxt = np.full((f, u1), -np.inf)                 # beta(t+1, u), 0 past the final blank
    nxt[:-1] = beta[1:]
    nxt[-1, -1] = 0.0
    up = np.full((f, u1), -np.inf)                  # beta(t, u+1)
    up[:, :-1] = beta[:, 1:]
    label = np.full((f, u1), -np.inf)
    label[:, :-1] = lp[:, np.arange(u1 - 1), target]
    e0 = np.exp(alpha + lp[:, :, BLANK] + nxt - logp)
    ey = np.exp(alpha + label + up - logp)
    return e0, ey, logp


def ref_rnnt(z, frames, ids, tgt_offsets, row_offsets, fastemit_lambda=0.0):
    """-> (loss (B,) float64, grad (N, V) float64 = the (FastEmit) gradient w.r.t. z,
    feasible (B,) bool). Infeasible utterances: loss 0, grad 0."""
    lp_all = ref_log_softmax(z, 0.0)
    nb, v = len(frames), z.shape[1]
    loss = np.zeros(nb)
    grad = np.zeros_like(lp_all)
    feasible = np.zeros(nb, bool)
    for b in range(nb):
        f, u = int(frames[b]), int(tgt_offsets[b + 1] - tgt_offsets[b])
        if not feasible_rule(u, f):
            continue
        target = np.asarray(ids[tgt_offsets[b]:tgt_offsets[b + 1]], np.int64)
        lp = lp_all[row_offsets[b]:row_offsets[b + 1]].reshape(f, u + 1, v)
        e0, ey, logp = ref_edge_posteriors(lp, target)
        g = np.zeros_like(lp)                       # dLoss/dlp
        g[:, :, BLANK] = -e0
        tt, uu = np.meshgrid(np.arange(f), np.arange(u), indexing="ij")
        g[tt, uu, target[uu]] -= (1.0 + fastemit_lambda) * ey[:, :-1]
        g = g - np.exp(lp) * g.sum(axis=2, keepdims=True)   # through the log-softmax
        grad[row_offsets[b]:row_offsets[b + 1]] = g.reshape(-1, v)
        loss[b] = -logp
        feasible[b] = True
    return loss, grad, feasible
