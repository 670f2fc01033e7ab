"""hpcsgd.model.lstm: the LSTM kernels against their NumPy references, the layer's forward
against the whole-sequence definition, finite-difference gradient checks (float64, uni- and
bidirectional, masked frames, the input), and learning a task only memory can solve."""
import numpy as np
import pytest

from hpcsgd.model import kernels_lstm as KL
from hpcsgd.model.lstm import lstm
from hpcsgd.optim import Optimizer

T, B, D, H, V = 5, 3, 4, 6, 7


def _net(bidirectional=True, bottleneck=(5,), dtype=np.float64, cells=(H, H)):
    net = lstm(D, list(cells), V, bidirectional, list(bottleneck), "sigmoid", steps=T,
               max_batch=64, dtype=dtype)
    params = net.new_params()
    net.init(params, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    params.flat[:] += rng.standard_normal(params.size) * 0.1     # non-zero biases
    x = rng.standard_normal((T * B, D)).astype(dtype)
    y = rng.integers(0, V, T * B).astype(np.int32)
    y[[0, 4, 7, 14]] = -1                                         # context / padding frames
    return net, params, x, y


def test_ftanh_float32_absolute_error():
    """ftanh's float32 formula: within 2.5e-7 absolute of tanh everywhere (a few ulp of 1,
    from the 1-ulp exp and two roundings); exact +-1 far out, odd."""
    x = np.linspace(-20, 20, 400_001, dtype=np.float32)
    out = np.empty_like(x)
    KL.tanh_kernel(x, out)
    assert np.max(np.abs(out - np.tanh(x.astype(np.float64)))) < 2.5e-7
    assert np.array_equal(out, -out[::-1])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_step_kernels_match_numpy(dtype):
    """The fused step kernels on the second direction's columns of a shared gate, cell and
    output buffer (as the BLSTM calls them) against the float64 references. float32: the
    values are O(1) and each is a few roundings from its inputs (exp within 1 ulp), so
    1e-6 absolute; float64: 1e-13."""
    rng = np.random.default_rng(2)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-13, atol=1e-13)
    gates = (rng.standard_normal((B, 8 * H)) * 3).astype(dtype)
    r = rng.standard_normal((B, 4 * H)).astype(dtype)
    b = rng.standard_normal((1, 8 * H)).astype(dtype)
    c_prev = rng.standard_normal((B, H)).astype(dtype)
    cells, out = np.zeros((B, 2 * H), dtype), np.zeros((B, 2 * H), dtype)
    a = gates[:, 4 * H:]
    ref_gates, ref_c, ref_h = KL.ref_forward_step(a, r, b[:, 4 * H:], c_prev)
    wide_prev = np.zeros((B, 2 * H), dtype)
    wide_prev[:, H:] = c_prev
    KL.lstm_forward_step(gates, r, b, wide_prev, cells, out, 4 * H, H, H)
    np.testing.assert_allclose(a, ref_gates, **tol)
    np.testing.assert_allclose(cells[:, H:], ref_c, **tol)
    np.testing.assert_allclose(out[:, H:], ref_h, **tol)
    assert not cells[:, :H].any() and not out[:, :H].any()       # the other direction untouched
    dh, dr = rng.standard_normal((B, 2 * H)).astype(dtype), rng.standard_normal((B, H)).astype(dtype)
    dc = rng.standard_normal((B, H)).astype(dtype)
    ref_da, ref_dc = KL.ref_backward_step(a, c_prev, cells[:, H:], dh[:, H:], dr, dc)
    KL.lstm_backward_step(gates, wide_prev, cells, dh, dr, dc, 4 * H, H, H)
    np.testing.assert_allclose(a, ref_da, **tol)
    np.testing.assert_allclose(dc, ref_dc, **tol)
    partial, gb = np.empty((16, 8 * H), dtype), np.empty((1, 8 * H), dtype)
    d = rng.standard_normal((37, 8 * H)).astype(dtype)
    KL.column_sums(d, gb, partial)
    np.testing.assert_allclose(gb, d.astype(np.float64).sum(0, keepdims=True), rtol=10 * tol["rtol"],
                               atol=10 * tol["atol"] * 37)


