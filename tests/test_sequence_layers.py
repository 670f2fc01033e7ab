"""The sequence layers over time-major batches of whole sequences: the unfold/fold/mask
kernels against their NumPy references, the 1-D convolution's gradient by finite
differences, and a padded batch of sequences of different lengths computing exactly what
each sequence computes alone (forward and backward; convolutions, strides, BLSTMs)."""
import numpy as np
import pytest

from hpcsgd.model import kernels_seq as KS
from hpcsgd.model.encoder import describe, encoder_layers, parse_spec, tdnn, time_stride
from hpcsgd.model.layers import SoftmaxOutput
from hpcsgd.model.lengths import Lengths
from hpcsgd.model.network import Network

EPS32 = np.finfo(np.float32).eps


def test_lengths_batch_sizes_and_strides():
    lengths = Lengths([7, 5, 5, 2])
    assert lengths.steps == 7 and lengths.rows == 28 and lengths.frames == 19
    assert lengths.batch_sizes.tolist() == [4, 4, 3, 3, 3, 1, 1] and not lengths.full
    half = lengths.strided(2)
    assert half.lengths.tolist() == [4, 3, 3, 1] and half.steps == 4
    assert half.batch_sizes.tolist() == [4, 3, 3, 1]
    assert Lengths.full_batch(3, 5).full and Lengths.full_batch(3, 5).batch_sizes.tolist() == [3] * 5
    with pytest.raises(ValueError, match="must not increase"):
        Lengths([2, 5])


@pytest.mark.parametrize("kernel,stride,dilation,left", [
    (5, 2, 1, 2), (3, 1, 1, 1), (3, 1, 2, 2), (4, 4, 1, 0), (1, 1, 1, 0), (11, 3, 1, 5)])
