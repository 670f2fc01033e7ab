"""A time step's recurrent product of a few rows, old kernel against new, alternated in one
process, one thread, for every row count up to SMALL_ROWS and the BLSTM's two shapes (forward
h U: K = 256, N = 1024; backward dgates U^T: K = 1024, N = 256), numpy's BLAS beside:
    git show REV:hpcsgd/model/kernels_lstm.py > /tmp/kernels_lstm_old.py
    NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 python experiments/small_matmul_ab.py /tmp/kernels_lstm_old.py
The old kernel (before 2026-11-27 afternoon) is small_matmul(a, b, out) = a @ b (axpy form,
four rows of b a pass); the new one small_matmul_nt(a, bt, out) = a @ bt^T (dot products in
register blocks). Both are checked against float64 first."""
import sys
import time

import numpy as np

from hpcsgd.model import kernels_lstm as KL
from old_module import load

old = load(sys.argv[1], "kernels_lstm_old")
rng = np.random.default_rng(0)


def per_call(f, *args, reps=300):
    t = time.perf_counter()
    for _ in range(reps):
        f(*args)
    return (time.perf_counter() - t) / reps


print(f"{'K':>5s} {'N':>5s} {'rows':>4s} {'old us':>8s} {'new us':>8s} {'BLAS us':>8s} "
      f"{'new/old':>8s} {'new GFLOP/s':>11s}")
for k_all, n in ((256, 1024), (1024, 256)):
    b = rng.standard_normal((k_all, n)).astype(np.float32)
    bt = np.ascontiguousarray(b.T)
    for m in range(1, KL.SMALL_ROWS + 1):
        a = rng.standard_normal((m, k_all)).astype(np.float32)
        o1, o2, o3 = (np.empty((m, n), np.float32) for _ in range(3))
        old.small_matmul(a, b, o1)
        KL.small_matmul_nt(a, bt, o2)
        ref = a.astype(np.float64) @ b
        for o in (o1, o2):
            assert np.abs(o - ref).max() < 1e-4 * np.abs(ref).max()
        t = np.array([[per_call(old.small_matmul, a, b, o1), per_call(KL.small_matmul_nt, a, bt, o2),
                       per_call(np.matmul, a, b, o3)] for _ in range(9)])
        t_old, t_new, t_blas = np.median(t, axis=0)
        print(f"{k_all:5d} {n:5d} {m:4d} {t_old * 1e6:8.1f} {t_new * 1e6:8.1f} {t_blas * 1e6:8.1f} "
              f"{t_old / t_new:7.2f}x {2 * m * k_all * n / t_new / 1e9:11.1f}")
