"""hpcsgd.step: the one training step is forward/backward, the exchange and the optimizer in
that order (the same bits as the loop written out), double buffering applies each half's
update one half late, and the codec's fused paths give the unfused bits."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcsgd.codecs import make_codec
from hpcsgd.comm.exchange import Allreduce, Striped
from hpcsgd.model.dnn import dnn
from hpcsgd.optim import Optimizer
from hpcsgd.step import Step, gradient_buffers, halves

LR, N = 0.01, 24


def setup(exchange="allreduce", fuse_owner=True, double_buffering=False, precision="float32",
          scaler=None):
    model = dnn(6, [5, 4], 3, max_batch=N, precision=precision)
    params = model.new_params()
    model.init(params, np.random.default_rng(0))
    if exchange == "allreduce":
        ex = Allreduce(MPI.COMM_SELF, params.size)
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
