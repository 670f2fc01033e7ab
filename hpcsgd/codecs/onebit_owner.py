"""The 1-bit codec's fused owner pass (its declared `fused_owner` capability): the striped
exchange's phases 3-5 in one pass per column.

Unfused, the owner of a stripe makes three passes over it (hpcsgd/comm/exchange.py, phases
3-5): decode-and-sum the K contributions into the float32 aggregate, post-process it
(optimizer), re-encode it with the second residual. The aggregate goes to memory and back
each time: with momentum about 40 B of traffic per stripe value (decode-sum 4 + 8 (K - 1),
post 16, re-encode 12). Here each column is decoded, summed, post-processed and re-encoded
while it sits in L1 (8 KB for a 2048-row column); what remains is the optimizer state and
the second residual, read and written once: 16 B per value with momentum, plus the K packed
contributions (1 bit each) and the packed result. With one thread per rank the pass is
compute-bound rather than memory-bound, so it pays only where LLVM vectorises each part
(_compiled_pass says how); measured at K = 2: 23 ms against 30 for the three passes
(docs/exchange.md, "Fusions tried").

Bit-identical to the unfused phases: the codec's own column functions
(hpcsgd/codecs/onebit_columns.py: decode_column_cpu, encode_column_cpu) and the optimizer's
public element arithmetic (hpcsgd/optim.py: post_element_cpu, with Optimizer.post_operands), in
the same order (sources 0..K-1, rows in order). CPU ranks only; GPU ranks run the unfused
phases as CUDA kernels.
"""
import numba
import numpy as np
from numba import njit, prange

from hpcsgd.codecs.common import LANES, nonfinite_error
from hpcsgd.codecs.onebit_columns import (ADD, SET, decode_column_cpu, encode_column_cpu,
                                          words_per_column)
from hpcsgd.optim import ADAM, ADAM_LOCAL, AFTER_MOMENTUM, AGGREGATE, post_element_cpu


@njit(inline="always")
def _post_loop(col, w, v, s, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m, adam_k):
    for i in range(col.shape[0]):
        col[i] = post_element_cpu(col, w, v, s, i, wd_n, ada, rho, c, inv_n, inv_q, eps,
                                  use_momentum, m, adam_k)


