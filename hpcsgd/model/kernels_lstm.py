"""Fused element-wise kernels of the LSTM layer (Numba CPU) and the NumPy references they are
tested against; the GEMMs around them are in hpcsgd.model.lstm.

Shape key: B = sequences (chunks) in the minibatch, H = cells of one direction, gates in the
order i, f, g, o, each H wide: a gate block of one time step is (B, 4H). A bidirectional
layer's two directions share one (T*B, 8H) gate buffer and one (T*B, 2H) cell and output
buffer; a step's arrays are their row blocks (C-contiguous) and a direction is a column
offset (ga for gates, gh for cells) passed to the kernel, not a strided column view. The
loops run over 1-D slices from index 0: Numba vectorizes them only so (on 2-D strided views,
or a loop over range(2H, 3H), it did not: 3-4x slower, measured), and only inside prange.
Each launch wakes the second thread (about 40 us here, passive OpenMP wait), so a step is one
launch, both directions' recurrent products (h_{t-1} U, dgates U^T: a few rows, SMALL_ROWS)
inside it: each task makes its cells' product columns, then steps its cells. (With the
products on one thread before the launch, the so762 CTC model's pass on two threads spent half
its time in them: 466 ms; in the launch, 340 ms.)

As in hpcsgd.model.kernels: dtype-generic (float32 training, float64 gradient checks), no
fastmath (but in the recurrent product's dot products, `small_matmul_nt`), float32 exp and
tanh from the vectorizable Cephes exp (`fexp`); column sums in NCHUNK fixed row chunks so the
bits do not depend on the number of threads.
"""
import math

import numpy as np
from numba import get_num_threads, njit, prange, types
from numba.core.extending import overload

from hpcsgd.model.kernels import NCHUNK, fexp

GATES = 4   # i, f, g, o


def ftanh(x):
    """tanh(x): (1 - e) / (1 + e), e = exp(-2|x|) from fexp, for float32 (absolute error a
    few ulp of 1, the scale the cell works at; vectorizes, where libm's tanhf is a scalar
    call); math.tanh otherwise (Numba only)."""
    return math.tanh(x)


@overload(ftanh, inline="always")
def _ftanh_overload(x):
    if x == types.float32:
        one, two = np.float32(1), np.float32(-2)

        def tanh32(x):
            e = fexp(two * abs(x))
            # branch-free (vectorizes); copysign is exact, and float32 again for the caller
            return np.float32(math.copysign((one - e) / (one + e), x))
        return tanh32
    return lambda x: math.tanh(x)


@njit(inline="always")
def _forward_cells(a, r, b, c_prev, c, h, ga, gh, hc, n, j0, j1):
    """Cells [j0, j1) of row n of one direction's time step: gates i f g o at columns
    ga + k hc + j of a, k hc + j of r; cells and outputs at gh + j."""
    one = a.dtype.type(1)
    for k in range(GATES):
        row = a[n, ga + k * hc + j0:ga + k * hc + j1]
        rr, bb = r[n, k * hc + j0:k * hc + j1], b[0, ga + k * hc + j0:ga + k * hc + j1]
        for j in range(j1 - j0):
            row[j] = row[j] + rr[j] + bb[j]
    i, f = a[n, ga + j0:ga + j1], a[n, ga + hc + j0:ga + hc + j1]
    g, o = a[n, ga + 2 * hc + j0:ga + 2 * hc + j1], a[n, ga + 3 * hc + j0:ga + 3 * hc + j1]
    for j in range(j1 - j0):
        i[j] = one / (one + fexp(-i[j]))
    for j in range(j1 - j0):
        f[j] = one / (one + fexp(-f[j]))
    for j in range(j1 - j0):
        g[j] = ftanh(g[j])
    for j in range(j1 - j0):
        o[j] = one / (one + fexp(-o[j]))
    cp, cc = c_prev[n, gh + j0:gh + j1], c[n, gh + j0:gh + j1]
    hh = h[n, gh + j0:gh + j1]
    for j in range(j1 - j0):
        cc[j] = f[j] * cp[j] + i[j] * g[j]
    for j in range(j1 - j0):
        hh[j] = o[j] * ftanh(cc[j])


