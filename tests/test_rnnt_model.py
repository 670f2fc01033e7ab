"""The RNN-T model's transducer (hpcsgd.model.transducer, model/kernels_joint.py): the joint's
kernels against their float64 reference, the whole layer (encoder projection, prediction
network, joint, loss) against a float64 reference written from the definitions, its gradients
against central differences of that reference, the sub-batched joint against the whole one.

Tolerances: u = 2^-24. The float32 layer is a chain of GEMMs (dot products of at most K terms:
K u sum |terms| each), LSTM steps and ftanh (a few ulp of 1) and the loss (its bound:
tests/test_rnnt_loss.py, ~2 D u L relative over D diagonals). Rather than carry each bound
through the chain, the tests use one bound of the same form for every quantity q compared:
|q - q64| <= C K u (|q64| + 1) with K the longest sum in the chain and C = 64 (the number of
chained roundings, generously); a wrong gradient entry is off by O(|q|), six orders above it.
"""
import numpy as np
import pytest

from hpcsgd.data.utterances import Targets
from hpcsgd.model import kernels_joint as KJ
from hpcsgd.model import kernels_rnnt as KR
from hpcsgd.model.flat import FlatParams, as_specs
from hpcsgd.model.kernels_lstm import ref_lstm
from hpcsgd.model.lengths import Lengths
from hpcsgd.model.ops import make_ops
from hpcsgd.model.transducer import Transducer

U32 = 2.0 ** -24


def _batch(seed=0, nb=4, v=7):
    """nb utterances, longest first, of 5..9 encoder frames and 1..4 targets (one of them
    infeasible: 0 targets), time-major."""
    rng = np.random.default_rng(seed)
    frames = np.sort(rng.integers(5, 10, nb))[::-1].astype(np.int64)
    lens = rng.integers(1, 5, nb)
    lens[2] = 0
    ids = rng.integers(1, v, lens.sum()).astype(np.int32)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    return Targets(frames, ids, offsets)