@njit(inline="always")
def _owner_columns(recvw, recvf, at, w, use_w, v, s, base, r2, out8, outf, bad, nchunk,
                   wd_n, rho, c, inv_n, inv_q, eps, m, adam_k, ada, use_momentum):
    """One matrix piece of the owner's stripe, n_cols columns of n_rows values:
    recvw (K, mine / 4) uint32 and recvf (the same bytes as float32): the K contributions,
    the piece's packed columns starting at word `at` of each row; w (n_cols, n_rows): the
    piece's weights, read for weight decay if use_w; v, s: the optimizer's compact velocity
    and AdaGrad state over the whole stripe (1-element dummies where unused), the piece at
    offset `base`; r2 (n_cols, n_rows): the piece's second residual; out8/outf (n_cols, 4W)
    uint8 / (n_cols, W) float32: its slot of the gather buffer. bad[j] = 1 where column j
    of the post-processed sum + r2 is not finite. The rest: post_element_cpu's scalars;
    `ada` and `use_momentum` are constants of each compiled pass below."""
    K = recvw.shape[0]
    n_cols, n_rows = r2.shape
    W = outf.shape[1]           # packed words per column
    for t in prange(nchunk):
        col = np.empty(n_rows, np.float32)                 # the column's sum, then update
        pos = np.empty(LANES, np.float64)
        neg = np.empty(LANES, np.float64)
        signs = np.zeros((n_rows + 7) // 8 * 8, np.uint8)  # padding stays 0
        signs64 = signs.view(np.uint64)
        for j in range(t * n_cols // nchunk, (t + 1) * n_cols // nchunk):
            o = at + j * W
            # in source order, the first overwrites (as unfused)
            decode_column_cpu(recvw[0, o:o + W], recvf[0, o:o + W], col, SET, 0.0)
            for src in range(1, K):
                decode_column_cpu(recvw[src, o:o + W], recvf[src, o:o + W], col, ADD, 0.0)
            e = base + j * n_rows
            vj = v[e:e + n_rows] if use_momentum or ada == ADAM or ada == ADAM_LOCAL \
                else v[0:1]
            sj = s[e:e + n_rows] if ada == AGGREGATE or ada == AFTER_MOMENTUM or ada == ADAM \
                else s[0:1]
            if use_w:
                _post_loop(col, w[j], vj, sj, wd_n, ada, rho, c, inv_n, inv_q, eps,
                           use_momentum, m, adam_k)
            else:   # the sum itself, as unfused; passed as col so LLVM sees the alias
                _post_loop(col, col, vj, sj, wd_n, ada, rho, c, inv_n, inv_q, eps,
                           use_momentum, m, adam_k)
            if not encode_column_cpu(col, r2[j], out8[j], outf[j], pos, neg, signs, signs64):
                bad[j] = 1


def _compiled_pass(ada, use_momentum):
    """One compiled pass per (AdaGrad placement or Adam, momentum), which it passes on as
    constants (closure values are compile-time constants to Numba): LLVM drops the other
    branches of post_element_cpu and vectorises the update loop (momentum: 6 instead of 24 ms
    over 22.5M values), and a run compiles only the pass it uses (all eight in one function
    took 15 s to compile; one takes 2.5-3 s since the 1-bit column kernels are called, not
    inlined). Its own name gives each its own cache file."""
    def owner_pass(rw, rf, at, w, use_w, v, s, base, r2, o8, of, bad, nc, wd, rho, c, i_n, i_q,
                   eps, m, ak):
        _owner_columns(rw, rf, at, w, use_w, v, s, base, r2, o8, of, bad, nc, wd, rho, c, i_n,
                       i_q, eps, m, ak, ada, use_momentum)
    owner_pass.__name__ = owner_pass.__qualname__ = f"owner_pass_{ada}_{int(use_momentum)}"
    return njit(parallel=True, cache=True)(owner_pass)


OWNER_PASSES = {(ada, mom): _compiled_pass(ada, mom)
                for ada in (0, AGGREGATE, AFTER_MOMENTUM, ADAM, ADAM_LOCAL)
                for mom in (False, True)}


def owner_pass_onebit_cpu(recvw, recvf, at, w, use_w, v, s, base, r2, out8, outf, bad, nchunk,
                          wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m, adam_k):
    """_owner_columns with the compiled pass of this placement and momentum."""
    OWNER_PASSES[int(ada), bool(use_momentum)](recvw, recvf, at, w, use_w, v, s, base, r2, out8,
                                              outf, bad, nchunk, wd_n, rho, c, inv_n, inv_q,
                                              eps, m, adam_k)


def owner_pass(codec_name, recv, world, slot, pieces, params, opt, residual2, gather):
    """Phases 3-5 of the striped exchange in one pass per column: for each of this rank's
    matrix pieces ((matrix, flat lo, flat hi, columns, gather offset, nbytes), compact lo,
    compact hi), decode-and-sum the K contributions in recv (K blocks laid out like this
    rank's slot [slot[0], slot[1]) of the gather buffer), post-process with opt (its
    per-step scalars set), re-encode with residual2 (compact) into gather. Raises the
    codec's non-finite error as encode() does."""
    mine = slot[1] - slot[0]
    v, s, scalars = opt.post_operands()
    use_w = opt.weight_decay != 0
    recvw = recv.view(np.uint32).reshape(world, mine // 4)
    recvf = recv.view(np.float32).reshape(world, mine // 4)
    for (m, lo, hi, cols, off, nb), a, b in pieces:
        W = words_per_column(m.n_rows)
        r2 = residual2[a:b].reshape(cols, m.n_rows)
        w = params[lo:hi].reshape(cols, m.n_rows) if use_w else r2   # r2: unread placeholder
        bad = np.zeros(cols, np.uint8)
        owner_pass_onebit_cpu(recvw, recvf, (off - slot[0]) // 4, w, use_w, v, s, a, r2,
                              gather[off:off + nb].reshape(cols, 4 * W),
                              gather[off:off + nb].view(np.float32).reshape(cols, W), bad,
                              min(cols, 8 * numba.get_num_threads()), *scalars)
        if bad.any():
            raise nonfinite_error(codec_name, (cols, m.n_rows), int(np.argmax(bad)))
