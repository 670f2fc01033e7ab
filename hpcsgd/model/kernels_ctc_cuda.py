"""CUDA counterparts of hpcsgd.model.kernels_ctc: the CTC loss and its gradient for GPU ranks.

Shape key as there: B = nb sequences, T padded steps, V labels (blank 0), f = frames[b],
U targets, S = 2U + 1 states; z is (T*B, V) time-major, row t*B + b. Wrappers take Numba
device arrays (or any __cuda_array_interface__ array) and launch on the compute stream without
synchronizing; loss and feasible stay on the device until the caller reads them.

One block per sequence, NT threads (a power of two, `threads`, default CTC_THREADS):
- each row's log-softmax statistics: thread j takes columns j, j + NT, ...; the block's max
  and sum of exps are tree reductions in shared memory, halving in a fixed order;
- alpha and beta: thread j takes states j, j + NT, ...; a barrier per time step;
- the gradient: thread k takes labels k, k + NT, ...: exp(lp) minus the gammas of the states
  labelled k, subtracted in state order (the CPU kernel's order), stored once after the scale.
No atomics: every result is bit-reproducible for a given NT; another NT adds the softmax sums
in another order. An utterance's steps are sequential, each with a few barriers (2 log2 NT + 2
per row's statistics, one per recursion step), so a block takes about f times a few
microseconds whatever B, and B blocks fill a GPU only at B >= its SM count (an H100: 132).
Not yet timed on a GPU.

Nothing is stored but the gradient: the log-softmax of a row is recomputed where needed (its
max and log-sum once in the alpha pass, once in the beta pass), never written into z, so a
16-bit z (float16, or uint16 holding bfloat16 bits: hpcsgd/half.py, loaded with F, stored
with S) receives only the final scaled gradient, rounded once. Reading z twice costs less
traffic than writing and re-reading the log-softmax. Everything is computed in float32.

Against the CPU kernel: the same recursion and the same log-sum-exp formula, but CUDA's expf
and logf (libdevice: within 2 and 1 ulp) instead of the Cephes polynomials, and the softmax
sum added in another order, so the two agree within the derived float32 bound
(tests/test_ctc_cuda.py), not bit for bit. Under the simulator the exps and logs are Python's
float64 ones, within the same bound.
"""
import math

import numpy as np

from hpcsgd.device import as_device, on_stream
from hpcsgd.half import stored as S
from hpcsgd.half import widen as F
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model import kernels_ctc as KC

CTC_THREADS = 128   # threads per sequence's block: S and V beyond it are strided over
# the largest block (and the shared reduction arrays' size): ptxas gives the gradient kernel
# about 80 registers a thread (sm_80/sm_90, tests/test_ctc_cuda.py), and a block may use 64K
MAX_THREADS = 512
NEG_INF, ZERO = np.float32(-np.inf), np.float32(0)


def _check_threads(threads):
    if threads < 1 or threads > MAX_THREADS or threads & (threads - 1):
        raise ValueError(f"CTC kernels: threads must be a power of two <= {MAX_THREADS}, "
                         f"got {threads}")


# ---------------------------------------------------------------------------------------------
# device functions


# has the sequence an alignment (the CPU kernels' rule, one Python function for both); every
# thread computes it (uniform across the block)
_feasible = cuda.jit(device=True)(KC.feasible_rule)