def test_both_directions_in_one_launch_are_the_two_launches():
    """lstm_forward_step2 / lstm_backward_step2 (a BLSTM's step: the forward direction at
    time t, the backward one at another time) give the bits of one launch per direction."""
    rng = np.random.default_rng(5)
    T = 3
    gates = (rng.standard_normal((T * B, 8 * H)) * 3).astype(np.float32)
    b = rng.standard_normal((1, 8 * H)).astype(np.float32)
    r0, r1 = (rng.standard_normal((B, 4 * H)).astype(np.float32) for _ in range(2))
    cells = rng.standard_normal((T * B, 2 * H)).astype(np.float32)
    out = np.zeros((T * B, 2 * H), np.float32)
    t0, t1, p0, p1 = slice(0, B), slice(2 * B, 3 * B), slice(B, 2 * B), slice(B, 2 * B)
    g1, c1, o1 = gates.copy(), cells.copy(), out.copy()
    KL.lstm_forward_step(g1[t0], r0, b, c1[p0], c1[t0], o1[t0], 0, 0, H)
    KL.lstm_forward_step(g1[t1], r1, b, c1[p1], c1[t1], o1[t1], 4 * H, H, H)
    KL.lstm_forward_step2(gates[t0], r0, cells[p0], cells[t0], out[t0],
                          gates[t1], r1, cells[p1], cells[t1], out[t1], b, H)
    assert np.array_equal(gates, g1) and np.array_equal(cells, c1) and np.array_equal(out, o1)
    dh = rng.standard_normal((T * B, 2 * H)).astype(np.float32)
    dr0, dr1, dc0, dc1 = (rng.standard_normal((B, H)).astype(np.float32) for _ in range(4))
    g1, e0, e1 = gates.copy(), dc0.copy(), dc1.copy()
    KL.lstm_backward_step(g1[t0], cells[p0], cells[t0], dh[t0], dr0, e0, 0, 0, H)
    KL.lstm_backward_step(g1[t1], cells[p1], cells[t1], dh[t1], dr1, e1, 4 * H, H, H)
    KL.lstm_backward_step2(gates[t0], cells[p0], cells[t0], dh[t0], dr0, dc0,
                           gates[t1], cells[p1], cells[t1], dh[t1], dr1, dc1, H)
    assert np.array_equal(gates, g1) and np.array_equal(dc0, e0) and np.array_equal(dc1, e1)


