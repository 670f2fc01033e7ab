"""hpcsgd.state: snapshot and restore are exact and in place, a checkpoint round trip gives
back every part (parameters, optimizer, residuals, progress, decisions, an exchange in
flight), and the probe's candidate sizes."""
import numpy as np
import pytest
from mpi4py import MPI

from hpcsgd.codecs import make_codec
from hpcsgd.comm.exchange import Striped
from hpcsgd.comm.grid import Grid
from hpcsgd.decisions import probe_candidates
from hpcsgd.model.dnn import dnn
from hpcsgd.optim import Optimizer
from hpcsgd.state import TrainState
from hpcsgd.step import Step, gradient_buffers

N = 32


class Log:
    def info(self, message):
        pass


def make_state(double_buffering=False, seed=0):
    model = dnn(6, [5], 3, max_batch=N)
    params = model.new_params()
    model.init(params, np.random.default_rng(seed))
    ex = Striped(MPI.COMM_SELF, params.matrices, make_codec("onebit", "cpu"))
    opt = Optimizer(params.size, momentum_time_constant=50.0, adagrad="aggregate",
                    post_size=ex.state_size)
    step = Step(model, params, gradient_buffers(model, double_buffering), opt, ex,
                double_buffering, "none")
    static = {"model": model.describe, "data": {}, "label_inventory_hash": "h",
              "label_counts": [1, 2, 3], "aggregation": "striped",
              "config": {"train.minibatch": N, "optim.adagrad": "aggregate",
                         "train.probe_every_frames": 100}}
    return TrainState(Grid(MPI.COMM_SELF), params, opt, ex, step, None, static), step


def train(state, step, steps, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, 6)).astype(np.float32)
    y = rng.integers(0, 3, N).astype(np.int32)
    for _ in range(steps):
        step.run(lambda n: (x[:n], y[:n]), np.array([N]), 0, 0.01)
        state.advance(np.array([N]))


def arrays(state):
    return [state.params.flat.copy(), state.opt.velocity.copy(), state.opt.sqr.copy(),
            state.ex.residual1.copy(), state.ex.residual2.copy(), state.opt.sqr_weight]


def test_snapshot_and_restore_are_exact_and_in_place():
    state, step = make_state()
    train(state, step, 3)
    progress = state.progress
    snap, before = state.snapshot(), arrays(state)
    train(state, step, 2, seed=2)
    state.decisions["minibatch"] = 64
    assert not np.array_equal(arrays(state)[0], before[0])
    state.restore(snap)
    for a, b in zip(arrays(state), before):
        np.testing.assert_array_equal(a, b)
    assert state.progress is progress and progress["frames"] == 3 * N   # the spine's dict
    assert state.decisions["minibatch"] == N


@pytest.mark.parametrize("double_buffering", [False, True])
def test_a_checkpoint_gives_back_every_part(tmp_path, double_buffering):
    state, step = make_state(double_buffering)
    train(state, step, 3)
    state.decisions.update(minibatch=96, next_probe=500)
    state.progress["cv_history"].append(0.5)
    path = state.save(str(tmp_path), keep=2)
    other, other_step = make_state(double_buffering, seed=9)
    other.load(path, Log())
    for a, b in zip(arrays(other), arrays(state)):
        np.testing.assert_array_equal(a, b)
    assert other.progress == state.progress and other.decisions == state.decisions
    assert (other_step.pending is not None) == double_buffering
    if double_buffering:   # the same update applied to both: the same weights
        step.drain()
        other_step.drain()
        np.testing.assert_array_equal(other.params.flat, state.params.flat)


def test_probe_candidates_grow_by_sqrt2_in_multiples_of_64():
    assert probe_candidates(1024, 8192) == [512, 704, 1024, 1472]   # 2112 > 2 x 1024
    assert probe_candidates(1024, 1024) == [512, 704, 1024]
    assert probe_candidates(64, 8192) == [64, 128]