def test_unfold_fold_match_references_and_are_adjoint(kernel, stride, dilation, left):
    """unfold is a copy (exact); fold adds at most `kernel` float32 terms per value, so it is
    within kernel * eps * the largest |term| sum of the float64 reference; and fold is
    unfold's transpose: <unfold(x), c> = <x, fold(c)> (float64 kernels: 1e-12)."""
    rng = np.random.default_rng(kernel * 100 + stride * 10 + dilation)
    nb, steps_in, c = 3, 13, 5
    steps_out = -(-steps_in // stride)
    x = rng.standard_normal((steps_in * nb, c)).astype(np.float32)
    cols = np.full((steps_out * nb, kernel * c), np.nan, np.float32)
    shape = (nb, steps_in, steps_out, kernel, stride, dilation, left)
    KS.unfold(x, cols, *shape)
    assert np.array_equal(cols, KS.ref_unfold(x, *shape))
    dcols = rng.standard_normal(cols.shape).astype(np.float32)
    dx = np.full_like(x, np.nan)
    KS.fold(dcols, dx, *shape)
    ref = KS.ref_fold(dcols, *shape)
    bound = kernel * EPS32 * np.abs(KS.ref_fold(np.abs(dcols), *shape)) + 1e-30
    assert np.all(np.abs(dx - ref) <= bound)
    x64, c64 = x.astype(np.float64), dcols.astype(np.float64)
    u, f = np.empty_like(c64), np.empty_like(x64)
    KS.unfold(x64, u, *shape)
    KS.fold(c64, f, *shape)
    assert abs((u * c64).sum() - (x64 * f).sum()) < 1e-12 * np.abs(u * c64).sum()


def test_mask_rows_zeroes_exactly_the_padding():
    rng = np.random.default_rng(3)
    lengths = Lengths([6, 4, 4, 1])
    x = rng.standard_normal((lengths.rows, 3)).astype(np.float32)
    ref = KS.ref_mask(x, lengths.lengths, lengths.nb)
    KS.mask_rows(x, lengths.batch_sizes, lengths.nb)
    assert np.array_equal(x, ref)
    assert np.count_nonzero(np.all(x == 0, axis=1)) == lengths.rows - lengths.frames


def test_encoder_specs():
    assert parse_spec("conv 256  k11 s2 d2") == {"kind": "conv", "units": 256, "kernel": 11,
                                                  "stride": 2, "dilation": 2, "ahead": False,
                                                  "norm": None}
    assert parse_spec("conv 256 k11 ln")["norm"] == "ln" and parse_spec("conv 8 k3 s2 in") == {
        "kind": "conv", "units": 8, "kernel": 3, "stride": 2, "dilation": 1, "ahead": False,
        "norm": "in"}
    assert parse_spec("blstm 224  c10 r6") == {"kind": "blstm", "units": 224, "chunk": 10,
                                                "right": 6}
    assert parse_spec("blstm 8 c4")["right"] == 0 and "chunk" not in parse_spec("blstm 8")
    assert parse_spec("blstm 8 c4 r2 l3") == {"kind": "blstm", "units": 8, "chunk": 4,
                                              "right": 2, "layers": 3}
    with pytest.raises(ValueError, match="sizes must be >= 1"):
        parse_spec("blstm 8 c4 r2 l0")
    with pytest.raises(ValueError, match="the lookahead at most the chunk"):
        parse_spec("blstm 8 c2 r3")
    assert parse_spec("conv 8 k7 ahead ln") == {
        "kind": "conv", "units": 8, "kernel": 7, "stride": 1, "dilation": 1, "ahead": True,
        "norm": "ln"}
    assert parse_spec("blstm 320") == {"kind": "blstm", "units": 320}
    for bad in ("conv 256", "conv k3 256", "gru 128", "blstm", "conv 0 k3", "conv 8 k3 ln s2",
                "blstm 8 ln", "conv 8 k3 ln in", "conv 8 k3 bn"):
        with pytest.raises(ValueError, match="encoder layer"):
            parse_spec(bad)
    with pytest.raises(ValueError, match="first layer only"):
        encoder_layers(40, ["conv 8 k3", "stack 2"])
    specs = ["stack 2", "conv 8 k3 s2", "blstm 4", "blstm 4"]
    assert time_stride(specs) == 4 and describe(specs) == "stack 2, conv 8 k3 s2, blstm 4 x2"
    layers, width = encoder_layers(40, specs)
    assert [layer.n_out for layer in layers] == [80, 8, 8, 8] and width == 8
    with pytest.raises(ValueError, match="stride 1"):
        tdnn(40, ["conv 8 k3 s2"], 5)


def _init(net, seed=0):
    params = net.new_params()
    net.init(params, np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    params.flat[:] += rng.standard_normal(params.size) * 0.1   # non-zero biases
    return params


@pytest.mark.parametrize("norm", ["", " ln", " in", " ahead"])
def test_tdnn_gradient_by_finite_differences(norm):
    """float64: a convolution (dilated) + a BLSTM + the softmax on full chunks; every
    parameter of the convolutions (with " ln": their layer norms' gains and shifts too;
    " ahead": convolutions reading only the steps ahead) and
    the output checked at sampled coordinates against a central difference (step 1e-6:
    error ~1e-9 relative)."""
    steps, nb, D, V = 6, 2, 3, 4
    net = tdnn(D, ["conv 5 k3" + norm, "conv 4 k3 d2" + norm, "blstm 3"], V, "sigmoid",
               steps=steps, max_batch=64, dtype=np.float64)
    params = _init(net)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((steps * nb, D))
    y = rng.integers(0, V, steps * nb).astype(np.int32)
    y[[1, 6]] = -1
    grads = net.new_params()
    net.forward_backward(params, grads, x, y, len(y))

    def loss():
        g = net.new_params()
        return net.forward_backward(params, g, x, y, len(y))[0]

    names = ("enc.0.w", "enc.0.b", "enc.1.w", "enc.1.b", "out.w") + (
        ("enc.0.norm.g", "enc.1.norm.g") if norm in (" ln", " in") else ())
    assert set(names) <= {spec.name for spec in net.specs}
    assert_central_differences(params, grads, names, loss, rng, 6)


def assert_central_differences(params, grads, names, loss, rng, per):
    """`per` sampled coordinates of each parameter `names`: the gradient against a central
    difference of loss() (step 1e-6; float64: error ~1e-9 relative)."""
    for name in names:
        flat = params[name].reshape(-1)
        for k in rng.choice(flat.size, size=min(per, flat.size), replace=False):
            old = flat[k]
            flat[k] = old + 1e-6
            up = loss()
            flat[k] = old - 1e-6
            down = loss()
            flat[k] = old
            num = (up - down) / 2e-6
            got = grads[name].reshape(-1)[k]
            assert abs(got - num) <= 1e-6 * max(1.0, abs(num)), (name, k, got, num)


def _padded(seqs, D):
    """Time-major (T*nb, D) of sequences sorted by non-increasing length, zero padding."""
    lengths = Lengths([len(s) for s in seqs])
    x = np.zeros((lengths.steps, lengths.nb, D))
    for b, s in enumerate(seqs):
        x[:len(s), b] = s
    return x.reshape(-1, D), lengths


def _sequence_net(encoder, D, V):
    layers, width = encoder_layers(D, encoder, "relu")
    return Network(layers + [SoftmaxOutput("out", width, V)], 256, np.float64)


@pytest.mark.parametrize("encoder", [["conv 5 k3", "blstm 3", "dense 4"],
                                     ["conv 4 k3 d2", "lstm 3", "conv 5 k5"],
                                     ["lstm 3", "conv 5 k4 d2 ahead", "conv 4 k2 ahead ln"],
                                     ["lstm 3", "blstm 3 c2 r1", "dense 4"],
                                     ["conv 4 k3", "blstm 3 c3 r3"],
                                     ["lstm 3", "blstm 3 c2 r1 l2", "dense 4"],
                                     ["conv 5 k3 ln", "conv 4 k5 d2 ln", "lstm 3"],
                                     ["conv 5 k3 in", "conv 4 k5 d2 in", "blstm 3"]])
def test_padded_batch_is_its_sequences_alone(encoder):
    """Three sequences of 7, 5 and 2 steps in one padded batch (labels -1 on the padding):
    the same outputs on every valid step, the same summed loss and the same gradient as the
    three run one by one (float64: 1e-12 relative), whatever the padding would have added
    through the convolutions or the backward direction of a BLSTM."""
    D, V = 3, 4
    net = _sequence_net(encoder, D, V)
    params = _init(net, 2)
    rng = np.random.default_rng(11)
    seqs = [rng.standard_normal((n, D)) for n in (7, 5, 2)]
    labels = [rng.integers(0, V, len(s)) for s in seqs]
    x, lengths = _padded(seqs, D)
    y = np.full(lengths.rows, -1, np.int32)
    for b, lab in enumerate(labels):
        y[np.arange(len(lab)) * lengths.nb + b] = lab
    grads = net.new_params()
    loss, _ = net.forward_backward(params, grads, x, y, len(y), lengths=lengths)
    out = net.forward(params, x, len(x), lengths=lengths).copy()
    alone_loss, alone_grad = 0.0, np.zeros(params.size)
    for b, (s, lab) in enumerate(zip(seqs, labels)):
        g = net.new_params()
        alone_loss += net.forward_backward(params, g, s, lab.astype(np.int32), len(s),
                                           lengths=[len(s)])[0]
        alone_grad += g.flat
        alone = net.forward(params, s, len(s), lengths=[len(s)])
        np.testing.assert_allclose(out[np.arange(len(s)) * lengths.nb + b], alone,
                                   rtol=1e-12, atol=1e-12)
    assert abs(loss - alone_loss) <= 1e-12 * alone_loss
    np.testing.assert_allclose(grads.flat, alone_grad, rtol=1e-10, atol=1e-12)


def test_strided_encoder_forward_is_per_sequence():
    """Stacking, a stride-2 convolution and a BLSTM: the output has ceil(ceil(L/2)/2)
    steps per sequence (out_rows) and each valid output row equals the sequence's alone."""
    D, V = 3, 4
    net = _sequence_net(["stack 2", "conv 5 k5 s2", "blstm 3"], D, V)
    params = _init(net, 4)
    rng = np.random.default_rng(12)
    seqs = [rng.standard_normal((n, D)) for n in (11, 8, 3)]
    x, lengths = _padded(seqs, D)
    out_lengths = lengths.strided(2).strided(2)
    assert net.out_rows(len(x), lengths=lengths) == out_lengths.rows == 3 * 3
    out = net.forward(params, x, len(x), lengths=lengths).copy()
    for b, s in enumerate(seqs):
        alone = net.forward(params, s, len(s), lengths=[len(s)])
        steps = int(out_lengths.lengths[b])
        assert len(alone) == steps == -(-(-(-len(s) // 2)) // 2)
        np.testing.assert_allclose(out[np.arange(steps) * out_lengths.nb + b], alone,
                                   rtol=1e-12, atol=1e-12)


def test_a_lookahead_convolution_reads_the_steps_ahead_only():
    """`conv F kK dD ahead`: output step t = relu(b + sum_j x[t + j*D] W_j) (zeros past the
    sequence's end), against a float64 loop; the centred conv of the same weights reads
    (K-1)D//2 steps behind instead."""
    rng = np.random.default_rng(3)
    D, F, K, dil, T = 3, 4, 3, 2, 9
    for spec, left in (("conv 4 k3 d2 ahead", 0), ("conv 4 k3 d2", 2)):
        layers, _ = encoder_layers(D, [spec], "relu")
        net = Network(layers + [SoftmaxOutput("out", F, 2)], 64, np.float64)
        params = _init(net, 4)
        x = rng.standard_normal((T, D))
        net.forward(params, x, T, lengths=[T])
        got = net.acts[0][:T]   # the conv layer's output
        W = params["enc.0.w"].reshape(K, D, F)
        want = np.zeros((T, F))
        for t in range(T):
            z = params["enc.0.b"][0].copy()
            for j in range(K):
                src = t - left + j * dil
                if 0 <= src < T:
                    z += x[src] @ W[j]
            want[t] = np.maximum(z, 0)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def _assert_windows(got, seqs, lengths, C, R, plain, params, top):
    """Each chunk's rows of a chunked layer's output `got` (the padded batch of `seqs`) equal
    the plain network's layer `top` run over that chunk and the R steps after it alone
    (float64, 1e-12)."""
    for b, s in enumerate(seqs):
        for start in range(0, len(s), C):
            window = s[start:start + C + R]
            plain.forward(params, window, len(window), lengths=[len(window)])
            keep = min(C, len(window))
            rows = (start + np.arange(keep)) * lengths.nb + b
            np.testing.assert_allclose(got[rows], plain.acts[top][:keep], rtol=1e-12,
                                       atol=1e-12)


def test_a_chunked_blstm_is_a_blstm_over_each_window():
    """`blstm H cC rR`: three sequences (9, 7, 2 steps) in one padded batch; each chunk of 3
    steps' outputs are a plain BLSTM's (the same parameters) run over that chunk and the 2
    steps after it alone (float64, 1e-12), and the windows' input gradients summed back
    equal the whole layer's input gradient (every step: once as a chunk, at most once as a
    lookahead)."""
    from hpcsgd.model.lengths import Lengths
    D, C, R = 3, 3, 2
    net = _sequence_net([f"blstm 4 c{C} r{R}"], D, 5)
    plain = _sequence_net(["blstm 4"], D, 5)
    params = _init(net, 5)
    assert [sp.name for sp in net.specs] == [sp.name for sp in plain.specs]
    rng = np.random.default_rng(12)
    seqs = [rng.standard_normal((n, D)) for n in (9, 7, 2)]
    x, lengths = _padded(seqs, D)
    net.forward(params, x, len(x), lengths=lengths)
    got = net.acts[0][:lengths.rows].copy()
    layer = net.layers[0]
    wl, win_row, in_row, kept = layer.windows(lengths)
    assert wl.lengths.tolist() == [5, 5, 5, 4, 3, 2, 1]   # 0-5 3-8 6-9 | 0-5 3-7 6-7 | 0-2
    _assert_windows(got, seqs, lengths, C, R, plain, params, 0)
    # the backward: dx of the layer = the sum over windows of each window's dx
    dy = rng.standard_normal((lengths.rows, 8))
    dx = np.zeros((lengths.rows, D))
    g = net.new_params()
    layer.backward(params, g, x, net.acts[0][:lengths.rows], dy.copy(), dx, net.ops,
                   ws=net.workspaces[0], lengths=lengths)
    want = np.zeros_like(dx)
    for b, s in enumerate(seqs):
        for start in range(0, len(s), C):
            window = s[start:start + C + R]
            n = len(window)
            pg = plain.new_params()
            plain.forward(params, window, n, lengths=[n])
            dyw = np.zeros((n, 8))
            keep = min(C, n)
            dyw[:keep] = dy[(start + np.arange(keep)) * lengths.nb + b]
            dxw = np.zeros((n, D))
            plain.layers[0].backward(params, pg, window, plain.acts[0][:n], dyw, dxw,
                                     plain.ops, ws=plain.workspaces[0], lengths=Lengths([n]))
            want[(start + np.arange(n)) * lengths.nb + b] += dxw
    valid = np.concatenate([np.arange(len(s)) * lengths.nb + b for b, s in enumerate(seqs)])
    np.testing.assert_allclose(dx[valid], want[valid], rtol=1e-12, atol=1e-12)


def test_a_chunked_blstm_stack_is_blstms_over_each_window():
    """`blstm H cC rR l2`: three sequences (9, 7, 2 steps) in one padded batch; each chunk's
    outputs are two plain BLSTMs' (the same parameters: enc.0.* the first, enc.0.1.* the
    second) run over that chunk and the 2 steps after it alone, the second reading the
    first's outputs over the whole window (float64, 1e-12)."""
    D, C, R = 3, 3, 2
    net = _sequence_net([f"blstm 4 c{C} r{R} l2"], D, 5)
    plain = _sequence_net(["blstm 4", "blstm 4"], D, 5)
    params = _init(net, 6)
    assert [sp.name for sp in net.specs][:4] == ["enc.0.w", "enc.0.u_fwd", "enc.0.u_bwd",
                                                 "enc.0.b"]
    p2 = plain.new_params()
    for sp in plain.specs:   # enc.1.* of the plain stack is the window's second, enc.0.1.*
        p2.views[sp.name][...] = params.views[sp.name.replace("enc.1.", "enc.0.1.")]
    rng = np.random.default_rng(13)
    seqs = [rng.standard_normal((n, D)) for n in (9, 7, 2)]
    x, lengths = _padded(seqs, D)
    net.forward(params, x, len(x), lengths=lengths)
    got = net.acts[0][:lengths.rows].copy()
    _assert_windows(got, seqs, lengths, C, R, plain, p2, 1)


@pytest.mark.parametrize("window, names, seed", [
    ("", ("enc.1.w", "enc.1.u_fwd", "enc.1.u_bwd", "enc.1.b"), 8),
    (" l2", ("enc.1.w", "enc.1.u_bwd", "enc.1.1.w", "enc.1.1.u_fwd", "enc.1.1.u_bwd",
             "enc.1.1.b"), 10)], ids=["one-layer", "two-layers-a-window"])
def test_chunked_blstm_gradient_by_finite_differences(window, names, seed):
    """float64, sequences of 8, 6 and 3 steps (padded) through a forward LSTM and a chunked
    BLSTM (chunks of 3, lookahead 2; ` l2`: two BLSTMs inside each window): the window
    layers' and the LSTM below's parameters (its gradient through the window's input) at
    sampled coordinates against a central difference (step 1e-6)."""
    D, V = 3, 4
    net = _sequence_net(["lstm 3", "blstm 3 c3 r2" + window], D, V)
    params = _init(net, seed)
    rng = np.random.default_rng(seed + 1)
    seqs = [rng.standard_normal((n, D)) for n in (8, 6, 3)]
    x, lengths = _padded(seqs, D)
    y = np.full(lengths.rows, -1, np.int32)
    for b, s in enumerate(seqs):
        y[np.arange(len(s)) * lengths.nb + b] = rng.integers(0, V, len(s))
    grads = net.new_params()
    net.forward_backward(params, grads, x, y, len(y), lengths=lengths)

    def loss():
        return net.forward_backward(params, net.new_params(), x, y, len(y), lengths=lengths)[0]

    assert_central_differences(params, grads, ("enc.0.w", "enc.0.u") + names, loss, rng, 5)
