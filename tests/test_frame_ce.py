"""The CTC model's frame CE head (model.frame_ce, hpcsgd/model/ctc.py): its gradient, and the
frame labels the utterance loader gives it at the encoder's output rate.

The gradient: the head adds frame_ce x the softmax cross-entropy of its logits to the CTC
loss. Its CE is summed in float64 by the softmax kernel (a float64 model), so the difference
of two gradients, with and without the head, is checked against central differences of the
head's own CE (frame_stats): float64 throughout, no float32 CTC noise in it. The bound: the
central difference's truncation error O(h^2) at h = 1e-4 plus float64 rounding, far under
1e-6 of the derivative's scale."""
import numpy as np
import pytest

from conftest import make_archive
from hpcsgd.data.utterances import Targets, UtteranceLoader
from hpcsgd.model.ctc import ctc


def _model_and_batch(frame_ce):
    rng = np.random.default_rng(0)
    net = ctc(3, ["stack 2", "blstm 4", "dense 6"], 5, max_batch=64, dtype=np.float64,
              frame_labels=4)
    net.layers[-1].frame_ce = frame_ce
    params = net.new_params()
    net.init(params, rng)
    frames = np.array([9, 7, 4])
    x = np.zeros((9, 3, 3))
    labels = np.full((5, 3), -1, np.int32)
    for b, n in enumerate(frames):
        x[:n, b] = rng.standard_normal((n, 3))
        labels[:-(-n // 2), b] = rng.integers(0, 4, -(-n // 2))
    targets = Targets(frames, np.array([1, 2, 3, 4, 4, 2], np.int32), np.array([0, 2, 4, 6]),
                      None, labels.reshape(-1))
    return net, params, x.reshape(27, 3), targets


def _pass(net, params, x, targets):
    grads = net.new_params()
    loss, _ = net.forward_backward(params, grads, x, targets, len(x))
    return loss, net.pop_frame_ce(), grads.flat.copy()


def test_the_head_adds_its_cross_entropy_gradient_to_every_weight():
    net, params, x, targets = _model_and_batch(0.7)
    loss, (ce, steps, hits), with_head = _pass(net, params, x, targets)
    assert steps == 5 + 4 + 2 and 0 <= hits <= steps and ce > 0
    net.layers[-1].frame_ce = 0.0
    loss0, stats0, without = _pass(net, params, x, targets)
    assert loss0 == loss and not stats0.any()   # the CTC loss is untouched by the head
    head = [s.name for s in net.layers[-1].specs()[2:]]
    assert not without[np.concatenate([np.arange(m.offset, m.offset + m.size)
                                       for m in params.matrices if m.name in head])].any()
    net.layers[-1].frame_ce = 0.7
    rng, base, h = np.random.default_rng(1), params.flat.copy(), 1e-4
    for name in ("enc.1.w", "enc.1.u_fwd", "enc.2.w", "out.ce.w", "out.ce.b"):
        direction = np.zeros_like(base)
        m = next(m for m in params.matrices if m.name == name)
        direction[m.offset:m.offset + m.size] = rng.standard_normal(m.size)
        ce_at = []
        for sign in (1, -1):
            params.flat[:] = base + sign * h * direction
            ce_at.append(_pass(net, params, x, targets)[1][0])
        params.flat[:] = base
        numeric = 0.7 * (ce_at[0] - ce_at[1]) / (2 * h)
        analytic = float((with_head - without) @ direction)
        assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), name


def test_without_labels_the_head_is_refused():
    net, params, x, targets = _model_and_batch(0.5)
    with pytest.raises(ValueError, match="no frame labels"):
        net.forward_backward(params, net.new_params(), x, targets._replace(labels=None), len(x))


@pytest.mark.parametrize("stride", [1, 3])
def test_the_loader_gives_the_alignment_label_at_the_middle_of_each_output_step(stride,
                                                                               tmp_path):
    """Output step t of an utterance of L frames has the label of frame min(t S + S // 2,
    L - 1) (feats[:, 0] of the archive is each frame's id); the padding -1; the features
    as without labels."""
    arch = str(tmp_path / "arch")
    shards = make_archive(arch, num_shards=2, utts_per_shard=6, dim=3, min_len=5, max_len=40,
                          token_kinds=("phones",), num_tokens=6)
    plain = UtteranceLoader(arch, cmvn="none", minibatch=120, prefetch=False)
    loader = UtteranceLoader(arch, cmvn="none", minibatch=120, prefetch=False,
                             label_stride=stride)
    checked = 0
    for (ids, x, targets), (_, x_plain, t_plain) in zip(loader.eval_batches(200),
                                                        plain.eval_batches(200)):
        assert np.array_equal(x, x_plain) and t_plain.labels is None
        nb = len(ids)
        steps = -(-targets.frames // stride)
        labels = targets.labels.reshape(-1, nb)
        assert labels.shape[0] == steps[0]
        frames = x.reshape(-1, nb, 3)[:, :, 0]
        for b in range(nb):
            shard = int(frames[0, b]) // 1_000_000
            first = int(frames[0, b]) % 1_000_000
            at = np.minimum(np.arange(steps[b]) * stride + stride // 2, targets.frames[b] - 1)
            assert np.array_equal(labels[:steps[b], b], shards[shard][1][first + at])
            assert (labels[steps[b]:, b] == -1).all()
            checked += 1
    assert checked == 12


def test_an_archive_without_frame_labels_is_refused_by_name(tmp_path):
    arch = str(tmp_path / "text_only")
    make_archive(arch, num_shards=1, utts_per_shard=3, dim=3, token_kinds=("phones",),
                 num_tokens=6, frame_labels=False)
    from hpcsgd.errors import UserError
    with pytest.raises(UserError, match="--alignments"):
        UtteranceLoader(arch, minibatch=100, prefetch=False, label_stride=3)