@njit(inline="always")
def _backward_cells(a, c_prev, c, dh, dr, dc, ga, gh, hc, n, j0, j1):
    """Cells [j0, j1) of row n of one direction's time step backwards."""
    one = a.dtype.type(1)
    i, f = a[n, ga + j0:ga + j1], a[n, ga + hc + j0:ga + hc + j1]
    g, o = a[n, ga + 2 * hc + j0:ga + 2 * hc + j1], a[n, ga + 3 * hc + j0:ga + 3 * hc + j1]
    cp, cc = c_prev[n, gh + j0:gh + j1], c[n, gh + j0:gh + j1]
    dhh, drr, dcc = dh[n, gh + j0:gh + j1], dr[n, j0:j1], dc[n, j0:j1]
    for j in range(j1 - j0):
        iv, fv, gv, ov = i[j], f[j], g[j], o[j]
        tc = ftanh(cc[j])
        d = dhh[j] + drr[j]
        dcv = dcc[j] + d * ov * (one - tc * tc)
        i[j] = dcv * gv * (iv * (one - iv))
        f[j] = dcv * cp[j] * (fv * (one - fv))
        g[j] = dcv * iv * (one - gv * gv)
        o[j] = d * tc * (ov * (one - ov))
        dcc[j] = dcv * fv


# A launch's tasks: each direction's cells in blocks (each a multiple of 4 cells: the recurrent
# product's column blocks start where they would in one block, so an element's bits do not
# depend on the blocks), one block per thread and direction: a BLSTM on two threads runs a
# direction per thread, its product included. Finer blocks cost (a task's loops get short):
# the so762 CTC model's pass on two threads took 343 ms with one block per direction, 418 ms
# with 8 (experiments/lstm_cell_blocks.py, EMR, 2026-11-28).


