"""The CTC loss and its gradient with respect to the logits, fused per utterance (warp-ctc's
contract: one call, the caller's workspace), on the CPU (Numba), and the float64 NumPy
reference the CPU and CUDA kernels (kernels_ctc_cuda.py) are tested against.

Shape key: B = nb sequences, T = z.shape[0] // nb padded time steps, V = labels (blank = 0),
f = frames[b] <= T the valid steps of sequence b, U = its target length, S = 2U + 1 its states
(blank, l1, blank, l2, ..., lU, blank). Logits are time-major rows: row t*B + b of z (T*B, V)
is step t of sequence b; rows t >= f are padding. Targets are concatenated: sequence b's are
ids[tgt_offsets[b]:tgt_offsets[b+1]] (int32, values 1..V-1). Losses and gradients are SUMMED
over sequences.

The recursion (Graves et al. 2006; warp-ctc's CPU kernel), in log space, with
lp[t, k] = log softmax(z + bias)[t*B + b, k] and l'_s the label of state s:

    alpha_0(0) = lp[0, blank], alpha_0(1) = lp[0, l1], alpha_0(s > 1) = -inf
    alpha_t(s) = logsumexp(alpha_{t-1}(s), alpha_{t-1}(s-1), [alpha_{t-1}(s-2)]) + lp[t, l'_s]
    beta_{f-1}(S-1) = beta_{f-1}(S-2) = 0, else -inf      (beta WITHOUT the emission at t)
    beta_t(s) = logsumexp over s' in {s, s+1, [s+2]} of beta_{t+1}(s') + lp[t+1, l'_s']
    log Z = logsumexp(alpha_{f-1}(S-1), alpha_{f-1}(S-2)),  loss = -log Z
    gamma_t(s) = exp(alpha_t(s) + beta_t(s) - log Z)       (the posterior of state s at t)
    dLoss/d(z + bias)[t, k] = exp(lp[t, k]) - sum of gamma_t(s) over the states s labelled k

where [s-2] (and [s+2]) is a skip over a blank, allowed only between different labels. The
log-sum-exp is max + log(sum of exp(x - max)), -inf handled (an all -inf input gives -inf), so
no input gives a NaN or an Inf. alpha and beta are float32 (the workspace, S*f values each per
sequence, is the kernel's only memory beyond z); the loss is returned in float64.

In place: each valid row of z goes logits -> log-softmax -> scale * gradient, so the kernel
reads the logits once and writes the gradient once and the log-probabilities never take memory
of their own (they would be another T*B*V floats, as large as z). The beta pass runs from the
last step back, turning row t+1 into its gradient as soon as beta_t, the last reader of its
log-probabilities, is done. Padded rows are set to 0.

Cost per sequence: about 2*f*V exps for the softmax and the gradient, 2*f*S three-way
log-sum-exps (3 exps and a log each) for alpha and beta, f*S exps for the gammas, and
2*f*S*4 bytes of workspace written and read: compute-bound (a few % of the memory bandwidth,
`hpcsgd bench ctc`). Sequences run in parallel (prange), each one's steps in order (the
recursion is sequential in t); within a step the states run in vectorized chunks (below).

Infeasible sequences: an alignment needs at least U + r steps (r = adjacent equal pairs in the
target: a blank must separate them). A sequence with frames[b] < U + r, or frames[b] == 0, has
no alignment: its loss is 0, its rows (padding included) 0, feasible[b] = 0, and its
workspace is not written. An empty target (U = 0) with frames >= 1 is feasible (all blanks).

The CUDA twin (kernels_ctc_cuda.py) is the same recursion with one thread block per sequence:
threads over the states for alpha and beta (a barrier per step) and over V for each row's
softmax (block reductions in a fixed order) and gradient (thread k subtracts the gammas of the
states labelled k in state order, as this kernel does); exp and log are CUDA's (libdevice)
instead of `fexp`, the Cephes logf below and libm's logf, the softmax sum is added in another
order, and the log-softmax is never stored (16-bit z holds only the final gradient), so the
two agree to a bound (tests/test_ctc_cuda.py), not bit for bit.
"""
import math

import numpy as np
from llvmlite import ir
from numba import carray, njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

