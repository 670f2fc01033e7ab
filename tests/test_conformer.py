"""The Conformer's layers (hpcsgd.model.conformer) and kernels (hpcsgd.model.kernels_conformer):
every kernel against its float64 reference; the layers' gradients by central differences in
float64; a padded batch gives each utterance what it gets alone; the encoder specs and their
refusals; a CTC model with a Conformer encoder trains through Network.

Tolerances: float64 kernels against float64 references differ by reassociation only (1e-12
relative); float32 kernels by a few float32 roundings of sums of at most a few hundred terms
(1e-5 relative to the largest value). Central differences in float64 with step 1e-5 have a
truncation error of O(h^2 f''') ~ 1e-10 and a rounding error of eps f / h ~ 1e-11: 1e-6
relative is far below any wrong term."""
import numpy as np
import pytest

from hpcsgd.data.utterances import Targets
from hpcsgd.model import build
from hpcsgd.model import kernels_conformer as KF
from hpcsgd.model import kernels_norm as KN
from hpcsgd.model.conformer import ConformerBlock, Conv2dSubsampling
from hpcsgd.model.encoder import encoder_layers, parse_spec, time_stride
from hpcsgd.model.flat import FlatParams
from hpcsgd.model.kernels import IDENTITY
from hpcsgd.model.lengths import Lengths
from hpcsgd.model.ops import CpuOps, HalfOps


def padded(rng, frames, width, dtype=np.float64):
    """Time-major rows of utterances of these frames (non-increasing), zeros past each end."""
    nb, steps = len(frames), frames[0]
    x = np.zeros((steps, nb, width), dtype)
    for b, f in enumerate(frames):
        x[:f, b] = rng.standard_normal((f, width))
    return x.reshape(steps * nb, width)


def tol(dtype):
    return 1e-12 if dtype == np.float64 else 2e-5


