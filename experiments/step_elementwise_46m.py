"""Where the 46M model's step spends its non-GEMM time: one process with 2 threads (the
trainer's thread environment), the step's element-wise kernels timed one by one (ops wrapped
by a timer), beside the same step with the GEMMs alone (model.ops.GemmOnly), four rounds.
    python experiments/step_elementwise_46m.py
"""
import os, sys, time, collections
from hpcsgd import threads
threads.apply(2)
import numpy as np
from hpcsgd.model import build
from hpcsgd.model.ops import GemmOnly
from hpcsgd.step import gradient_buffers
from hpcsgd.bench.train import PAPER
model = build(dict(PAPER, activation="sigmoid"), max_batch=1024)
params = model.new_params(); model.init(params, np.random.default_rng(0))
grads = gradient_buffers(model, True)
rng = np.random.default_rng(1)
x = rng.standard_normal((1024, 440), dtype=np.float32); y = rng.integers(0, 9304, 1024).astype(np.int32)
T = collections.defaultdict(float)
class Timed:
    def __init__(self, inner): self.inner = inner
    def __getattr__(self, name):
        f = getattr(self.inner, name)
        def w(*a, **k):
            t = time.perf_counter(); r = f(*a, **k); T[name] += time.perf_counter() - t; return r
        return w
ops = Timed(model.ops)
for _ in range(2): model.forward_backward(params, grads[0], x, y, 1024)
for rnd in range(4):
    T.clear()
    t = time.perf_counter(); model.forward_backward(params, grads[0], x, y, 1024, ops=ops); full = time.perf_counter() - t
    t = time.perf_counter(); model.forward_backward(params, grads[0], x, y, 1024, ops=GemmOnly()); gem = time.perf_counter() - t
    print(f"full {full*1e3:7.1f} ms  gemm-only {gem*1e3:7.1f} ms ({gem/full:.1%})  ops: " + ", ".join(f"{k} {v*1e3:.1f}" for k, v in sorted(T.items())))