def _cell_blocks(count):
    def cell_block(hc, dirs):   # kernels_lstm.cell_block's rounding, a fixed number of blocks
        return -(-(-(-hc // count)) // 4) * 4
    return cell_block


@pytest.mark.parametrize("hc", [8, 6])
def test_step_with_its_products_in_the_launch_is_the_product_then_the_step(monkeypatch, hc):
    """A CPU rank's BLSTM step (ops.lstm_forward_step / lstm_backward_step: each task makes
    its cells' columns of the recurrent product, then steps them) against the product made
    first (small_matmul_nt; BLAS above SMALL_ROWS rows) and the step kernel after it: the
    same bits for any split of the cells into tasks (1, 2, 3 blocks of a direction), with
    the directions at different row counts, one at its first step, and a direction of more
    than SMALL_ROWS rows. hc = 6 (not a multiple of 4): the product's columns are grouped
    by 4 from each gate's start, not from column 0, so there the two paths may differ in the
    last bits; every split still gives the same bits, each product within the dot product's
    bound of float64."""
    from hpcsgd.model import ops as O
    rng = np.random.default_rng(8)
    g4 = 4 * hc
    cpu = O.CpuOps(64, 8 * hc, np.float32)
    u = [rng.standard_normal((hc, g4)).astype(np.float32) for _ in range(2)]
    ut = [np.ascontiguousarray(w.T) for w in u]
    b = rng.standard_normal((1, 2 * g4)).astype(np.float32)
    for m0, m1, first1 in ((5, 3, False), (4, 4, True), (KL.SMALL_ROWS + 3, 2, False)):
        rows = m0 + m1
        h_prev = rng.standard_normal((rows, 2 * hc)).astype(np.float32)
        gates0 = (rng.standard_normal((rows, 2 * g4)) * 2).astype(np.float32)
        c_prev = rng.standard_normal((rows, 2 * hc)).astype(np.float32)
        dy = rng.standard_normal((rows, 2 * hc)).astype(np.float32)
        later = rng.standard_normal((rows, 2 * g4)).astype(np.float32)
        dc0 = rng.standard_normal((2, rows, hc)).astype(np.float32)
        results = []
        for blocks in (None, 1, 2, 3):   # None: the product, then the step
            if blocks is not None:
                monkeypatch.setattr(KL, "cell_block", _cell_blocks(blocks))
            gates, cells, out = gates0.copy(), np.zeros((rows, 2 * hc), np.float32), \
                np.zeros((rows, 2 * hc), np.float32)
            recs = np.full((2, rows, g4), np.nan, np.float32)
            zeros, zero_dr = np.zeros((rows, g4), np.float32), np.zeros((rows, hc), np.float32)
            xs = np.empty((2, KL.SMALL_ROWS * g4), np.float32)
            r0, r1 = slice(0, m0), slice(m0, rows)   # the directions' rows (different steps)
            steps = [(h_prev[r0, :hc], u[0], ut[0], recs[0, :m0], gates[r0], c_prev[r0],
                      cells[r0], out[r0]),
                     (None if first1 else h_prev[r1, hc:], u[1], ut[1],
                      zeros[:m1] if first1 else recs[1, :m1], gates[r1], c_prev[r1],
                      cells[r1], out[r1])]
            if blocks is None:
                O.product_then_step(cpu, steps, b, hc)
            else:
                O.lstm_forward_step(cpu, steps, b, hc, xs)
            products = recs.copy()
            drs, dc = np.full((2, rows, hc), np.nan, np.float32), dc0.copy()
            back = [(later[r0, :g4], u[0], drs[0, :m0], gates[r0], c_prev[r0], cells[r0],
                     dy[r0], dc[0, :m0]),
                    (None if first1 else later[r1, g4:], u[1],
                     zero_dr[:m1] if first1 else drs[1, :m1], gates[r1], c_prev[r1],
                     cells[r1], dy[r1], dc[1, :m1])]
            if blocks is None:
                O.product_then_step_backward(cpu, back, hc)
            else:
                O.lstm_backward_step(cpu, back, hc, xs)
            results.append((products, cells, out, drs, gates, dc))
            monkeypatch.undo()
        for got in results[2:]:   # every split: the same bits
            for a, want in zip(got, results[1]):
                assert np.array_equal(a, want, equal_nan=True), (m0, m1, hc)
        if hc % 4 == 0:           # and those of the product, then the step
            for a, want in zip(results[1], results[0]):
                assert np.array_equal(a, want, equal_nan=True), (m0, m1, hc)
        products, _, _, drs, _, _ = results[1]
        eps = 2.0 ** -24 * g4 / (1 - 2.0 ** -24 * g4) + 2.0 ** -53 * g4
        x64, u64 = h_prev[r0, :hc].astype(np.float64), u[0].astype(np.float64)
        assert np.all(np.abs(products[0, :m0] - x64 @ u64) <= eps * (np.abs(x64) @ np.abs(u64)))
        l64 = later[r0, :g4].astype(np.float64)
        assert np.all(np.abs(drs[0, :m0] - l64 @ u64.T) <= eps * (np.abs(l64) @ np.abs(u64.T)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_small_matmul_is_within_the_dot_product_bound(dtype):
    """small_matmul_nt (a time step's recurrent product, <= SMALL_ROWS rows) against float64
    for every row count its blocks split into (4, 2, 1 rows) and a column count that is not
    a multiple of 4. Any order of a K-term dot product's sums errs by at most
    gamma_K * sum |a_k b_k|, gamma_K = K u / (1 - K u) (Higham, Theorem 3.1): the bound holds
    whatever order the vector lanes give on this CPU; the float64 reference's own error (the
    same bound at u = 2^-53) is added."""
    rng = np.random.default_rng(11)
    u = np.finfo(dtype).eps / 2
    for k_all, n in ((256, 1024), (37, 30)):
        bt = rng.standard_normal((n, k_all)).astype(dtype)
        for m in range(1, KL.SMALL_ROWS + 1):
            a = rng.standard_normal((m, k_all)).astype(dtype)
            out = np.full((m, n), np.nan, dtype)
            KL.small_matmul_nt(a, bt, out)
            a64, b64 = a.astype(np.float64), bt.astype(np.float64)
            gamma = sum(k_all * e / (1 - k_all * e) for e in (u, 2.0 ** -53))
            bound = gamma * (np.abs(a64) @ np.abs(b64).T)
            assert np.all(np.abs(out - a64 @ b64.T) <= bound), (k_all, n, m)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_forward_equals_the_sequence_definition(bidirectional):
    net, params, x, y = _net(bidirectional)
    net.forward(params, x, T * B)
    layer = net.layers[0]
    g = 4 * H
    W, b = params[layer.W], params[layer.b]
    want = [KL.ref_lstm(x, W[:, :g], params[layer.U[0]], b[:, :g], T)]
    if bidirectional:
        want.append(KL.ref_lstm(x, W[:, g:], params[layer.U[1]], b[:, g:], T, reverse=True))
    np.testing.assert_allclose(net.acts[0][:T * B], np.hstack(want), rtol=1e-13, atol=1e-14)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_gradient_matches_finite_differences(bidirectional):
    """Every parameter (W, U of both directions, b, the bottleneck and the softmax), with
    four frames masked out of the loss: elements that cover every row and every column of
    each (a wrong gate, direction, unit, input or time step shows in one of them)."""
    net, params, x, y = _net(bidirectional)
    n = T * B
    grads, scratch = net.new_params(), net.new_params()
    net.forward_backward(params, grads, x, y, n)
    eps = 1e-6
    worst = 0.0
    probes = set()
    for m in params.matrices:
        probes |= {m.offset + c * m.n_rows + (5 * c + 1) % m.n_rows for c in range(m.n_cols)}
        probes |= {m.offset + (3 * r % m.n_cols) * m.n_rows + r for r in range(m.n_rows)}
    assert len(probes) < params.size / 2
    for i in sorted(probes):
        old = params.flat[i]
        params.flat[i] = old + eps
        plus, _ = net.forward_backward(params, scratch, x, y, n)
        params.flat[i] = old - eps
        minus, _ = net.forward_backward(params, scratch, x, y, n)
        params.flat[i] = old
        fd = (plus - minus) / (2 * eps)
        # central differences: O(eps^2) truncation, ~1e-16 * CE / eps rounding (~1e-9)
        worst = max(worst, abs(fd - grads.flat[i]) - 1e-6 * abs(fd))
    assert worst < 1e-8, worst
    assert all(np.abs(grads[layer.U[0]]).max() > 1e-4 for layer in net.layers[:2])


@pytest.mark.parametrize("bidirectional", [False, True])
def test_input_gradient_of_a_layer_matches_finite_differences(bidirectional):
    """dLoss/dx of an LSTM layer (what the layer below it trains on): the second layer's
    input gradient against differences of the network above the first layer (a network
    made of the stack's upper layers, fed the first layer's output)."""
    net, params, x, y = _net(bidirectional)
    n, width = T * B, (2 if bidirectional else 1) * H
    net.forward(params, x, n)
    h0 = net.acts[0][:n].copy()                 # the input of layer 1
    upper = lstm(width, [H], V, bidirectional, [5], "sigmoid", steps=T, max_batch=64,
                 dtype=np.float64)
    up = upper.new_params()
    theirs = [s.name for s in net.specs[-len(upper.specs):]]   # net's layers 1, 2, output
    rename = dict(zip([s.name for s in upper.specs], theirs))
    for name in up.views:                       # layer 1 of `net` is layer 0 of `upper`
        up[name][...] = params[rename[name]]
    grads = net.new_params()
    net.forward_backward(params, grads, x, y, n)
    dx = net.delta[:n * width].reshape(n, width)   # left by layer 1 for layer 0
    g_up = upper.new_params()
    eps, worst = 1e-6, 0.0
    for k in np.random.default_rng(3).choice(h0.size, 40, replace=False):
        i, j = divmod(int(k), width)
        hp, hm = h0.copy(), h0.copy()
        hp[i, j] += eps
        hm[i, j] -= eps
        fd = (upper.forward_backward(up, g_up, hp, y, n)[0]
              - upper.forward_backward(up, g_up, hm, y, n)[0]) / (2 * eps)
        worst = max(worst, abs(fd - dx[i, j]) - 1e-6 * abs(fd))
    assert worst < 1e-8, worst


def test_masked_frames_add_nothing():
    """A frame labelled -1 contributes no CE, no hit and no gradient through the loss: the
    gradient equals that of the same batch with its loss rows removed by hand (float64
    reference: the sum over labelled frames only)."""
    net, params, x, y = _net(True)
    n = T * B
    g1 = net.new_params()
    ce1, c1 = net.forward_backward(params, g1, x, y, n)
    logpost = net.forward(params, x, n).copy()
    rows = np.flatnonzero(y >= 0)
    assert abs(ce1 + logpost[rows, y[rows]].sum()) < 1e-10
    assert c1 == int((logpost.argmax(1) == y)[rows].sum())
    y2 = y.copy()
    y2[0] = 1                                   # a masked frame now counted: CE grows
    ce2, _ = net.forward_backward(params, net.new_params(), x, y2, n)
    assert abs(ce2 - ce1 + logpost[0, 1]) < 1e-10


def test_progress_and_bad_shapes():
    net, params, x, y = _net(True)
    calls = []
    plain, poked = net.new_params(), net.new_params()
    net.forward_backward(params, plain, x, y, T * B)
    net.forward_backward(params, poked, x, y, T * B, lambda: calls.append(1))
    assert np.array_equal(plain.flat, poked.flat) and len(calls) > 0
    with pytest.raises(ValueError, match="whole sequences"):
        net.forward_backward(params, plain, x, y, T * B - 1)
    # a whole utterance: steps = n, one sequence
    out = net.forward(params, x, T * B, steps=T * B)
    assert out.shape == (T * B, V) and np.isfinite(out).all()


@pytest.mark.parametrize("bidirectional", [False, True])
def test_mixed_precision_stores_float16_and_stays_within_float16_rounding(bidirectional):
    """train.precision=mixed on a (B)LSTM: after forward and backward every stored gate,
    cell, output and their gradients is a float16 value; the weight gradient is the float64
    one to within float16 rounding (unit roundoff u = 2^-11, a few dozen roundings deep: 64 u
    in norm), and really rounded (10x farther from float64 than the float32 gradient)."""
    def grads(dtype, precision="float32"):
        net = lstm(D, [H, H], V, bidirectional, [5], "sigmoid", steps=T, max_batch=64,
                   dtype=dtype, precision=precision)
        _, params64, x, y = _net(bidirectional)
        params = net.new_params()
        params.flat[:] = params64.flat
        g = net.new_params()
        net.forward_backward(params, g, x.astype(dtype), y, T * B)
        if precision == "mixed":
            net.unscale(g, 1.0)
        return net, np.asarray(g.flat, np.float64)

    net, mixed = grads(np.float32, "mixed")
    _, g32 = grads(np.float32)
    _, g64 = grads(np.float64)
    for ws in net.workspaces[:2]:
        for name in ("gates", "cells"):
            stored = ws[name][:T * B]
            assert np.array_equal(stored, stored.astype(np.float16).astype(np.float32)), name
    u = 2.0 ** -11
    err = np.linalg.norm(mixed - g64) / np.linalg.norm(g64)
    assert err <= 64 * u, err
    assert np.linalg.norm(mixed - g64) > 10 * np.linalg.norm(g32 - g64)


def test_float32_agrees_with_float64():
    net64, p64, x, y = _net(True)
    net32 = lstm(D, [H, H], V, True, [5], "sigmoid", steps=T, max_batch=64)
    p32 = net32.new_params()
    p32.flat[:] = p64.flat
    g64, g32 = net64.new_params(), net32.new_params()
    ce64, _ = net64.forward_backward(p64, g64, x, y, T * B)
    ce32, _ = net32.forward_backward(p32, g32, x.astype(np.float32), y, T * B)
    assert abs(ce32 - ce64) < 1e-5 * ce64
    # float32 rounding of O(1) values through ~2 x T steps of recurrence: 1e-4 of the
    # gradient's scale
    scale = np.abs(g64.flat).max()
    assert np.abs(g32.flat - g64.flat).max() < 1e-4 * scale


def test_blstm_learns_a_task_that_needs_memory():
    """Label of frame t = the sign pattern of the input 2 frames EARLIER and 2 frames LATER
    (4 classes): no frame-local model can exceed chance; a BLSTM must pass 95%."""
    rng = np.random.default_rng(7)
    steps, nb = 12, 32
    net = lstm(2, [16], 4, True, [], steps=steps, max_batch=steps * nb)
    params, grads = net.new_params(), net.new_params()
    net.init(params, np.random.default_rng(8))
    opt = Optimizer(params.size, momentum_time_constant=2000.0)

    def batch():
        s = rng.choice([-1.0, 1.0], (steps, nb, 2)).astype(np.float32)
        lab = np.full((steps, nb), -1, np.int32)
        lab[2:-2] = (s[:-4, :, 0] > 0) * 2 + (s[4:, :, 1] > 0)
        return s.reshape(steps * nb, 2), lab.reshape(-1)

    for _ in range(600):
        x, y = batch()
        net.forward_backward(params, grads, x, y, steps * nb)
        opt.step(params.flat, grads.flat, 5e-3, int((y >= 0).sum()))
    x, y = batch()
    _, correct = net.forward_backward(params, grads, x, y, steps * nb)
    assert correct / (y >= 0).sum() >= 0.95


@pytest.mark.parametrize("encoder", [["blstm 8", "blstm 6"], ["lstm 8"]])
def test_whole_sequences_in_one_launch_are_the_steps(monkeypatch, encoder):
    """A CPU rank's LSTM layer with each direction's whole time loop in one task
    (kernels_lstm._forward_sequences / _backward_sequences), also in parts of a few steps,
    against one launch per step: the same loss and gradients, bit for bit, on a CTC model over utterances of different
    lengths (the directions' rows shrink and grow as sequences end and start), hc = 6 too."""
    from hpcsgd.bench.train import builder_shape
    from hpcsgd.data.utterances import Targets
    from hpcsgd.model import build
    from hpcsgd.model import ops as O
    from hpcsgd.step import gradient_buffers
    shape = dict(type="ctc", input_dim=12, encoder=encoder, num_tokens=7)
    frames = np.array([23, 17, 17, 9, 4])
    n = len(frames) * int(frames.max())   # time-major rows, padded to the longest
    per = np.array([5, 4, 3, 2, 1])
    rng = np.random.default_rng(3)
    targets = Targets(frames, rng.integers(1, 7, per.sum()).astype(np.int32),
                      np.concatenate([[0], np.cumsum(per)]).astype(np.int64),
                      np.arange(5, dtype=np.uint64))
    x = rng.standard_normal((n, 12)).astype(np.float32)
    # one block of cells per direction (what whole sequences need) on any number of threads
    monkeypatch.setattr(KL, "cell_block", lambda hc, dirs: -(-hc // 4) * 4)
    results = []
    in_parts = O.in_parts
    for mode in ("whole", "parts", "steps"):
        if mode == "parts":   # the loops in parts of 3 steps, as with an exchange to poll
            monkeypatch.setattr(O, "in_parts", lambda run, steps, progress, every:
                                in_parts(run, steps, lambda: None, 3))
        if mode == "steps":
            monkeypatch.setattr(KL, "whole_sequences", lambda nb, hc, dirs: False)
        model = build(dict(builder_shape(shape), activation="relu"), max_batch=n, device="cpu",
                      precision="float32")
        params = model.new_params()
        model.init(params, np.random.default_rng(0))
        grads = gradient_buffers(model, True)[0]
        loss = model.forward_backward(params, grads, x, targets, n)
        results.append((loss, grads.flat.copy()))
    assert KL.whole_sequences(len(frames), 8, 2) is False   # the patch of the last run
    (loss_whole, g_whole), *others = results
    assert np.all(np.isfinite(loss_whole)) and np.abs(g_whole).max() > 0
    for loss, g in others:
        assert np.array_equal(loss, loss_whole) and np.array_equal(g, g_whole)
