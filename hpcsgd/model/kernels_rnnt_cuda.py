"""CUDA counterpart of hpcsgd.model.kernels_rnnt: the RNN-T loss and its gradient for GPU ranks.

Shape key as there: B utterances, V labels (blank 0), f = frames[b], U targets, U1 = U + 1;
z (N, V) (float32, or 16-bit: below) holds every utterance's lattice rows, node (t, u) of
utterance b at row row_offsets[b] + t*U1 + u; alpha, beta and lse (N,) float32 are indexed
like the rows. The wrapper
takes Numba device arrays (or any __cuda_array_interface__ array) and launches on the compute
stream without synchronizing; loss and feasible stay on the device until the caller reads them.

One block per utterance, NT threads (a power of two, `threads`, default RNNT_THREADS), four
phases separated by barriers:
1. each row's log-sum-exp, rows one after another: thread j takes columns j, j + NT, ...; the
   row's max and sum of exps are kernels_ctc_cuda's block reductions (trees in shared memory,
   halving in a fixed order), kept in the lse workspace; a log-probability is then the logit
   less it, formed where it is read (the same float32 rounding as the CPU kernel's in-place
   log-softmax, which a 16-bit z could not hold);
2. alpha, the anti-diagonal wavefront: the nodes with t + u = d depend only on diagonal d - 1,
   so thread j takes u = lo + j, lo + j + NT, ... of diagonal d; a barrier per diagonal;
3. beta, the same from the last diagonal back;
4. each row's gradient: every thread reads the row's blank and label log-probabilities and
   forms the two edge posteriors (a barrier, then no thread overwrites them before all have
   read them), then thread k writes labels k, k + NT, ... once, after the scale.
No atomics: every result is bit-reproducible for a given NT; another NT adds the softmax sums
in another order. Barriers per utterance: f*U1 (2 log2 NT + 2) for the softmax, 2 (f + U) for
the wavefronts, f*U1 for the gradient: the row-by-row softmax dominates (its rows are
independent; a warp per row with shuffle reductions would drop its barriers, the first thing
to try once a GPU times this). z is read three times (twice for the log-sum-exps, once for
the gradient) and written once; the wavefronts read two entries a node. Blocks fill a GPU
only at B >= its SM count (an H100: 132). Not yet timed on a GPU.

z may be 16-bit (GPU ranks' mixed precision and bf16): every read widened to float32 (F),
the loss and recursions in float32, the gradient rounded once into z (S) -- the CPU
emulation's float32 loss on 16-bit logits, with the logits' memory halved. The workspaces stay
float32: alpha, beta and lse, 12 bytes a lattice node.

Against the CPU kernel: the same recursion and edge posteriors, the same log-sum-exp formula
(kernels_ctc_cuda's, with a -inf third term), but CUDA's expf and logf (libdevice: within 2 and
1 ulp) instead of the Cephes polynomials, the softmax sum added in another order, and ptxas
free to fuse a product and the subtraction after it: the two agree within the derived float32
bound (tests/test_rnnt_cuda.py), not bit for bit. Under the simulator the exps and logs are
Python's float64 ones, within the same bound.
"""
import math

import numpy as np

from hpcsgd.device import as_device, on_stream
from hpcsgd.half import stored as S
from hpcsgd.half import widen as F
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model import kernels_ctc_cuda as KCC
from hpcsgd.model import kernels_rnnt as KR

RNNT_THREADS = 128   # threads per utterance's block: V and the diagonals beyond it are strided
MAX_THREADS = KCC.MAX_THREADS   # the shared reduction arrays' size (a compile-time constant)
NEG_INF, ZERO = np.float32(-np.inf), np.float32(0)

# is the utterance trained (the CPU kernel's rule, one Python function for both); every
# thread computes it (uniform across the block)
_feasible = cuda.jit(device=True)(KR.feasible_rule)


@cuda.jit(device=True)
def _row_lse(z, r, smax, ssum):
    """logsumexp(z[r]) in float32, max-subtracted (every thread gets it). Thread j reads its
    own columns; the reductions' barriers order this row's reads before the next row's."""
    t, nt = cuda.threadIdx.x, cuda.blockDim.x
    mx = NEG_INF
    for j in range(t, z.shape[1], nt):
        mx = max(mx, F(z[r, j]))
    mx = KCC._block_max(smax, mx)
    s = ZERO
    for j in range(t, z.shape[1], nt):
        s += math.exp(F(z[r, j]) - mx)
    return mx + math.log(KCC._block_sum(ssum, s))


@cuda.jit(device=True)
def _lp(z, r, k, lse):
    """log p(k | row r): the logit less its row's log-sum-exp, in float32 -- the value the
    in-place log-softmax of the CPU kernel stores (the same single rounding)."""
    return F(z[r, k]) - lse[r]


# ---------------------------------------------------------------------------------------------
# the kernel