# ---- kernels against their references -------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_swish_glu_and_residual_kernels_match_their_references(dtype):
    rng = np.random.default_rng(0)
    z = (3 * rng.standard_normal((37, 24))).astype(dtype)
    b = rng.standard_normal((1, 24)).astype(dtype)
    pre, y = z.copy(), np.empty_like(z)
    KF.bias_swish(pre, b, y)
    np.testing.assert_allclose(pre, z + b, rtol=0, atol=0)
    np.testing.assert_allclose(y, KF.ref_swish(z.astype(np.float64) + b), rtol=tol(dtype),
                               atol=tol(dtype))
    dy = rng.standard_normal(z.shape).astype(dtype)
    dz = dy.copy()
    KF.swish_backward(pre, dz, dz)   # in place
    np.testing.assert_allclose(dz, KF.ref_swish_backward(pre, dy), rtol=tol(dtype),
                               atol=tol(dtype))
    g, u = z.copy(), np.empty((37, 12), dtype)
    KF.bias_glu(g, b, u)
    np.testing.assert_allclose(u, KF.ref_glu(z.astype(np.float64) + b), rtol=tol(dtype),
                               atol=tol(dtype))
    du = rng.standard_normal(u.shape).astype(dtype)
    want = KF.ref_glu_backward(g, du)
    KF.glu_backward(g, du, g)   # in place
    np.testing.assert_allclose(g, want, rtol=tol(dtype), atol=tol(dtype))
    out = np.empty_like(z)
    KF.add_scaled(z, y, dtype(0.5), out)
    np.testing.assert_array_equal(out, z + dtype(0.5) * y)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_depthwise_convolution_reads_each_utterance_alone(dtype):
    rng = np.random.default_rng(1)
    frames, m, kernel = [9, 7, 2], 6, 5
    nb = len(frames)
    x = padded(rng, frames, m, dtype)
    x[np.arange(len(x)) % nb == 2] += 0   # zeros past the end are not read either way
    w = rng.standard_normal((kernel, m)).astype(dtype)
    b = rng.standard_normal((1, m)).astype(dtype)
    y = np.full_like(x, np.nan)
    KF.depthwise_forward(x, w, b, y, nb, np.array(frames), 2)
    np.testing.assert_allclose(y, KF.ref_depthwise(x, w, b, nb, frames, 2), rtol=tol(dtype),
                               atol=tol(dtype))
    dy = padded(rng, frames, m, dtype)
    dx, gw, gb = np.empty_like(x), np.empty_like(w), np.empty_like(b)
    KF.depthwise_backward(x, dy, w, dx, gw, gb, nb, np.array(frames), 2,
                          np.empty((16, kernel + 1, m)))
    for got, want in zip((dx, gw, gb), KF.ref_depthwise_backward(x, dy, w, nb, frames, 2)):
        np.testing.assert_allclose(got, want, rtol=tol(dtype), atol=tol(dtype))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_kernels_give_each_utterance_its_own_attention(dtype):
    """to_heads (rotary, scaled) -> batched QK^T -> masked softmax -> PV -> from_heads against
    the float64 attention of each utterance alone; the padding rows 0."""
    rng = np.random.default_rng(2)
    frames, heads, dk = [8, 5, 5, 1], 2, 6
    nb, steps, d = len(frames), frames[0], heads * dk
    lengths = Lengths(frames)
    qkv = padded(rng, frames, 3 * d, dtype)
    ops = CpuOps(64, 3 * d, dtype)
    q, k, v = (np.empty((nb, heads, steps, dk), dtype) for _ in range(3))
    ops.to_heads(qkv, 0, q, lengths, True, 1 / np.sqrt(dk))
    ops.to_heads(qkv, d, k, lengths, True, 1.0)
    ops.to_heads(qkv, 2 * d, v, lengths, False, 1.0)
    s = np.matmul(q, np.swapaxes(k, -1, -2))
    ops.masked_softmax(s, s, lengths)
    o = np.matmul(s, v)
    out = np.full((steps * nb, d), np.nan, dtype)
    ops.from_heads(o, out, 0, lengths, False, 1.0)
    want = KF.ref_attention(qkv[:, :d], qkv[:, d:2 * d], qkv[:, 2 * d:], heads, nb, frames)
    np.testing.assert_allclose(out, want, rtol=tol(dtype), atol=tol(dtype))
    assert np.all(s[3, :, 1:] == 0) and np.all(s[3, :, 0, 1:] == 0)