def cell_block(hc, dirs):
    """Cells per task: hc in one block per thread and direction (at least one per direction),
    rounded up to a multiple of 4."""
    blocks = max(1, -(-get_num_threads() // dirs))
    per = -(-hc // blocks)
    return -(-per // 4) * 4


@njit(inline="always")
def _task_cells(k, hc, cb):
    """Task k of a launch: its direction and cells [j0, j1) (blocks of cb cells)."""
    blocks = (hc + cb - 1) // cb
    j0 = (k % blocks) * cb
    return k // blocks, j0, min(j0 + cb, hc)


@njit(parallel=True, cache=True)
def _forward_steps(dirs, elementwise, x0, wt0, r0, a0, cp0, c0, h0, x1, wt1, r1, a1, cp1, c1,
                   h1, b, ga0, gh0, ga1, gh1, hc, cb):
    """dirs (1 or 2) directions' time steps in one launch, direction d's arrays and column
    offsets from the pairs (one compiled kernel per dtype for every caller; the directions'
    steps may have different rows: whole sequences of different lengths, model.lengths).
    x (m, hc) C-contiguous: the previous step's outputs, whose product with U (wt = U^T) is
    written to r first; x with no rows: r is given (zeros at a direction's first step, or a
    product BLAS made). elementwise False: the products alone (ops.GemmOnly)."""
    a, r, cp, c, h = (a0, a1), (r0, r1), (cp0, cp1), (c0, c1), (h0, h1)
    x, wt, ga, gh = (x0, x1), (wt0, wt1), (ga0, ga1), (gh0, gh1)
    for k in prange(dirs * ((hc + cb - 1) // cb)):
        d, j0, j1 = _task_cells(k, hc, cb)
        m = a[d].shape[0]
        if x[d].shape[0] > 0:
            for gate in range(GATES):
                _product_columns(x[d], wt[d], r[d], m, gate * hc + j0, gate * hc + j1, hc)
        if elementwise:
            for n in range(m):
                _forward_cells(a[d], r[d], b, cp[d], c[d], h[d], ga[d], gh[d], hc, n, j0, j1)


def _no_rows(a):
    return a[:0]


def lstm_forward_step(a, r, b, c_prev, c, h, ga, gh, hc):
    """One time step of one direction, hc cells. a: the step's rows of the gate buffer,
    x_t @ Wx in columns [ga, ga + 4hc), the gate activations out (in place); r (B, >= 4hc):
    h_{t-1} @ U (zeros at the first step); b: the bias row, columns from ga; c_prev, c, h:
    the step's rows of the cell and output buffers, columns [gh, gh + hc) (c_prev zeros at
    the first step); c and h out."""
    x = _no_rows(r)
    _forward_steps(1, True, x, r, r, a, c_prev, c, h, x, r, r, a, c_prev, c, h, b, ga, gh, ga,
                   gh, hc, cell_block(hc, 1))


def lstm_forward_step2(a0, r0, cp0, c0, h0, a1, r1, cp1, c1, h1, b, hc):
    """A BLSTM's two directions in one launch: the forward direction's step (arguments 0:
    gate columns from 0, cells from 0) and the backward direction's (arguments 1: its own
    time step's rows, gate columns from 4hc, cells from hc), as lstm_forward_step each: the
    same bits, one wake-up of the threads instead of two."""
    x = _no_rows(r0)
    _forward_steps(2, True, x, r0, r0, a0, cp0, c0, h0, x, r1, r1, a1, cp1, c1, h1, b, 0, 0,
                   4 * hc, hc, hc, cell_block(hc, 2))


def lstm_recurrent_forward(steps, b, hc, elementwise=True):
    """Each direction's time step with its recurrent product, in one launch (CpuOps): steps
    holds per direction (x, wt, r, a, c_prev, c, h), x the previous outputs copied to a
    C-contiguous (m, hc) block, or no rows where r already holds the product (zeros at the
    first step); wt = U^T (4hc, hc). Direction d's gate columns from 4hc d, cells from hc d."""
    s0 = steps[0]
    s1 = steps[1] if len(steps) == 2 else s0
    _forward_steps(len(steps), elementwise, *s0, *s1, b, 0, 0, 4 * hc, hc, hc,
                   cell_block(hc, len(steps)))


@njit(parallel=True, cache=True)
def _backward_steps(dirs, elementwise, x0, u0, dr0, a0, cp0, c0, dh0, dc0, x1, u1, dr1, a1, cp1,
                    c1, dh1, dc1, ga0, gh0, ga1, gh1, hc, cb):
    """dirs directions' steps backwards in one launch (as _forward_steps): x (m, 4hc) the
    later step's gate gradients, whose product with U^T (u = U, (hc, 4hc)) goes to dr first;
    no rows: dr is given."""
    a, cp, c, dh, dr, dc = (a0, a1), (cp0, cp1), (c0, c1), (dh0, dh1), (dr0, dr1), (dc0, dc1)
    x, u, ga, gh = (x0, x1), (u0, u1), (ga0, ga1), (gh0, gh1)
    for k in prange(dirs * ((hc + cb - 1) // cb)):
        d, j0, j1 = _task_cells(k, hc, cb)
        m = a[d].shape[0]
        if x[d].shape[0] > 0:
            _product_columns(x[d], u[d], dr[d], m, j0, j1, GATES * hc)
        if elementwise:
            for n in range(m):
                _backward_cells(a[d], cp[d], c[d], dh[d], dr[d], dc[d], ga[d], gh[d], hc, n,
                                j0, j1)


def lstm_backward_step(a, c_prev, c, dh, dr, dc, ga, gh, hc):
    """One time step of one direction backwards. a: the step's gate activations (columns
    [ga, ga + 4hc)) in, dLoss/d(gate preactivations) out (in place); c_prev, c: the cell
    before and after the step and dh: dLoss/dh_t from the layer above, columns [gh, gh + hc);
    dr (B, >= hc): dLoss/dh_t through the next step's gates (zeros at the last step);
    dc (B, >= hc): dLoss/dc_t from the next step in (zeros at the last step), dLoss/dc_{t-1}
    out."""
    x = _no_rows(dr)
    _backward_steps(1, True, x, dr, dr, a, c_prev, c, dh, dc, x, dr, dr, a, c_prev, c, dh, dc,
                    ga, gh, ga, gh, hc, cell_block(hc, 1))


def lstm_backward_step2(a0, cp0, c0, dh0, dr0, dc0, a1, cp1, c1, dh1, dr1, dc1, hc):
    """Both directions' steps backwards in one launch (as lstm_forward_step2)."""
    x = _no_rows(dr0)
    _backward_steps(2, True, x, dr0, dr0, a0, cp0, c0, dh0, dc0, x, dr1, dr1, a1, cp1, c1, dh1,
                    dc1, 0, 0, 4 * hc, hc, hc, cell_block(hc, 2))


def lstm_recurrent_backward(steps, hc, elementwise=True):
    """Each direction's step backwards with its recurrent product, in one launch: steps
    holds per direction (x, u, dr, a, c_prev, c, dh, dc), x the later step's gate gradients
    copied to a C-contiguous (m, 4hc) block (or no rows: dr given), u = U (hc, 4hc)."""
    s0 = steps[0]
    s1 = steps[1] if len(steps) == 2 else s0
    _backward_steps(len(steps), elementwise, *s0, *s1, 0, 0, 4 * hc, hc, hc,
                    cell_block(hc, len(steps)))


# Whole sequences in one launch: a BLSTM on 1 or 2 threads runs one task per direction (one
# block of cells each), and such a task needs nothing of the other's until the layer ends. So
# each direction's whole time loop runs in its task -- its products and steps, the same calls
# in the same order as one launch per step makes them (the same bits) -- instead of a launch
# per step: no per-step wake-up of the threads (27 us on 2 threads, 8 on one, EMR), none of
# the step loop's Python (lstm.py), and on one thread each direction's U stays in the core's
# L2 through its loop instead of alternating with the other's. Rows: at most SMALL_ROWS per
# step (the product's operand is copied to xs; more go to BLAS, one launch per step).


@njit(parallel=True, cache=True)
def _forward_sequences(dirs, elementwise, gates, cells, h, y, ut0, ut1, r0, r1, b, zeros, bs,
                       nb, hc, xs, s0, s1):
    """dirs directions' time loops, one task each: direction d's step t is lstm_forward's
    (gate columns from 4hc d, cells from hc d, rows t nb .. t nb + bs[t]); its product
    h_{t-1} @ U from h (the read copy of y: y itself, or its quantized copy) through
    ut = U^T into r; the first step reads zeros for r and c_prev. elementwise False: the
    products alone (ops.GemmOnly). Steps s0 .. s1 - 1 of the loop (a loop in parts: the
    exchange polled between them); the cells of step s0 - 1 are there."""
    steps = bs.shape[0]
    uts, rs = (ut0, ut1), (r0, r1)
    for d in prange(dirs):
        ut, r = uts[d], rs[d]
        ga, gh = d * GATES * hc, d * hc
        prev = -1 if s0 == 0 else (s0 - 1 if d == 0 else steps - s0) * nb
        for s in range(s0, s1):
            t = s if d == 0 else steps - 1 - s
            m, now = bs[t], t * nb
            if prev < 0:   # the first step: no previous output or cell
                rr, cp = zeros[:m], zeros[:m]
            else:
                x = xs[d, :m * hc].reshape((m, hc))   # C-contiguous: the sums vectorize
                for i in range(m):
                    for j in range(hc):
                        x[i, j] = h[prev + i, gh + j]
                rr, cp = r[:m], cells[prev:prev + m]
                for gate in range(GATES):
                    _product_columns(x, ut, rr, m, gate * hc, gate * hc + hc, hc)
            if elementwise:
                a, c, hh = gates[now:now + m], cells[now:now + m], y[now:now + m]
                for n in range(m):
                    _forward_cells(a, rr, b, cp, c, hh, ga, gh, hc, n, 0, hc)
            prev = now


@njit(parallel=True, cache=True)
def _backward_sequences(dirs, elementwise, gates, cells, dy, u0, u1, dr0, dr1, dc0, dc1, zeros,
                        bs, nb, hc, xs, s0, s1):
    """dirs directions' time loops backwards, one task each (as lstm_backward's steps): the
    later step's gate gradients @ U^T (u = U) into dr, then the step; dc zeroed by the
    caller; steps s0 .. s1 - 1 (dc carries the state from the part before)."""
    steps = bs.shape[0]
    g4 = GATES * hc
    us, drs, dcs = (u0, u1), (dr0, dr1), (dc0, dc1)
    for d in prange(dirs):
        u, drb, dcb = us[d], drs[d], dcs[d]
        ga, gh = d * g4, d * hc
        later = -1 if s0 == 0 else (steps - s0 if d == 0 else s0 - 1) * nb
        for s in range(s0, s1):
            t = steps - 1 - s if d == 0 else s
            m, now = bs[t], t * nb
            first = t == 0 if d == 0 else t == steps - 1
            earlier = (t - 1) * nb if d == 0 else (t + 1) * nb
            cp = zeros[:m] if first else cells[earlier:earlier + m]
            if later < 0:   # the direction's last step: nothing flows back into it
                dr = zeros[:m]
            else:
                x = xs[d, :m * g4].reshape((m, g4))
                for i in range(m):
                    for j in range(g4):
                        x[i, j] = gates[later + i, ga + j]
                dr = drb[:m]
                _product_columns(x, u, dr, m, 0, hc, g4)
            if elementwise:
                a, c, dh, dc = gates[now:now + m], cells[now:now + m], dy[now:now + m], dcb[:m]
                for n in range(m):
                    _backward_cells(a, cp, c, dh, dr, dc, ga, gh, hc, n, 0, hc)
            later = now


def whole_sequences(nb, hc, dirs):
    """Whether a layer's directions can run their time loops in one launch: at most
    SMALL_ROWS rows a step, and one block of cells per direction on this many threads."""
    return nb <= SMALL_ROWS and cell_block(hc, dirs) >= hc


def lstm_sequences_forward(dirs, gates, cells, h, y, uts, rs, b, zeros, bs, nb, hc, xs,
                           elementwise=True, s0=0, s1=None):
    """An LSTM layer's forward time loops (steps s0 .. s1 - 1, default all), each direction's
    in one task (_forward_sequences; whole_sequences must hold): uts, rs the directions' U^T
    and product rows."""
    ut1, r1 = (uts[1], rs[1]) if dirs == 2 else (uts[0], rs[0])
    _forward_sequences(dirs, elementwise, gates, cells, h, y, uts[0], ut1, rs[0], r1, b, zeros,
                       bs, nb, hc, xs, s0, len(bs) if s1 is None else s1)


def lstm_sequences_backward(dirs, gates, cells, dy, us, drs, dcs, zeros, bs, nb, hc, xs,
                            elementwise=True, s0=0, s1=None):
    """An LSTM layer's backward time loops (_backward_sequences), steps s0 .. s1 - 1."""
    u1, dr1, dc1 = (us[1], drs[1], dcs[1]) if dirs == 2 else (us[0], drs[0], dcs[0])
    _backward_sequences(dirs, elementwise, gates, cells, dy, us[0], u1, drs[0], dr1, dcs[0],
                        dc1, zeros, bs, nb, hc, xs, s0, len(bs) if s1 is None else s1)


# a time step's product of at most SMALL_ROWS rows: small_matmul_nt on one thread, not BLAS
# (a fixed bound, so that the bits do not depend on the threads; on one Zen 4 core it beats
# OpenBLAS's two threads up to about 16 rows: experiments/small_matmul_ab.py)
SMALL_ROWS = 16
# the dot products' sums may be reordered (vector lanes, then a tree): what lets LLVM keep 16
# sums in vector registers. The order is fixed by the compiled code, so a machine's bits are
# the same run to run; they differ between AVX2 and AVX-512 (8 or 16 lanes), within the
# float32 dot product's bound (tests/test_lstm.py)
_DOT = {"reassoc", "contract", "nsz"}


@njit(fastmath=_DOT, cache=True)
def _rows4(a, bt, out, i, j, k_all):
    """out[i:i+4, j:j+4] = a[i:i+4] . bt[j:j+4]: 16 sums in registers, 8 loads a k."""
    s00 = s01 = s02 = s03 = out.dtype.type(0)
    s10 = s11 = s12 = s13 = out.dtype.type(0)
    s20 = s21 = s22 = s23 = out.dtype.type(0)
    s30 = s31 = s32 = s33 = out.dtype.type(0)
    for k in range(k_all):
        a0, a1, a2, a3 = a[i, k], a[i + 1, k], a[i + 2, k], a[i + 3, k]
        b0, b1, b2, b3 = bt[j, k], bt[j + 1, k], bt[j + 2, k], bt[j + 3, k]
        s00 += a0 * b0
        s01 += a0 * b1
        s02 += a0 * b2
        s03 += a0 * b3
        s10 += a1 * b0
        s11 += a1 * b1
        s12 += a1 * b2
        s13 += a1 * b3
        s20 += a2 * b0
        s21 += a2 * b1
        s22 += a2 * b2
        s23 += a2 * b3
        s30 += a3 * b0
        s31 += a3 * b1
        s32 += a3 * b2
        s33 += a3 * b3
    out[i, j], out[i, j + 1], out[i, j + 2], out[i, j + 3] = s00, s01, s02, s03
    out[i + 1, j], out[i + 1, j + 1], out[i + 1, j + 2], out[i + 1, j + 3] = s10, s11, s12, s13
    out[i + 2, j], out[i + 2, j + 1], out[i + 2, j + 2], out[i + 2, j + 3] = s20, s21, s22, s23
    out[i + 3, j], out[i + 3, j + 1], out[i + 3, j + 2], out[i + 3, j + 3] = s30, s31, s32, s33


@njit(fastmath=_DOT, cache=True)
def _rows2(a, bt, out, i, j, k_all):
    """out[i:i+2, j:j+4]: 8 sums."""
    s00 = s01 = s02 = s03 = out.dtype.type(0)
    s10 = s11 = s12 = s13 = out.dtype.type(0)
    for k in range(k_all):
        a0, a1 = a[i, k], a[i + 1, k]
        b0, b1, b2, b3 = bt[j, k], bt[j + 1, k], bt[j + 2, k], bt[j + 3, k]
        s00 += a0 * b0
        s01 += a0 * b1
        s02 += a0 * b2
        s03 += a0 * b3
        s10 += a1 * b0
        s11 += a1 * b1
        s12 += a1 * b2
        s13 += a1 * b3
    out[i, j], out[i, j + 1], out[i, j + 2], out[i, j + 3] = s00, s01, s02, s03
    out[i + 1, j], out[i + 1, j + 1], out[i + 1, j + 2], out[i + 1, j + 3] = s10, s11, s12, s13


@njit(fastmath=_DOT, cache=True)
def _rows1(a, bt, out, i, j, k_all):
    """out[i, j:j+4]: 4 sums."""
    s0 = s1 = s2 = s3 = out.dtype.type(0)
    for k in range(k_all):
        a0 = a[i, k]
        s0 += a0 * bt[j, k]
        s1 += a0 * bt[j + 1, k]
        s2 += a0 * bt[j + 2, k]
        s3 += a0 * bt[j + 3, k]
    out[i, j], out[i, j + 1], out[i, j + 2], out[i, j + 3] = s0, s1, s2, s3


@njit(fastmath=_DOT, cache=True)
def _dot(a, bt, out, i, j, k_all):
    s = out.dtype.type(0)
    for k in range(k_all):
        s += a[i, k] * bt[j, k]
    out[i, j] = s


@njit(cache=True)
def small_matmul_nt(a, bt, out):
    """out (M, N) = a (M, K) @ bt (N, K)^T for a time step's few rows (SMALL_ROWS): dot
    products along K, both operands contiguous in it, in register blocks of 4 rows x 4
    columns (then 2 and 1 rows); the block's 4 rows of bt (4K values) stay in L1 while every
    row of a passes, so bt streams from memory once. OpenBLAS packs bt on every call and its
    kernels want M >= 16; at M = 5, K = 256, N = 1024 (a BLSTM step of 5 sequences) this is
    1.3-1.4x the axpy-form kernel it replaced and 2-3.5x OpenBLAS
    (experiments/ctc_step_bench.md). The LSTM's forward passes U^T (a copy a pass), its
    backward U itself. a is copied into a C-contiguous buffer first (a few KB): the LSTM's
    rows are column slices of a wider buffer, and on a strided a LLVM does not vectorize the
    sums (4-5x slower, measured); bt and out must be C-contiguous to be fast."""
    m, k_all = a.shape
    _product_columns(np.ascontiguousarray(a), bt, out, m, 0, bt.shape[0], k_all)


@njit(cache=True)
def _product_columns(a, bt, out, m, j0, j1, k_all):
    """out[:m, j0:j1] = a[:m] . bt[j0:j1] (j0 a multiple of 4): small_matmul_nt's blocks,
    the columns of one launch's task (lstm_recurrent_forward) or all of them."""
    j4 = j0 + (j1 - j0) // 4 * 4
    for j in range(j0, j4, 4):
        i = 0
        while i + 4 <= m:
            _rows4(a, bt, out, i, j, k_all)
            i += 4
        if i + 2 <= m:
            _rows2(a, bt, out, i, j, k_all)
            i += 2
        if i < m:
            _rows1(a, bt, out, i, j, k_all)
    for j in range(j4, j1):
        for i in range(m):
            _dot(a, bt, out, i, j, k_all)


@njit(parallel=True, cache=True)
def column_sums(d, gb, partial):
    """gb (1, M) <- column sums of d (N, M), in NCHUNK row chunks added in a fixed order;
    partial (C, >= M) scratch. (The LSTM's bias gradient: the gate gradients of all steps.)"""
    n, m = d.shape
    rows = (n + NCHUNK - 1) // NCHUNK
    for c in prange(NCHUNK):
        p = partial[c]
        p[:m] = 0
        for i in range(c * rows, min(n, (c + 1) * rows)):
            for j in range(m):
                p[j] += d[i, j]
    for j in prange(m):
        acc = partial[0, j]
        for c in range(1, NCHUNK):
            acc += partial[c, j]
        gb[0, j] = acc


@njit(parallel=True, cache=True)
def tanh_kernel(x, out):
    """out = ftanh(x), 1-D; exists so that the tests can compare ftanh with np.tanh."""
    for i in prange(x.size):
        out[i] = ftanh(x[i])


# ---------------------------------------------------------------------------------------------
# NumPy references (float64 inside)


def _sig(v):
    return 1.0 / (1.0 + np.exp(-v))


def ref_forward_step(a, r, b, c_prev):
    """-> (gate activations (B, 4H), c, h) of one step."""
    v = a.astype(np.float64) + r + b
    hc = v.shape[1] // GATES
    i, f = _sig(v[:, :hc]), _sig(v[:, hc:2 * hc])
    g, o = np.tanh(v[:, 2 * hc:3 * hc]), _sig(v[:, 3 * hc:])
    c = f * c_prev + i * g
    return np.concatenate([i, f, g, o], axis=1), c, o * np.tanh(c)


def ref_backward_step(gates, c_prev, c, dh, dr, dc):
    """-> (dLoss/d(preactivations) (B, 4H), dLoss/dc_{t-1}) of one step."""
    gates, c_prev, c = (np.asarray(v, np.float64) for v in (gates, c_prev, c))
    hc = gates.shape[1] // GATES
    i, f, g, o = (gates[:, k * hc:(k + 1) * hc] for k in range(GATES))
    tc = np.tanh(c)
    d = np.asarray(dh, np.float64) + dr
    dcv = dc + d * o * (1 - tc * tc)
    da = np.concatenate([dcv * g * i * (1 - i), dcv * c_prev * f * (1 - f),
                         dcv * i * (1 - g * g), d * tc * o * (1 - o)], axis=1)
    return da, dcv * f


def ref_lstm(x, Wx, U, b, steps, reverse=False):
    """A whole LSTM direction in float64: x (T*B, n_in) time-major -> h (T*B, H). The
    definition the layer's forward is tested against (and the gradient check perturbs)."""
    x = np.asarray(x, np.float64)
    nb = len(x) // steps
    hc = U.shape[0]
    h = np.zeros((len(x), hc))
    hp, cp = np.zeros((nb, hc)), np.zeros((nb, hc))
    for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
        rows = slice(t * nb, (t + 1) * nb)
        _, cp, hp = ref_forward_step(x[rows] @ Wx, hp @ U, b, cp)
        h[rows] = hp
    return h
