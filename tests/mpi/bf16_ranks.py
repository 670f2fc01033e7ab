"""Under mpiexec -n K: data-parallel bf16 training (train.precision=bf16) through the trainer's
step with the striped 1-bit exchange learns a task a linear model can learn, and every value
the step stores in a 16-bit format is a bfloat16 value.

    mpiexec -n 2 python tests/mpi/bf16_ranks.py

Each rank draws its own frames x ~ N(0, 1)^8 labelled argmax(x @ M) (M the same on every
rank: 4 classes, chance 25%, the majority class about 30%). The model's element-wise kernels
are wrapped so that each checks, at every call, that every array it reads or wrote is
bfloat16 (the GEMM outputs after HalfOps rounded them, the activations it reads back from
the layer below, the kernel's own outputs); after every step the stored input copy (x16),
the weight copy (w16), the activations' buffers (each holds its dz after the backward) and
the delta buffer are checked, and the gradient as unscale leaves it. At the end: the
held-out frame accuracy of the float32 master weights is far above chance, the training
cross-entropy fell, and the ranks hold the same weights. Prints "bf16 ok" per rank.
"""
import numpy as np
from mpi4py import MPI

from hpcsgd.codecs import make_codec
from hpcsgd.comm.exchange import Striped
from hpcsgd.model.dnn import dnn
from hpcsgd.model.ops import HalfOps
from hpcsgd.optim import Optimizer
from hpcsgd.step import Step, gradient_buffers

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
N, DIM, CLASSES, STEPS, LR = 64, 8, 4, 150, 0.005
checked = {"calls": 0, "values": 0}


def assert_bf16(a, what):
    a = np.ascontiguousarray(a, np.float32)
    bits = a.view(np.uint32)
    bad = np.flatnonzero((bits & 0xFFFF) != 0)
    assert bad.size == 0, f"rank {rank}: {what} holds {bad.size} values that are not " \
                          f"bfloat16, e.g. {a.reshape(-1)[bad[:3]]}"
    checked["values"] += a.size


class Checked:
    """The model's ops, each call checking that every array argument it reads is bfloat16
    (the bias b and its gradient gb excepted: float32 by design, docs/precision.md). Inside
    HalfOps: a GEMM output has been rounded by then, a kernel's output is rounded after the
    call returns (checked where the next kernel reads it, or after the step)."""

    FLOAT32 = {"b", "gb"}

    def __init__(self, ops):
        self.ops = ops

    def __getattr__(self, name):
        method = getattr(self.ops, name)
        code = method.__func__.__code__
        names = code.co_varnames[1:code.co_argcount]

        def checked_call(*args):
            if name != "scale":   # scale's input is the loss gradient before its rounding
                for n, a in zip(names, args):
                    if isinstance(a, np.ndarray) and a.dtype == np.float32 \
                            and n not in self.FLOAT32:
                        assert_bf16(a, f"{name}({n}) as the kernel reads it")
            checked["calls"] += 1
            return method(*args)
        return checked_call


model = dnn(DIM, [32, 32], CLASSES, "relu", max_batch=N, precision="bf16")
assert model.rounding == "bfloat16" and isinstance(model.half_ops, HalfOps)
model.half_ops.ops = Checked(model.half_ops.ops)   # HalfOps rounds, then calls the checked ops
params = model.new_params()
model.init(params, np.random.default_rng(0))
ex = Striped(comm, params.matrices, make_codec("onebit", "cpu"))
opt = Optimizer(params.size, momentum_time_constant=500.0, post_size=ex.state_size)
step = Step(model, params, gradient_buffers(model, False), opt, ex, False, "none")

unscale = model.unscale


def checked_unscale(grads, scale):
    assert scale == 1.0   # bf16: no loss scale
    out = unscale(grads, scale)
    assert_bf16(grads.flat, "the gradient after unscale")
    return out


model.unscale = checked_unscale

M = np.random.default_rng(1).standard_normal((DIM, CLASSES))
rng = np.random.default_rng(100 + rank)


def frames(n, rng):
    x = rng.standard_normal((n, DIM)).astype(np.float32)
    return x, np.argmax(x @ M, axis=1).astype(np.int32)


def batch(n):
    return frames(n, rng)


take = np.full(comm.Get_size(), N)
ces = []
for s in range(STEPS):
    ce, correct, frames_here = step.run(batch, take, rank, LR)
    ces.append(ce / frames_here)
    assert_bf16(model.x16[:N], "x16")
    assert_bf16(model.w16.flat, "w16")
    for i, act in enumerate(model.acts):
        assert_bf16(act[:N], f"acts[{i}] (its dz)")
    assert_bf16(model.delta, "delta")
# per step: 2 bias_act, 2 act_backward, 1 softmax_xent (which applies the loss scale)
assert checked["calls"] >= 5 * STEPS, checked

x_cv, y_cv = frames(16 * N, np.random.default_rng(7))
guess = np.concatenate([model.forward(params, x_cv[i:i + N], N).argmax(1)
                        for i in range(0, len(x_cv), N)])
accuracy = float((guess == y_cv).mean())
majority = np.bincount(y_cv, minlength=CLASSES).max() / len(y_cv)
first, last = np.mean(ces[:20]), np.mean(ces[-20:])
assert accuracy > majority + 0.4, (accuracy, majority)
assert last < 0.5 * first, (first, last)
everyone = comm.allgather(params.flat.copy())
for other in everyone[1:]:
    np.testing.assert_array_equal(other, everyone[0])
print(f"rank {rank}: bf16 ok: cv accuracy {accuracy:.3f} (majority {majority:.3f}), train ce "
      f"{first:.3f} -> {last:.3f}, {checked['values']:,} stored values checked", flush=True)