@cuda.jit(device=True)
def _label(ids, off, s):
    if s % 2 == 0:
        return 0
    return ids[off + s // 2]


@cuda.jit(device=True)
def _can_skip(ids, off, s):
    return s % 2 == 1 and s >= 3 and ids[off + s // 2] != ids[off + s // 2 - 1]


@cuda.jit(device=True)
def _lse3(a, b, c):
    """log(exp(a) + exp(b) + exp(c)), float32: the max plus the log of a sum in [1, 3]."""
    m = max(a, max(b, c))
    if m == NEG_INF:
        return m
    return m + math.log(math.exp(a - m) + math.exp(b - m) + math.exp(c - m))


@cuda.jit(device=True)
def _block_max(part, x):
    """The max of every thread's x, to every thread (a tree in shared memory)."""
    t = cuda.threadIdx.x
    part[t] = x
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if t < half:
            part[t] = max(part[t], part[t + half])
        cuda.syncthreads()
        half //= 2
    return part[0]


@cuda.jit(device=True)
def _block_sum(part, x):
    """The sum of every thread's x, to every thread: a tree halving in a fixed order."""
    t = cuda.threadIdx.x
    part[t] = x
    cuda.syncthreads()
    half = cuda.blockDim.x // 2
    while half > 0:
        if t < half:
            part[t] = part[t] + part[t + half]
        cuda.syncthreads()
        half //= 2
    return part[0]


@cuda.jit(device=True)
def _row_lse(z, bias, r, smax, ssum):
    """log sum exp(z[r] + bias), float32, max-subtracted, to every thread. The two reductions
    end in barriers, so writes made before the call are visible to every thread after it."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    mx = NEG_INF
    for j in range(t, z.shape[1], nt):
        mx = max(mx, F(z[r, j]) + F(bias[0, j]))
    mx = _block_max(smax, mx)
    s = ZERO
    for j in range(t, z.shape[1], nt):
        s += math.exp(F(z[r, j]) + F(bias[0, j]) - mx)
    return mx + math.log(_block_sum(ssum, s))


@cuda.jit(device=True)
def _lp(z, bias, r, k, lse):
    """log softmax(z + bias)[r, k], given the row's lse: the CPU kernel's arithmetic."""
    return (F(z[r, k]) + F(bias[0, k])) - lse


@cuda.jit(device=True)
def _alpha_in(alpha, cur, ns, t, s, ids, off):
    """alpha_t(s) before the emission: log-sum-exp of its predecessors in alpha_{t-1} (the S
    values before cur); the start states' 0 at t = 0."""
    if t == 0:
        return ZERO if s < 2 else NEG_INF
    p = cur - ns
    step = alpha[p + s - 1] if s >= 1 else NEG_INF
    skip = alpha[p + s - 2] if _can_skip(ids, off, s) else NEG_INF
    return _lse3(alpha[p + s], step, skip)


@cuda.jit(device=True)
def _alpha_step(z, bias, r, lse, t, ns, ids, off, alpha, cur):
    """alpha_t (at alpha[cur:cur + S]) from alpha_{t-1} and the logits' row r."""
    for s in range(cuda.threadIdx.x, ns, cuda.blockDim.x):
        lp = _lp(z, bias, r, _label(ids, off, s), lse)
        alpha[cur + s] = _alpha_in(alpha, cur, ns, t, s, ids, off) + lp


@cuda.jit(device=True)
def _log_z(alpha, last, ns):
    if ns == 1:
        return alpha[last]
    return _lse3(alpha[last + ns - 1], alpha[last + ns - 2], NEG_INF)


@cuda.jit(device=True)
def _grad_row(z, bias, r, lse, base, ns, ids, off, alpha, beta, logz, scale):
    """z[r] <- scale * (softmax - the gammas of each label's states, in state order): thread k
    its labels k, k + NT, ..., each stored once (S: a 16-bit z rounds once, after the scale,
    a power of two: exact)."""
    for k in range(cuda.threadIdx.x, z.shape[1], cuda.blockDim.x):
        g = math.exp(_lp(z, bias, r, k, lse))
        s0 = 0 if k == 0 else 1
        for s in range(s0, ns, 2):
            if k == 0 or ids[off + s // 2] == k:
                g -= math.exp(alpha[base + s] + beta[base + s] - logz)
        z[r, k] = S(z, g * scale)


# ---------------------------------------------------------------------------------------------
# kernels


@cuda.jit
def _ctc_grad_kernel(z, bias, nb, frames, ids, tgt_offsets, scale, ws_offsets, alpha, beta,
                     loss, feasible):
    b = cuda.blockIdx.x
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    smax = cuda.shared.array(MAX_THREADS, np.float32)
    ssum = cuda.shared.array(MAX_THREADS, np.float32)
    n_t = z.shape[0] // nb
    v = z.shape[1]
    f = frames[b]
    off = tgt_offsets[b]
    u = tgt_offsets[b + 1] - off
    ns = 2 * u + 1
    if not _feasible(ids, off, u, f):           # uniform per block
        for t in range(n_t):
            for k in range(tid, v, nt):
                z[t * nb + b, k] = 0
        if tid == 0:
            loss[b] = 0.0
            feasible[b] = 0
        return
    w0 = ws_offsets[b]
    for t in range(f):                          # alpha; each lse's barriers publish alpha_{t-1}
        r = t * nb + b
        lse = _row_lse(z, bias, r, smax, ssum)
        _alpha_step(z, bias, r, lse, t, ns, ids, off, alpha, w0 + t * ns)
    cuda.syncthreads()
    logz = _log_z(alpha, w0 + (f - 1) * ns, ns)
    last = w0 + (f - 1) * ns
    for s in range(tid, ns, nt):
        beta[last + s] = ZERO if s >= ns - 2 else NEG_INF
    lse_next = _row_lse(z, bias, (f - 1) * nb + b, smax, ssum)
    for t in range(f - 2, -1, -1):
        rn = (t + 1) * nb + b
        cur = w0 + t * ns
        for s in range(tid, ns, nt):
            nxt = cur + ns
            stay = beta[nxt + s] + _lp(z, bias, rn, _label(ids, off, s), lse_next)
            step = NEG_INF
            if s + 1 < ns:
                step = beta[nxt + s + 1] + _lp(z, bias, rn, _label(ids, off, s + 1), lse_next)
            skip = NEG_INF
            if s + 2 < ns and _can_skip(ids, off, s + 2):
                skip = beta[nxt + s + 2] + _lp(z, bias, rn, _label(ids, off, s + 2), lse_next)
            beta[cur + s] = _lse3(stay, step, skip)
        lse = _row_lse(z, bias, t * nb + b, smax, ssum)   # barriers: beta_t done, row t+1 read
        _grad_row(z, bias, rn, lse_next, w0 + (t + 1) * ns, ns, ids, off, alpha, beta, logz,
                  scale)
        lse_next = lse
    cuda.syncthreads()
    _grad_row(z, bias, b, lse_next, w0, ns, ids, off, alpha, beta, logz, scale)
    for t in range(f, n_t):                     # padding
        for k in range(tid, v, nt):
            z[t * nb + b, k] = 0
    if tid == 0:
        loss[b] = -logz
        feasible[b] = 1


# ---------------------------------------------------------------------------------------------
# wrappers


def ctc_loss_grad(z, bias, nb, frames, ids, tgt_offsets, scale, ws_offsets, alpha, beta, loss,
                  feasible, threads=CTC_THREADS):
    """kernels_ctc.ctc_loss_grad on the device: z (T*nb, V) float32, float16 or uint16
    (bfloat16 bits), logits without bias in, scale * dLoss/d(z + bias) out in z's dtype;
    bias (1, V) of any of those dtypes; frames int64, ids int32, tgt_offsets int64,
    ws_offsets (kernels_ctc.workspace_offsets) int64; alpha, beta float32 workspaces; loss
    float64 and feasible uint8 (nb,) out. One block of `threads` per sequence; no sync."""
    _check_threads(threads)
    z, bias, frames, ids, tgt_offsets, ws_offsets, alpha, beta, loss, feasible = (
        as_device(a) for a in (z, bias, frames, ids, tgt_offsets, ws_offsets, alpha, beta,
                               loss, feasible))
    if nb:
        _ctc_grad_kernel[on_stream((nb, threads))](
            z, bias, np.int64(nb), frames, ids, tgt_offsets, np.float32(scale), ws_offsets,
            alpha, beta, loss, feasible)