from hpcsgd.codecs.common import f32_bits, f32_from_bits
from hpcsgd.model.kernels import LANES, fexp, log_softmax_row

BLANK = 0
CHUNK = 64   # states per vectorized sub-loop (the size of the per-thread stack scratch below)
_f = np.float32
_NEG_INF, _ZERO, _ONE, _HALF = _f(-np.inf), _f(0), _f(1), _f(0.5)
_LOWEST = _f(np.finfo(np.float32).min)


def workspace_offsets(frames, tgt_offsets):
    """Offsets of each sequence's alpha (and beta) block in the float32 workspaces: sequence b
    owns frames[b] * (2 U_b + 1) values from offsets[b]; offsets[-1] is the size to allocate."""
    frames = np.asarray(frames, np.int64)
    u = np.diff(np.asarray(tgt_offsets, np.int64))
    out = np.zeros(len(frames) + 1, np.int64)
    np.cumsum(frames * (2 * u + 1), out=out[1:])
    return out


# ---------------------------------------------------------------------------------------------
# Vectorizable pieces. Per state, a step costs 3 exps and a log; libm's logf is a scalar call
# (no SVML here), and a loop that gathers log-probabilities by label while it stores alpha
# cannot vectorize (LLVM cannot prove the gather misses the stores). So the log is the Cephes
# polynomial below, and each step runs in chunks of CHUNK states: a scalar pass gathers the
# chunk's emissions and skip flags into a per-thread stack scratch, then a unit-stride pass
# does the log-sum-exps (16 lanes on AVX-512). Without fastmath LLVM contracts nothing into an
# FMA, so the bits are the same scalar or vectorized, on AVX2 and AVX-512, Intel and AMD.

_SCRATCH = LANES + 2 * (CHUNK + 2)


@intrinsic
def _stack_scratch(typingctx):
    """A pointer to _SCRATCH float32 on the calling thread's stack: an alloca in the compiled
    function's entry block (once per call of the prange body's function, freed on return):
    scratch without an allocation."""
    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=_SCRATCH)
    return types.CPointer(types.float32)(), codegen


# logf: Cephes' (range reduction to [sqrt(1/2), sqrt(2)), degree-9 polynomial), within 8.3e-8
# (1.4 u) of log on [1, 4]: the arguments here are sums of three exps, the largest exactly 1
# (or fexp's floor thrice when every term is -inf, whose log only has to be finite)
_SQRT2 = _f(1.41421356237)
_L = tuple(_f(c) for c in (7.0376836292e-2, -1.1514610310e-1, 1.1676998740e-1,
                           -1.2420140846e-1, 1.4249322787e-1, -1.6668057665e-1,
                           2.0000714765e-1, -2.4999993993e-1, 3.3333331174e-1))
_LN2_LO, _LN2_HI = _f(-2.12194440e-4), _f(0.693359375)


@njit(inline="always")
def _logf(x):
    """log(x) for a positive normal float32 x, vectorizable."""
    bits = f32_bits(x)
    e = (bits >> np.int32(23)) - np.int32(127)
    m = f32_from_bits((bits & np.int32(0x7FFFFF)) | np.int32(0x3F800000))   # [1, 2)
    big = m > _SQRT2
    m = m * _HALF if big else m
    e = e + np.int32(1) if big else e
    f = m - _ONE
    z = f * f
    y = _L[0] * f + _L[1]
    y = y * f + _L[2]
    y = y * f + _L[3]
    y = y * f + _L[4]
    y = y * f + _L[5]
    y = y * f + _L[6]
    y = y * f + _L[7]
    y = y * f + _L[8]
    y = y * f * z
    fe = _f(e)
    y = y + fe * _LN2_LO
    y = y - _HALF * z
    return (f + y) + fe * _LN2_HI


@njit(inline="always")
def _lse3(a, b, c):
    """log(exp(a) + exp(b) + exp(c)) in float32: the max plus the log of a sum in [1, 3] (the
    max's own term is fexp(0) = 1 exactly), so the log's absolute error is an ulp of ~1.
    Branch-free (it vectorizes): with every term -inf the max stands in as -FLT_MAX, the sum
    is fexp's floor 3 x 1.6e-38, its log finite, the result -inf. No NaN from any input."""
    m = max(a, max(b, c))
    ms = max(m, _LOWEST)
    return m + _logf(fexp(a - ms) + fexp(b - ms) + fexp(c - ms))