def test_from_heads_is_the_adjoint_of_to_heads_and_softmax_backward_its_jacobian():
    """<to_heads(a), B> = <a, from_heads(B)> (the rotation and scale transposed); the softmax's
    backward against a central difference."""
    rng = np.random.default_rng(3)
    frames, heads, dk = [6, 4, 3], 3, 4
    nb, d = len(frames), heads * dk
    lengths = Lengths(frames)
    ops = CpuOps(64, d, np.float64)
    a = padded(rng, frames, d)
    blocks = rng.standard_normal((nb, heads, 6, dk))
    ha = np.empty_like(blocks)
    ops.to_heads(a, 0, ha, lengths, True, 0.7)
    back = np.empty_like(a)
    ops.from_heads(blocks, back, 0, lengths, True, 0.7)
    valid = np.zeros_like(blocks, bool)
    for b, f in enumerate(frames):
        valid[b, :, :f] = True
    assert abs(np.sum(ha * blocks * valid) - np.sum(a * back)) < 1e-12 * np.abs(a).sum()
    s = rng.standard_normal((nb, heads, 6, 6))
    p = np.empty_like(s)
    ops.masked_softmax(s, p, lengths)
    dp = rng.standard_normal(s.shape)
    ds = np.empty_like(s)
    ops.masked_softmax_backward(p, dp, ds, lengths)
    for idx in [(0, 1, 2, 3), (1, 0, 3, 1), (2, 2, 1, 2)]:
        e = np.zeros_like(s)
        e[idx] = 1e-6
        pp, pm = np.empty_like(s), np.empty_like(s)
        ops.masked_softmax(s + e, pp, lengths)
        ops.masked_softmax(s - e, pm, lengths)
        num = np.sum(dp * (pp - pm)) / 2e-6
        assert abs(ds[idx] - num) < 1e-7, (idx, ds[idx], num)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unfold2d_matches_the_reference_and_fold2d_is_its_adjoint(dtype):
    rng = np.random.default_rng(4)
    frames, f_in, ch = [7, 6, 3], 9, 2
    nb, steps = len(frames), frames[0]
    x = padded(rng, frames, f_in * ch, dtype)
    want, steps_out, f_out = KF.ref_unfold2d(x, nb, steps, f_in, ch)
    cols = np.full((steps_out * nb * f_out, 9 * ch), np.nan, dtype)
    KF.unfold2d(x, cols, nb, steps, steps_out, f_in, f_out, ch)
    np.testing.assert_array_equal(cols, want.astype(dtype))
    dcols = rng.standard_normal(cols.shape)
    dx = np.empty(x.shape)
    KF.fold2d(dcols, dx, nb, steps, steps_out, f_in, f_out, ch)
    assert abs(np.sum(want * dcols) - np.sum(x.astype(np.float64) * dx)) \
        < 1e-10 * np.abs(dcols).sum()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_layer_norm_without_activation(dtype):
    rng = np.random.default_rng(5)
    z = rng.standard_normal((19, 12)).astype(dtype)
    gamma, beta = rng.standard_normal((2, 1, 12)).astype(dtype)
    y = np.empty_like(z)
    KN.layer_norm_forward(z, gamma, beta, y, IDENTITY)
    np.testing.assert_allclose(y, KN.ref_layer_norm(z, gamma, beta, IDENTITY),
                               rtol=10 * tol(dtype), atol=10 * tol(dtype))
    dy = rng.standard_normal(z.shape).astype(dtype)
    dz, gg, gb = np.empty_like(z), np.empty_like(gamma), np.empty_like(beta)
    KN.layer_norm_backward(z, y, dy, gamma, dz, gg, gb, np.empty((2, 16, 12)), IDENTITY)
    for got, want in zip((dz, gg, gb), KN.ref_layer_norm_backward(z, gamma, beta, dy,
                                                                   IDENTITY)):
        np.testing.assert_allclose(got, want, rtol=10 * tol(dtype), atol=10 * tol(dtype))


# ---- the layers: gradients, padding ---------------------------------------------------------