@cuda.jit
def _rnnt_grad_kernel(z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, lse, loss,
                      feasible, lam1):
    b = cuda.blockIdx.x
    tid, nt = cuda.threadIdx.x, cuda.blockDim.x
    smax = cuda.shared.array(MAX_THREADS, np.float32)
    ssum = cuda.shared.array(MAX_THREADS, np.float32)
    v = z.shape[1]
    f = frames[b]
    off = tgt_offsets[b]
    nu = tgt_offsets[b + 1] - off
    u1 = nu + 1
    r0 = row_offsets[b]
    r1 = row_offsets[b + 1]
    if not _feasible(nu, f):                    # uniform per block
        for r in range(r0, r1):
            for k in range(tid, v, nt):
                z[r, k] = S(z, ZERO)
        if tid == 0:
            loss[b] = 0.0
            feasible[b] = 0
        return
    for r in range(r0, r1):                     # 1. each row's log-sum-exp
        row_lse = _row_lse(z, r, smax, ssum)
        if tid == 0:
            lse[r] = row_lse
    cuda.syncthreads()
    for d in range(f + nu):                     # 2. alpha, diagonal d = t + u
        for u in range(max(0, d - f + 1) + tid, min(nu, d) + 1, nt):
            t = d - u
            r = r0 + t * u1 + u
            if d == 0:
                alpha[r] = ZERO
            else:
                stay = alpha[r - u1] + _lp(z, r - u1, 0, lse) if t > 0 else NEG_INF
                emit = alpha[r - 1] + _lp(z, r - 1, ids[off + u - 1], lse) if u > 0 \
                    else NEG_INF
                alpha[r] = KCC._lse3(stay, emit, NEG_INF)
        cuda.syncthreads()
    last = r1 - 1
    logp = alpha[last] + _lp(z, last, 0, lse)
    for d in range(f + nu - 1, -1, -1):         # 3. beta
        for u in range(max(0, d - f + 1) + tid, min(nu, d) + 1, nt):
            t = d - u
            r = r0 + t * u1 + u
            if t < f - 1:
                b_next = beta[r + u1]
            else:
                b_next = ZERO if u == nu else NEG_INF
            emit = NEG_INF
            if u < nu:
                emit = _lp(z, r, ids[off + u], lse) + beta[r + 1]
            beta[r] = KCC._lse3(_lp(z, r, 0, lse) + b_next, emit, NEG_INF)
        cuda.syncthreads()
    for r in range(r0, r1):                     # 4. gradient
        t = (r - r0) // u1
        u = (r - r0) - t * u1
        a = alpha[r]
        lp0 = _lp(z, r, 0, lse)
        e0 = ZERO
        if t < f - 1 or u == nu:
            b_next = beta[r + u1] if t < f - 1 else ZERO
            e0 = math.exp(((a + lp0) + b_next) - logp)
        y = -1
        lpy = NEG_INF
        ey = ZERO
        if u < nu:
            y = ids[off + u]
            lpy = _lp(z, r, y, lse)
            ey = math.exp(((a + lpy) + beta[r + 1]) - logp)
        c = e0 + lam1 * ey
        cuda.syncthreads()                      # every thread has read z[r, 0] and z[r, y]
        for k in range(tid, v, nt):
            g = math.exp(_lp(z, r, k, lse)) * c   # _lp(.., 0, ..) is lp0, (.., y, ..) lpy
            if k == 0:
                g -= e0
            elif k == y:
                g -= lam1 * ey
            z[r, k] = S(z, g * scale)
    if tid == 0:
        loss[b] = -logp
        feasible[b] = 1


# ---------------------------------------------------------------------------------------------
# wrapper


def rnnt_loss_grad(z, frames, ids, tgt_offsets, row_offsets, scale, alpha, beta, loss,
                   feasible, fastemit_lambda=0.0, threads=RNNT_THREADS, lse=None):
    """kernels_rnnt.rnnt_loss_grad on the device: z (N, V) the joint's logits in (float32, or
    16-bit storage: float16, uint16 bfloat16 bits), scale * dLoss/dz out (rounded once to z's
    dtype); frames int64, ids int32, tgt_offsets and row_offsets (kernels_rnnt.lattice_offsets)
    int64; alpha, beta and lse float32 workspaces of N values (lse None: made here, for a
    one-off call); loss float64 and feasible uint8 (B,) out. One block of `threads` per
    utterance; no sync."""
    KCC._check_threads(threads)
    if lse is None:
        lse = cuda.device_array(alpha.shape[0], np.float32)
    z, frames, ids, tgt_offsets, row_offsets, alpha, beta, lse, loss, feasible = (
        as_device(a) for a in (z, frames, ids, tgt_offsets, row_offsets, alpha, beta, lse,
                               loss, feasible))
    nb = frames.shape[0]
    if nb:
        _rnnt_grad_kernel[on_stream((nb, threads))](
            z, frames, ids, tgt_offsets, row_offsets, np.float32(scale), alpha, beta, lse,
            loss, feasible, np.float32(1.0 + fastemit_lambda))