# the scalar call sites (a step's state 1, log Z): one compiled function, not inlined twice
# (each inlined copy of the exps and the log adds seconds to the kernels' compile time)
_lse3_call = njit(_lse3.py_func)


def feasible_rule(ids, off, u, f):
    """Has the sequence an alignment: f >= 1 and f >= U + (adjacent equal target pairs)?
    (Plain Python, compiled for the CPU kernels here and for the CUDA ones.)"""
    repeats = 0
    for i in range(1, u):
        if ids[off + i] == ids[off + i - 1]:
            repeats += 1
    return f >= 1 and f >= u + repeats


_feasible = njit(inline="always")(feasible_rule)


@njit(inline="always")
def _label(ids, off, s):
    """The label of state s: blank for even s, the (s // 2)-th target for odd s."""
    return BLANK if s % 2 == 0 else ids[off + s // 2]


@njit(inline="always")
def _skip_term(ids, off, s):
    """0 where an alignment may enter state s from s - 2 (a label state, not the first, unlike
    the label before it), else -inf: added to alpha_{t-1}(s-2), it drops that term."""
    if s % 2 == 1 and s >= 3 and ids[off + s // 2] != ids[off + s // 2 - 1]:
        return _ZERO
    return _NEG_INF


@njit(inline="always")
def _live(ns, f, t):
    """(lo, hi): the states that can carry probability at step t, reachable from the start
    (s <= 2t + 1) and able to reach the end in the f - 1 - t steps left (s >= S - 2(f - t));
    outside them alpha_t or beta_t is -inf."""
    return max(0, ns - 2 * (f - t)), min(ns, 2 * t + 2)


@njit(inline="always")
def _scratch():
    """(lane, em, sk): this thread's stack scratch, LANES and twice CHUNK + 2 float32."""
    scratch = carray(_stack_scratch(), _SCRATCH)
    return (scratch[:LANES], scratch[LANES:LANES + CHUNK + 2],
            scratch[LANES + CHUNK + 2:])


@njit(inline="always")
def _alpha_pass(lp, nb, b, f, ids, off, u, alpha, a0, em, sk):
    """alpha_t(s) into alpha[a0 + t*S + s] for t < f from the log-probabilities lp (rows
    t*nb + b); returns log Z (float32). States above 2t + 1 are unreachable at t: -inf without
    arithmetic. em, sk: CHUNK-value scratch."""
    ns = 2 * u + 1
    for s in range(ns):
        alpha[a0 + s] = _NEG_INF
    alpha[a0] = lp[b, BLANK]
    if ns > 1:
        alpha[a0 + 1] = lp[b, ids[off]]
    for t in range(1, f):
        row = lp[t * nb + b]
        prev = alpha[a0 + (t - 1) * ns:a0 + t * ns]
        cur = alpha[a0 + t * ns:a0 + (t + 1) * ns]
        hi = _live(ns, f, t)[1]
        cur[0] = prev[0] + row[BLANK]          # _lse3(prev[0], -inf, -inf) is prev[0]
        if hi > 1:
            cur[1] = _lse3_call(prev[1], prev[0], _NEG_INF) + row[ids[off]]
        for c0 in range(2, hi, CHUNK):
            c1 = min(hi, c0 + CHUNK)
            for s in range(c0, c1):            # gathers: scalar
                em[s - c0] = row[_label(ids, off, s)]
                sk[s - c0] = _skip_term(ids, off, s)
            for s in range(c0, c1):            # unit stride: vectorized
                cur[s] = _lse3(prev[s], prev[s - 1], prev[s - 2] + sk[s - c0]) + em[s - c0]
        for s in range(hi, ns):
            cur[s] = _NEG_INF
    last = alpha[a0 + (f - 1) * ns:a0 + f * ns]
    if ns == 1:
        return last[0]
    return _lse3_call(last[ns - 1], last[ns - 2], _NEG_INF)


@njit(inline="always")
def _beta_step(lp_next, ids, off, ns, nxt, cur, lo, em, sk):
    """beta_t (cur, S values) from beta_{t+1} (nxt) and the log-probabilities of step t+1;
    states below lo cannot reach the end in time: -inf."""
    for s in range(lo):
        cur[s] = _NEG_INF
    for c0 in range(lo, ns, CHUNK):
        c1 = min(ns, c0 + CHUNK)
        for j in range(c0, c1 + 2):            # the chunk and the two states after it
            if j < ns:
                em[j - c0] = nxt[j] + lp_next[_label(ids, off, j)]
                sk[j - c0] = _skip_term(ids, off, j)
            else:
                em[j - c0] = _NEG_INF
                sk[j - c0] = _NEG_INF
        for s in range(c0, c1):
            i = s - c0
            cur[s] = _lse3(em[i], em[i + 1], em[i + 2] + sk[i + 2])


@njit(inline="always")
def _grad_row(row, v, ids, off, al, be, lo, hi, logz, scale, em):
    """row (V,): its log-probabilities in, scale * (softmax - sum of the gammas per label) out.
    al, be: this step's alpha and beta; only states lo <= s < hi can have a nonzero gamma.
    Each label's gammas are subtracted in state order (the CUDA kernel's order too)."""
    for k in range(v):
        row[k] = fexp(row[k])
    for c0 in range(lo, hi, CHUNK):
        c1 = min(hi, c0 + CHUNK)
        for s in range(c0, c1):                # the exps: vectorized
            em[s - c0] = fexp(al[s] + be[s] - logz)
        for s in range(c0, c1):                # the scatter (labels repeat): scalar
            row[_label(ids, off, s)] -= em[s - c0]
    for k in range(v):
        row[k] *= scale


@njit(inline="always")
def _zero_rows(z, nb, b, t0, t1):
    """Rows t0 <= t < t1 of sequence b <- 0 (padding; every row of an infeasible sequence)."""
    for t in range(t0, t1):
        z[t * nb + b, :] = 0


# ---------------------------------------------------------------------------------------------
# the kernels


@njit(parallel=True, cache=True)
def ctc_loss_grad(z, bias, nb, frames, ids, tgt_offsets, scale, ws_offsets, alpha, beta, loss,
                  feasible):
    """z (T*nb, V) float32: logits without bias in, scale * dLoss/d(z + bias) out (in place);
    bias (1, V). frames (nb,) int64; ids int32 and tgt_offsets (nb+1,) int64: the targets;
    scale: the loss scale (a power of two: the gradient's bits are scale times the unscaled
    ones). ws_offsets = workspace_offsets(frames, tgt_offsets); alpha, beta float32 workspaces
    of ws_offsets[-1] values each, out (log alpha, log beta). loss (nb,) float64 out: -log Z
    per sequence (0 where infeasible); feasible (nb,) uint8 out. Allocates nothing."""
    v = z.shape[1]
    n_t = z.shape[0] // nb if nb else 0
    sc = np.float32(scale)
    for b in prange(nb):
        lane, em, sk = _scratch()
        f = frames[b]
        off = tgt_offsets[b]
        u = tgt_offsets[b + 1] - off
        ns = 2 * u + 1
        if not _feasible(ids, off, u, f):
            _zero_rows(z, nb, b, 0, n_t)
            loss[b] = 0.0
            feasible[b] = 0
            continue
        _zero_rows(z, nb, b, f, n_t)
        for t in range(f):
            log_softmax_row(z[t * nb + b], bias, v, lane)
        w0 = ws_offsets[b]
        logz = _alpha_pass(z, nb, b, f, ids, off, u, alpha, w0, em, sk)
        al = alpha[w0:w0 + f * ns]
        be = beta[w0:w0 + f * ns]
        for s in range(ns):
            be[(f - 1) * ns + s] = _ZERO if s >= ns - 2 else _NEG_INF
        for t in range(f - 1, -1, -1):
            row = z[t * nb + b]
            cur = be[t * ns:(t + 1) * ns]
            if t > 0:   # beta_{t-1} reads row t's log-probabilities for the last time
                _beta_step(row, ids, off, ns, cur, be[(t - 1) * ns:t * ns], _live(ns, f, t - 1)[0],
                           em, sk)
            lo, hi = _live(ns, f, t)
            _grad_row(row, v, ids, off, al[t * ns:(t + 1) * ns], cur, lo, hi, logz, sc, em)
        loss[b] = -np.float64(logz)
        feasible[b] = 1


@njit(parallel=True, cache=True)
def ctc_loss_logprobs(lp, nb, frames, ids, tgt_offsets, ws_offsets, alpha, loss, feasible):
    """The loss only (cross-validation, scoring), from log-probabilities lp (T*nb, V) already
    normalised (the model's log-softmax output: kernels.log_softmax_forward's rows give the
    same bits as ctc_loss_grad's loss), read only; the other arguments as in ctc_loss_grad."""
    for b in prange(nb):
        _, em, sk = _scratch()
        f = frames[b]
        off = tgt_offsets[b]
        u = tgt_offsets[b + 1] - off
        if not _feasible(ids, off, u, f):
            loss[b] = 0.0
            feasible[b] = 0
            continue
        logz = _alpha_pass(lp, nb, b, f, ids, off, u, alpha, ws_offsets[b], em, sk)
        loss[b] = -np.float64(logz)
        feasible[b] = 1


# ---------------------------------------------------------------------------------------------
# NumPy reference (float64; clarity first)


def ref_log_softmax(z, bias):
    """log softmax(z + bias) per row, float64."""
    v = z.astype(np.float64) + np.asarray(bias, np.float64)
    mx = v.max(axis=1, keepdims=True)
    return v - mx - np.log(np.exp(v - mx).sum(axis=1, keepdims=True))


def ref_alpha_beta(lp, target):
    """For one sequence: lp (f, V) float64 log-probabilities, target (U,) -> (alpha, beta)
    (f, S) in log space (beta without the emission at t), log Z; None if infeasible."""
    f, u = lp.shape[0], len(target)
    ns = 2 * u + 1
    if f < 1 or f < u + int(np.sum(target[1:] == target[:-1])):
        return None
    labels = np.zeros(ns, np.int64)
    labels[1::2] = target
    skip = np.zeros(ns, bool)                    # state s may be entered from s - 2
    skip[3::2] = target[1:] != target[:-1]
    emit = lp[:, labels]                         # (f, S): lp[t, l'_s]
    alpha = np.full((f, ns), -np.inf)
    alpha[0, :2] = emit[0, :2]
    for t in range(1, f):
        prev = alpha[t - 1]
        a = prev.copy()
        a[1:] = np.logaddexp(a[1:], prev[:-1])
        a[2:] = np.where(skip[2:], np.logaddexp(a[2:], prev[:-2]), a[2:])
        alpha[t] = a + emit[t]
    beta = np.full((f, ns), -np.inf)
    beta[f - 1, -2:] = 0.0
    for t in range(f - 2, -1, -1):
        nxt = beta[t + 1] + emit[t + 1]
        bt = nxt.copy()
        bt[:-1] = np.logaddexp(bt[:-1], nxt[1:])
        bt[:-2] = np.where(skip[2:], np.logaddexp(bt[:-2], nxt[2:]), bt[:-2])
        beta[t] = bt
    logz = np.logaddexp.reduce(alpha[f - 1, -2:])
    return alpha, beta, logz


def ref_ctc(z, bias, nb, frames, ids, tgt_offsets):
    """-> (loss (nb,) float64, grad (T*nb, V) float64 = dLoss/d(z + bias), padded rows 0,
    feasible (nb,) bool). Infeasible sequences: loss 0, grad 0."""
    lp_all = ref_log_softmax(z, bias)
    loss = np.zeros(nb)
    grad = np.zeros_like(lp_all)
    feasible = np.zeros(nb, bool)
    for b in range(nb):
        f = int(frames[b])
        target = np.asarray(ids[tgt_offsets[b]:tgt_offsets[b + 1]], np.int64)
        lp = lp_all[b::nb][:f]                   # rows t*nb + b, t < f
        res = ref_alpha_beta(lp, target)
        if res is None:
            continue
        alpha, beta, logz = res
        labels = np.zeros(alpha.shape[1], np.int64)
        labels[1::2] = target
        gamma = np.exp(alpha + beta - logz)      # (f, S)
        g = np.exp(lp)
        for t in range(f):
            g[t] -= np.bincount(labels, gamma[t], minlength=lp.shape[1])
        grad[b::nb][:f] = g
        loss[b] = -logz
        feasible[b] = True
    return loss, grad, feasible