def _layer(mode, v=7, n_in=6, seed=1):
    layer = Transducer(n_in, v, ["lstm 5"], embed=4, joint=6, joint_mode=mode)
    params = FlatParams(as_specs(layer.specs()), np.float32)
    layer.init(params.views, np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    params.flat[...] += 0.3 * rng.standard_normal(params.size).astype(np.float32)  # biases too
    return layer, params


def _run(layer, params, x, targets, budget=None):
    """forward + loss + backward of the layer in float32 -> (loss, grads FlatParams, dx)."""
    lengths = Lengths(targets.frames)
    ops = make_ops("cpu", len(x), 64, np.float32)
    grads = FlatParams(as_specs(layer.specs()), np.float32)
    if budget is not None:
        layer.joint_budget = budget
    z = np.empty((len(x), layer.n_out), np.float32)
    layer.forward(params.views, x, z, ops)
    loss, tokens = layer.loss(params.views, grads.views, z, targets, ops, 1.0, lengths)
    dx = np.empty_like(x)
    layer.backward(params.views, grads.views, x, z, None, dx, ops)
    assert tokens == len(targets.ids)
    return loss, grads, dx


def ref_loss(layer, views, x, targets):
    """The layer's loss in float64 from the definitions: enc = x We + be; per utterance the
    predictor over [blank, y_1..y_U] (an embedding, kernels_lstm.ref_lstm per layer, the
    projection), h = tanh(enc_t (+|*) pred_u), z = h Wo + bo, kernels_rnnt.ref_rnnt."""
    w = {k: np.asarray(a, np.float64) for k, a in views.items()}
    nb = len(targets.frames)
    enc = np.asarray(x, np.float64) @ w[layer.W] + w[layer.b]
    total = 0.0
    for b in range(nb):
        f = int(targets.frames[b])
        y = targets.ids[targets.offsets[b]:targets.offsets[b + 1]]
        if not KR.feasible_rule(len(y), f):
            continue
        h = w[layer.E][np.concatenate([[0], y]).astype(np.int64)]
        for lstm in layer.pred:
            h = ref_lstm(h, w[lstm.W], w[lstm.U[0]], w[lstm.b], steps=len(h))
        pred = h @ w[layer.Wp] + w[layer.bp]
        enc_b = enc[np.arange(f) * nb + b]
        z = (KJ.ref_joint(enc_b, pred, layer.mode) @ w[layer.Wo] + w[layer.bo]).reshape(-1, layer.num_tokens)
        loss, _, _ = KR.ref_rnnt(z, [f], y.astype(np.int32), np.array([0, len(y)]),
                                 np.array([0, f * (len(y) + 1)]))
        total += loss[0]
    return total


def _close(got, want, k, what):
    tol = 64 * k * U32 * (np.abs(want) + 1)
    bad = np.abs(np.asarray(got, np.float64) - want) > tol
    assert not bad.any(), (what, np.asarray(got)[bad][:5], np.asarray(want)[bad][:5])


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_joint_kernels_equal_their_reference(mode):
    rng = np.random.default_rng(5)
    t = _batch(3)
    nb, h_dim = len(t.frames), 8
    u1 = np.diff(t.offsets) + 1
    enc = rng.standard_normal((int(t.frames[0]) * nb, h_dim)).astype(np.float32)
    pos = np.array([2, 0, 3, 1])   # the predictor's order, any permutation
    pred = rng.standard_normal((int(u1.max()) * nb, h_dim)).astype(np.float32)
    offs = KR.lattice_offsets(t.frames, u1 - 1)
    h = np.empty((int(offs[-1]), h_dim), np.float32)
    KJ.joint_forward(enc, pred, nb, pos, t.frames, u1, offs, 0, nb, KJ.MODES[mode], h)
    dh = rng.standard_normal(h.shape).astype(np.float32)
    denc, dpred = np.zeros_like(enc), np.zeros_like(pred)
    KJ.joint_backward(dh.copy(), h, enc, pred, nb, pos, t.frames, u1, offs, 0, nb,
                      KJ.MODES[mode], denc, dpred)
    for b in range(nb):
        e = enc[np.arange(t.frames[b]) * nb + b]
        p = pred[np.arange(u1[b]) * nb + pos[b]]
        want = KJ.ref_joint(e, p, KJ.MODES[mode])
        _close(h[offs[b]:offs[b + 1]].reshape(want.shape), want, 4, "h")
        de, dp = KJ.ref_joint_backward(dh[offs[b]:offs[b + 1]].reshape(want.shape), e, p,
                                       KJ.MODES[mode])
        _close(denc[np.arange(t.frames[b]) * nb + b], de, 16, "denc")
        _close(dpred[np.arange(u1[b]) * nb + pos[b]], dp, 16, "dpred")
    # rows no utterance owns are left alone (zero here)
    assert not denc[int(t.frames[-1]) * nb + nb - 1:][::nb].any()


@pytest.mark.parametrize("mode", ["add", "mul"])
def test_layer_loss_and_gradients_equal_the_float64_reference(mode):
    """The loss against ref_loss; every parameter's and the input's gradient against central
    differences of ref_loss (float64: its own error ~1e-10, far below the tolerance)."""
    t = _batch(7)
    layer, params = _layer(mode)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((int(t.frames[0]) * len(t.frames), layer.n_in)).astype(np.float32)
    lengths = Lengths(t.frames)
    pad = np.ones(len(x), bool)
    for s in range(lengths.steps):
        pad[s * lengths.nb:s * lengths.nb + lengths.batch_sizes[s]] = False
    x[pad] = 0
    loss, grads, dx = _run(layer, params, x, t)
    assert layer.skipped == 1
    want = ref_loss(layer, params.views, x, t)
    _close(loss, want, 64, "loss")
    eps = 1e-6
    p64 = {k: np.asarray(a, np.float64) for k, a in params.views.items()}
    for name, g in grads.views.items():
        idx = rng.choice(g.size, min(g.size, 12), replace=False)
        for i in idx:
            up, dn = {k: a.copy() for k, a in p64.items()}, {k: a.copy() for k, a in p64.items()}
            up[name].flat[i] += eps
            dn[name].flat[i] -= eps
            fd = (ref_loss(layer, up, x, t) - ref_loss(layer, dn, x, t)) / (2 * eps)
            _close(g.flat[i], fd, 64, name)
    x64 = x.astype(np.float64)
    for i in rng.choice(np.flatnonzero(~pad), 6, replace=False):
        for j in range(layer.n_in):
            up, dn = x64.copy(), x64.copy()
            up[i, j] += eps
            dn[i, j] -= eps
            fd = (ref_loss(layer, p64, up, t) - ref_loss(layer, p64, dn, t)) / (2 * eps)
            _close(dx[i, j], fd, 64, "dx")
    assert not dx[pad].any()   # the padding gets no gradient


def test_the_joint_in_sub_batches_equals_the_whole_joint():
    """A budget of one node: every utterance its own group (the gradient sums then add group
    by group): the loss bit for bit (each lattice's rows are its own), the gradients within
    float32 rounding of the GEMMs' sums."""
    t = _batch(11)
    layer, params = _layer("add")
    x = np.random.default_rng(2).standard_normal(
        (int(t.frames[0]) * len(t.frames), layer.n_in)).astype(np.float32)
    whole = _run(layer, params, x, t)
    assert len(layer.groups(t.frames, np.diff(t.offsets) + 1)) == 1
    parts = _run(layer, params, x, t, budget=1)
    assert len(layer.groups(t.frames, np.diff(t.offsets) + 1)) == len(t.frames)
    assert parts[0] == whole[0]
    for name in whole[1].views:
        _close(parts[1].views[name], whole[1].views[name].astype(np.float64), 64, name)
    _close(parts[2], whole[2].astype(np.float64), 64, "dx")
