"""What a float32 exp would buy the 46M model's step at 1 x 2 threads. The package's exp
(hpcsgd/model/kernels.py) computes its reduced argument and polynomial in float64, and so the
sigmoid's divide too; a copy of the module with n = floor(...) left in float32 keeps all of it
in float32 (1.3 ulp instead of 1, other bits: every trained figure would change; not landed).
Times the two kernels that use exp on the step's shapes, the package's and the copy's
alternated, best of 10 per round: the sigmoid forward on one 1024 x 2048 layer (7 per step)
and the softmax + cross-entropy backward on 1024 x 9304 (1 per step).
    cd experiments && python float32_exp_step.py [rounds]
"""
import os
import sys
import tempfile
import time

from hpcsgd import threads
threads.apply(2)
import numpy as np
import hpcsgd.model.kernels as K64
from old_module import load

src = open(K64.__file__).read()
old = "    n = np.float64(np.floor(x * _LOG2E + _HALF))"
assert old in src
path = os.path.join(tempfile.mkdtemp(), "kernels_f32.py")
open(path, "w").write(src.replace(old, "    n = np.floor(x * _LOG2E + _HALF)"))
K32 = load(path, "kernels_f32")

x = np.linspace(-80, 80, 1 << 20, dtype=np.float32)
e64, e32 = np.empty_like(x), np.empty_like(x)
K64.exp_kernel(x, e64)
K32.exp_kernel(x, e32)
ref = np.exp(x.astype(np.float64))
print(f"exp, max relative error against float64: package {np.max(np.abs(e64 - ref) / ref):.2e}, "
      f"float32 copy {np.max(np.abs(e32 - ref) / ref):.2e}; {np.mean(e32 != e64):.1%} of values differ")

rng = np.random.default_rng(0)
z0 = rng.standard_normal((1024, 2048), dtype=np.float32)
b = rng.standard_normal((1, 2048), dtype=np.float32)
zo0 = (rng.standard_normal((1024, 9304)) * 3).astype(np.float32)
bo = np.zeros((1, 9304), np.float32)
y = rng.integers(0, 9304, 1024).astype(np.int32)
C = K64.NCHUNK


def best_ms(kernels):
    sig = soft = 1e9
    for _ in range(10):
        z = z0.copy()
        t = time.perf_counter()
        kernels.sigmoid_forward(z, b)
        sig = min(sig, time.perf_counter() - t)
        z = zo0.copy()
        t = time.perf_counter()
        kernels.softmax_xent_backward(z, bo, y, np.zeros((1, 9304), np.float32),
                                      np.zeros((C, 9304), np.float32),
                                      np.zeros((C, kernels.LANES), np.float32), np.zeros(C),
                                      np.zeros(C, np.int64))
        soft = min(soft, time.perf_counter() - t)
    return sig * 1e3, soft * 1e3


for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 4):
    (s64, x64), (s32, x32) = best_ms(K64), best_ms(K32)
    print(f"sigmoid forward {s64:.2f} -> {s32:.2f} ms, softmax_xent {x64:.2f} -> {x32:.2f} ms: "
          f"{7 * (s64 - s32) + (x64 - x32):.1f} ms less per step")
