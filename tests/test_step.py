"""hpcsgd.step: the one training step is forward/backward, the exchange and the optimizer in
that order (the same bits as the loop written out), double buffering applies each half's
update one half late, and the codec's fused paths give the unfused bits."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcsgd.codecs import make_codec
from hpcsgd.model import build
from hpcsgd.comm.exchange import Allreduce, Striped
from hpcsgd.model.dnn import dnn
from hpcsgd.optim import Optimizer
from hpcsgd.step import Step, gradient_buffers, halves

LR, N = 0.01, 24


def setup(exchange="allreduce", fuse_owner=True, double_buffering=False, precision="float32",
          scaler=None, overlap=False):
    model = dnn(6, [5, 4], 3, max_batch=N, precision=precision)
    params = model.new_params()
    model.init(params, np.random.default_rng(0))
    if exchange == "allreduce":
        ex = Allreduce(MPI.COMM_SELF, params.size)
        ex.overlap, ex.bucket_bytes = overlap, 0   # overlap: a bucket per layer
    else:
        ex = Striped(MPI.COMM_SELF, params.matrices, make_codec(exchange, "cpu"),
                     fuse_owner=fuse_owner)
    opt = Optimizer(params.size, momentum_time_constant=50.0, adagrad="aggregate",
                    weight_decay=1e-3, post_size=ex.state_size)
    step = Step(model, params, gradient_buffers(model, double_buffering), opt, ex,
                double_buffering, "none", scaler=scaler)
    return model, params, opt, ex, step


def batches(seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, 6)).astype(np.float32)
    y = rng.integers(0, 3, N).astype(np.int32)
    return lambda n: (x[:n], y[:n])


def test_a_step_is_forward_backward_then_the_optimizer():
    model, params, opt, ex, step = setup()
    ref_model, ref_params, ref_opt, _, _ = setup()
    grads = ref_model.new_params()
    batch = batches()
    for s in range(5):
        take = np.array([N - s])
        sums = step.run(batch, take, 0, LR)
        x, y = batch(int(take[0]))
        ce, correct = ref_model.forward_backward(ref_params, grads, x, y, len(y))
        ref_opt.begin_step(len(y), len(y))
        ref_opt.post_exchange(grads.flat, ref_params.flat)
        ref_opt.apply(ref_params.flat, grads.flat, LR)
        assert list(sums) == [ce, correct, len(y)]
    np.testing.assert_array_equal(params.flat, ref_params.flat)
    np.testing.assert_array_equal(opt.velocity, ref_opt.velocity)
    np.testing.assert_array_equal(opt.sqr, ref_opt.sqr)
    # one rank: nothing to sum, so post-processing and W -= lr * update are the optimizer's
    # one fused pass (no "decode", no "post_process" phase), with the bits of the two passes
    assert ex.fuses_owner and ex.fuses_apply
    assert step.pending is None and set(step.phases.pop()) == {"encode", "allreduce", "apply"}


def test_double_buffering_applies_each_update_one_half_late():
    model, params, opt, ex, step = setup(double_buffering=True)
    ref_model, ref_params, ref_opt, _, _ = setup()
    grads = [ref_model.new_params(), ref_model.new_params()]
    batch, pending, slot = batches(), None, 0
    for s in range(3):
        take = np.array([N - s])
        step.run(batch, take, 0, LR)
        assert step.pending is not None and step.pending["n"] == int(halves(take)[1][0])
        for part in halves(take):
            x, y = batch(int(part[0]))
            slot ^= 1
            ref_model.forward_backward(ref_params, grads[slot], x, y, len(y))  # at W_h
            if pending is not None:                                             # W_{h+1}
                ref_opt.post_exchange(pending.flat, ref_params.flat)
                ref_opt.apply(ref_params.flat, pending.flat, LR)
            ref_opt.begin_step(len(y), len(y))
            pending = grads[slot]
    np.testing.assert_array_equal(params.flat, ref_params.flat)   # both lack the last half's
    step.drain()
    ref_opt.post_exchange(pending.flat, ref_params.flat)
    ref_opt.apply(ref_params.flat, pending.flat, LR)
    assert step.pending is None
    np.testing.assert_array_equal(params.flat, ref_params.flat)


@pytest.mark.parametrize("codec", ["onebit", "kbit"])
def test_the_fused_paths_give_the_unfused_bits(codec):
    """onebit declares both fusions (owner pass, decode-apply), kbit neither: fuse_owner=false
    runs the three owner passes; both give the same bits."""
    runs = []
    for fuse in (True, False):
        model, params, opt, ex, step = setup(codec, fuse_owner=fuse)
        assert ex.fuses_owner == (fuse and codec == "onebit")
        assert ex.fuses_apply == (codec == "onebit")
        batch = batches()
        for s in range(4):
            step.run(batch, np.array([N]), 0, LR)
        runs.append((params.flat.copy(), ex.residual1.copy(), ex.residual2.copy(),
                     opt.velocity.copy(), set(step.phases.pop())))
    for a, b in zip(runs[0][:4], runs[1][:4]):
        np.testing.assert_array_equal(a, b)
    if codec == "onebit":
        assert "owner" in runs[0][4] and "owner" not in runs[1][4]


def test_a_non_finite_loss_says_where_and_stops():
    model, params, opt, ex, step = setup()
    params.flat[:] = np.nan
    with pytest.raises(Exception, match=r"step 7 \(epoch 0\): cross-entropy is nan on rank 0"):
        step.run(batches(), np.array([N]), 0, LR, "step 7 (epoch 0)")


@pytest.mark.parametrize("encoder", [["stack 2", "conv 8 k3 s2", "blstm 4"], ["conv 6 k3", "dense 5", "blstm 3"]])
def test_ready_offsets_start_where_the_finished_layers_gradients_do(encoder):
    """After layer i's backward, flat[offsets[i]:] holds exactly the gradients of layers >= i
    (a parameterless layer, frame stacking, finishes nothing new)."""
    kind = "ctc" if encoder[0] == "stack 2" else "tdnn"
    shape = {"type": kind, "input_dim": 4, "encoder": encoder, "activation": "relu",
             **({"num_tokens": 5} if kind == "ctc" else {"num_labels": 5})}
    model = build(shape, max_batch=16)
    offsets = model.ready_offsets()
    params = model.new_params()
    assert offsets == sorted(offsets) and offsets[0] == 0 and len(offsets) == len(model.layers)
    ends = offsets[1:] + [params.size]
    for layer, lo, hi in zip(model.layers, offsets, ends):
        own = [m for m in params.matrices if m.name in {s.name for s in layer.specs()}]
        assert sum(m.size for m in own) == hi - lo
        assert all(lo <= m.offset and m.offset + m.size <= hi for m in own)
    if kind == "ctc":
        assert offsets[0] == offsets[1]   # the stack has no parameters


def test_the_overlapped_allreduce_posts_each_layers_gradient_once_its_backward_is_done():
    """exchange.overlap: ready(i) posts flat[offsets[i]:offsets[i + 1]] as layer i's backward
    ends, top layer first; what was posted is the final gradient (nothing writes it later),
    and the step's bits are the one-buffer step's."""
    model, params, opt, ex, step = setup(overlap=True)
    _, ref_params, _, _, ref_step = setup()
    assert step.overlap and not ref_step.overlap
    offsets = model.ready_offsets()
    assert ex.buckets == [(lo, hi) for lo, hi in zip(offsets, offsets[1:] + [params.size])][::-1]
    grads = model.new_params()
    posted, calls = [], []
    ready = ex.ready

    def spy(layer):   # what each call posts, copied when it is posted
        before = ex._posted
        ready(layer)
        calls.append(layer)
        posted.extend((lo, hi, step.grads[0].flat[lo:hi].copy())
                      for lo, hi in ex.buckets[before:ex._posted])
    ex.ready = spy
    batch = batches()
    for s in range(3):
        take = np.array([N - s])
        x, y = batch(int(take[0]))
        model.forward_backward(params, grads, x, y, len(y))   # the gradient at this step
        posted.clear()
        step.run(batch, take, 0, LR)
        ref_step.run(batch, take, 0, LR)
        assert calls[-len(model.layers):] == list(range(len(model.layers)))[::-1]
        assert [(lo, hi) for lo, hi, _ in posted] == ex.buckets   # all during the pass
        for lo, hi, sent in posted:
            np.testing.assert_array_equal(sent, grads.flat[lo:hi])
        np.testing.assert_array_equal(params.flat, ref_params.flat)