def layer_case(layer, frames, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    params = FlatParams(layer.specs(), dtype)
    layer.init(params.views, rng)
    for spec in layer.specs():   # biases and gains away from 0 and 1: every term counts
        if spec.role == "bias":
            params[spec.name][...] += 0.1 * rng.standard_normal(spec.shape)
    lengths = Lengths(frames)
    rows = lengths.rows
    ws = {k: np.zeros(shape, dtype) for k, shape in layer.workspace(rows).items()}
    x = padded(rng, frames, layer.n_in, dtype)
    out_lengths = layer.out_lengths(lengths) if hasattr(layer, "out_lengths") else lengths
    r = padded(rng, out_lengths.lengths.tolist() + [], layer.n_out, dtype) \
        if out_lengths.steps == out_lengths.lengths[0] else None
    ops = CpuOps(rows, max(layer.width, layer.n_out, layer.n_in), dtype)
    return rng, params, lengths, out_lengths, ws, x, r, ops


def loss_and_grads(layer, params, lengths, out_lengths, ws, x, r, ops, drop=None):
    """sum(r * y) over the valid output rows, its parameter gradients and dLoss/dx."""
    extra = {"drop": drop} if drop is not None else {}
    y = np.zeros((out_lengths.rows, layer.n_out), x.dtype)
    layer.forward(params, x, y, ops, ws=ws, lengths=lengths, **extra)
    ops.mask_rows(y, out_lengths)
    loss = float(np.sum(r * y))
    grads = FlatParams(layer.specs(), x.dtype)
    dx = np.zeros_like(x)
    layer.backward(params, grads, x, y, r.copy(), dx, ops, ws=ws, lengths=lengths, **extra)
    ops.mask_rows(dx, lengths)
    return loss, grads, dx


def central_differences(layer, params, lengths, out_lengths, ws, x, r, ops, grads, dx, rng,
                        drop=None, n=30):
    def loss():
        y = np.zeros((out_lengths.rows, layer.n_out), x.dtype)
        extra = {"drop": drop} if drop is not None else {}
        layer.forward(params, x, y, ops, ws=ws, lengths=lengths, **extra)
        ops.mask_rows(y, out_lengths)
        return float(np.sum(r * y))
    h = 1e-5
    for k in rng.choice(params.size, n, replace=False):
        old = params.flat[k]
        params.flat[k] = old + h
        up = loss()
        params.flat[k] = old - h
        down = loss()
        params.flat[k] = old
        num = (up - down) / (2 * h)
        assert abs(grads.flat[k] - num) <= 1e-6 * max(1.0, abs(num)), \
            (params.matrices, k, grads.flat[k], num)
    valid = np.flatnonzero(np.abs(x).sum(1) > 0)
    for row in rng.choice(valid, 6, replace=False):
        col = rng.integers(x.shape[1])
        old = x[row, col]
        x[row, col] = old + h
        up = loss()
        x[row, col] = old - h
        down = loss()
        x[row, col] = old
        num = (up - down) / (2 * h)
        assert abs(dx[row, col] - num) <= 1e-6 * max(1.0, abs(num)), (row, col, dx[row, col],
                                                                     num)


@pytest.mark.parametrize("norm", ["ln", "in"])
def test_conformer_block_gradient_by_central_differences(norm):
    block = ConformerBlock("enc.1", 1, 12, 2, 20, 5, norm)
    case = layer_case(block, [9, 7, 3], seed=6)
    rng = case[0]
    loss, grads, dx = loss_and_grads(block, *case[1:])
    central_differences(block, *case[1:], grads, dx, rng, n=60)
    # every parameter gets a gradient
    for spec in block.specs():
        assert np.any(grads[spec.name] != 0), spec.name


def test_conformer_block_gradient_with_dropout():
    """The masks (keyed per utterance and module) are the same in both passes."""
    from hpcsgd.model import kernels_dropout as KD
    block = ConformerBlock("enc.1", 1, 8, 2, 16, 3)
    block.dropout = 0.3
    case = layer_case(block, [6, 5], seed=7)
    drop = (KD.utterance_keys(0, 0, np.array([3, 8])), 2)
    loss, grads, dx = loss_and_grads(block, *case[1:], drop=drop)
    central_differences(block, *case[1:], grads, dx, case[0], drop=drop)
    plain, _, _ = loss_and_grads(block, *case[1:])
    assert abs(plain - loss) > 1e-3 * abs(plain)


def test_conv2d_subsampling_gradient_by_central_differences():
    layer = Conv2dSubsampling("enc.0", 9, 3, 8)
    case = layer_case(layer, [13, 10, 5], seed=8)
    loss, grads, dx = loss_and_grads(layer, *case[1:])
    central_differences(layer, *case[1:], grads, dx, case[0])
    assert case[3].lengths.tolist() == [4, 3, 2]


@pytest.mark.parametrize("layer", [ConformerBlock("enc.2", 2, 12, 3, 16, 5, "in"),
                                   Conv2dSubsampling("enc.0", 7, 2, 6)])
def test_a_padded_batch_gives_each_utterance_what_it_gets_alone(layer):
    """float64: each utterance's output rows, its input gradient and the summed parameter
    gradients of a padded batch equal the utterances' own passes (reassociation only)."""
    frames = [11, 8, 8, 3]
    rng, params, lengths, out_lengths, ws, x, r, ops = layer_case(layer, frames, seed=9)
    y = np.zeros((out_lengths.rows, layer.n_out))
    layer.forward(params, x, y, ops, ws=ws, lengths=lengths)
    ops.mask_rows(y, out_lengths)
    _, grads, dx = loss_and_grads(layer, params, lengths, out_lengths, ws, x, r, ops)
    nb = len(frames)
    total = np.zeros(params.size)
    for b, f in enumerate(frames):
        one = Lengths([f])
        out_one = layer.out_lengths(one) if hasattr(layer, "out_lengths") else one
        xs = np.ascontiguousarray(x.reshape(-1, nb, layer.n_in)[:f, b])
        rs = np.ascontiguousarray(r.reshape(-1, nb, layer.n_out)[:out_one.steps, b])
        wone = {k: np.zeros(shape) for k, shape in layer.workspace(f).items()}
        ys = np.zeros((out_one.rows, layer.n_out))
        layer.forward(params, xs, ys, ops, ws=wone, lengths=one)
        np.testing.assert_allclose(ys, y.reshape(-1, nb, layer.n_out)[:out_one.steps, b],
                                   rtol=1e-11, atol=1e-11)
        _, g, dxs = loss_and_grads(layer, params, one, out_one, wone, xs, rs, ops)
        np.testing.assert_allclose(dxs, dx.reshape(-1, nb, layer.n_in)[:f, b], rtol=1e-10,
                                   atol=1e-11)
        total += g.flat
    np.testing.assert_allclose(grads.flat, total, rtol=1e-10, atol=1e-10)


def test_mixed_precision_rounds_every_stored_value_of_a_block():
    """HalfOps around CpuOps: the block's output is float16 values (rounding is idempotent),
    within float16's precision of the float32 pass."""
    block = ConformerBlock("enc.1", 1, 8, 2, 16, 3)
    rng, params, lengths, out_lengths, ws, x, r, ops = layer_case(block, [6, 4], seed=10,
                                                                   dtype=np.float32)
    y32, y16 = np.zeros((lengths.rows, 8), np.float32), np.zeros((lengths.rows, 8), np.float32)
    block.forward(params, x, y32, ops, ws=ws, lengths=lengths)
    block.forward(params, x.astype(np.float16).astype(np.float32), y16, HalfOps(ops), ws=ws,
                  lengths=lengths)
    np.testing.assert_array_equal(y16, y16.astype(np.float16).astype(np.float32))
    assert np.max(np.abs(y16 - y32)) < 0.05 and np.max(np.abs(y16 - y32)) > 0


# ---- the encoder specs and a model --------------------------------------------------------

def test_specs_parse_describe_and_refuse():
    assert parse_spec("conformer 144 h4 f576 k15") == {
        "kind": "conformer", "units": 144, "heads": 4, "ff": 576, "kernel": 15, "norm": "ln"}
    assert parse_spec("conv2d 64 144")["stride"] == 4
    assert time_stride(["conv2d 8 16", "conformer 16 h2 f32 k3"]) == 4
    layers, width = encoder_layers(40, ["conv2d 8 16", "conformer 16 h2 f32 k3 in"])
    assert width == 16 and layers[1].norm == "in"
    assert {s.name for s in layers[1].specs()} >= {"enc.1.mhsa.qkv.w", "enc.1.conv.dw.w",
                                                    "enc.1.ff2.w1.w", "enc.1.ln.g"}
    with pytest.raises(ValueError, match="3 heads do not divide the width 16"):
        encoder_layers(40, ["conv2d 8 16", "conformer 16 h3 f32 k3"])
    with pytest.raises(ValueError, match="widths must match"):
        encoder_layers(40, ["conv2d 8 16", "conformer 24 h2 f32 k3"])
    with pytest.raises(ValueError, match="first layer only"):
        encoder_layers(40, ["conv 16 k3", "conv2d 8 16"])
    with pytest.raises(ValueError, match="must be odd"):
        encoder_layers(40, ["conv2d 8 16", "conformer 16 h2 f32 k4"])


def test_a_conformer_ctc_model_learns_a_batch():
    """A float32 Conformer-CTC Network: Adam-free plain gradient steps on one padded batch
    lower its CTC loss (the layers, the chain's masks and the loss work together)."""
    rng = np.random.default_rng(11)
    net = build({"type": "ctc", "input_dim": 10, "encoder": ["conv2d 4 16",
                                                             "conformer 16 h2 f32 k5"],
                 "num_tokens": 5, "activation": "relu"}, max_batch=256)
    params, grads = net.new_params(), net.new_params()
    net.init(params, rng)
    frames = [40, 33, 28]
    x = padded(rng, frames, 10, np.float32)
    ids = np.array([1, 2, 3, 4, 2, 1, 3], np.int32)
    y = Targets(np.array(frames), ids, np.array([0, 3, 5, 7]))
    first = None
    for _ in range(30):
        loss, _ = net.forward_backward(params, grads, x, y, len(x))
        first = first if first is not None else loss
        params.flat -= 0.003 * grads.flat
    assert loss < 0.5 * first, (first, loss)


@pytest.mark.parametrize("rule", ["max", "sawb", "pact"])
def test_qat_quantizes_every_gemm_input_inside_the_encoder(rule):
    """qat.activations on a Conformer-CTC model: each GEMM input inside the front end and the
    block is fake-quantized into its own buffer, on a grid of 2^4 - 1 levels (values integer
    multiples of its step); pact's learned ranges get gradients; at 8 bits the loss is within
    quantization noise of the float model's, and not equal to it."""
    from hpcsgd.model.conformer import GEMM_INPUTS
    rng = np.random.default_rng(12)
    describe = {"type": "ctc", "input_dim": 10, "encoder": ["conv2d 4 16",
                                                            "conformer 16 h2 f32 k5"],
                "num_tokens": 5, "activation": "relu"}
    frames = [40, 33, 28]
    x = padded(rng, frames, 10, np.float32)
    y = Targets(np.array(frames), np.array([1, 2, 3, 4, 2, 1, 3], np.int32),
                np.array([0, 3, 5, 7]))
    losses = {}
    for bits in (4, 8):
        qat = {"weights": "none", "activations": rule, "activation_bits": bits}
        net = build({**describe, "qat": qat}, max_batch=256)
        params, grads = net.new_params(), net.new_params()
        net.init(params, np.random.default_rng(1))
        losses[bits] = net.forward_backward(params, grads, x, y, len(x))[0]
        net.forward(params, x, len(x), lengths=frames)   # the backward wrote over the copies
        block = net.layers[1]
        assert block.quant is net.quant and net.layers[0].quant is net.quant
        for key in GEMM_INPUTS:
            grid = net.quant.inner_grids[f"enc.1.{key}"]
            q = net.workspaces[1][f"q.{key}"][:block_rows(frames)]
            k = q / grid.step
            if bits == 4 and rule != "pact":
                assert np.allclose(k, np.rint(k), atol=1e-3) and np.abs(k).max() <= 7
        if rule == "pact":
            clips = [s.name for s in net.specs if s.role == "clip"]
            # the block's, the front end's two, and the Network's: the features, the output's
            assert len(clips) == len(GEMM_INPUTS) + 2 + 2
            assert any(np.any(grads[c] != 0) for c in clips)
    plain = build(describe, max_batch=256)
    params = plain.new_params()
    plain.init(params, np.random.default_rng(1))
    want = plain.forward_backward(params, plain.new_params(), x, y, len(x))[0]
    assert losses[8] != want and abs(losses[8] - want) < 0.02 * abs(want), (losses, want)


def block_rows(frames):
    """Rows of a batch of these frames after the 4x subsampling."""
    return Lengths(frames).strided(2).strided(2).rows
