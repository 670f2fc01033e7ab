"""Would Intel MKL make a CPU rank's CTC step faster? NumPy's OpenBLAS against MKL's
cblas_sgemm (called through ctypes, the operands as they are: a transposed view is a flag and
a leading dimension) on one rank's forward and backward pass of bench train's CTC model
(so762_ctc.yaml's encoder: frames stacked by 3, BLSTM 256 x 3) at the rows of one of 2 ranks
(N = 2000 frames: 5 utterances of 400) and of one rank (4000), alternated in one process:

  openblas  every GEMM by NumPy (what hpcsgd does);
  mkl       the layers' GEMMs by MKL, the time steps' products of at most SMALL_ROWS rows in
            the step's launch as with OpenBLAS;
  mkl_all   those products by MKL too, before each launch.

The median ms of ROUNDS rounds and each mode's median ratio to OpenBLAS round by round
(paired: this VM's speed drifts between minutes). MKL_CBWR=AUTO in the environment measures
MKL in its reproducible mode (what a trainer would need: the same bits run to run). Needs
`pip install mkl` (not a dependency of hpcsgd).

    for t in 1 2; do NUMBA_NUM_THREADS=$t OPENBLAS_NUM_THREADS=$t OMP_NUM_THREADS=$t \\
        OMP_WAIT_POLICY=PASSIVE OPENBLAS_THREAD_TIMEOUT=4 python experiments/blas_mkl_ctc.py; done
"""
import ctypes
import glob
import os
import statistics
import sys
import time

import numba
import numpy as np

from hpcsgd import device
from hpcsgd.bench.train import ctc_minibatch
from hpcsgd.model import conv, layers, lstm, ops
from hpcsgd.model import kernels_lstm as KL

MODES = ("openblas", "mkl", "mkl_all")
ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112


def load_mkl(threads):
    lib = ctypes.CDLL(sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))[0])
    for name in ("MKL_Set_Threading_Layer", "MKL_Set_Num_Threads", "MKL_Set_Dynamic"):
        getattr(lib, name).argtypes = [ctypes.c_int]
    lib.MKL_Set_Threading_Layer(1 if threads == 1 else 3)   # sequential, or GNU (libgomp)
    lib.MKL_Set_Dynamic(0)
    lib.MKL_Set_Num_Threads(threads)
    sgemm = lib.cblas_sgemm
    i, f, p = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
    sgemm.argtypes = [i, i, i, i, i, i, f, p, i, p, i, f, p, i]
    return sgemm


def described(x, trans):
    """(flag, leading dimension) of op(x) for a row-major BLAS, or None."""
    s0, s1 = x.strides
    if s1 == 4 and s0 // 4 >= max(1, x.shape[1]):
        return (TRANS if trans else NO_TRANS), s0 // 4
    if s0 == 4 and s1 // 4 >= max(1, x.shape[0]):
        return (NO_TRANS if trans else TRANS), s1 // 4
    return None


def mkl_matmul(sgemm, numpy_matmul):
    def matmul(a, b, out, trans_a=False, trans_b=False):
        da, db = described(a, trans_a), described(b, trans_b)
        if (a.dtype != np.float32 or da is None or db is None or out.strides[1] != 4
                or np.may_share_memory(out, a) or np.may_share_memory(out, b)):
            return numpy_matmul(a, b, out, trans_a, trans_b)
        m, n = out.shape
        sgemm(ROW_MAJOR, da[0], db[0], m, n, a.shape[0] if trans_a else a.shape[1], 1.0,
              a.ctypes.data, da[1], b.ctypes.data, db[1], 0.0, out.ctypes.data,
              out.strides[0] // 4)
    return matmul


def every_product_before_the_launch(step_operand):
    def operand(a, w, out, trans_b, d, xs):
        if a is not None and len(a) <= KL.SMALL_ROWS:
            ops.matmul(a, w, out, trans_b=trans_b)
            return out[:0]
        return step_operand(a, w, out, trans_b, d, xs)
    return operand


def main():
    threads = numba.get_num_threads()
    numpy_matmul, step_operand = device.matmul, ops._step_operand
    by_mkl = mkl_matmul(load_mkl(threads), numpy_matmul)
    print(f"MKL_CBWR={os.environ.get('MKL_CBWR', '(unset)')}")
    for n in (2000, 4000):
        model, params, grads, x, y = ctc_minibatch(n)
        times = {mode: [] for mode in MODES}
        for _ in range(int(os.environ.get("ROUNDS", 15))):
            for mode in MODES:
                gemm = numpy_matmul if mode == "openblas" else by_mkl
                for module in (ops, conv, layers, lstm):
                    module.matmul = gemm
                ops._step_operand = (every_product_before_the_launch(step_operand)
                                     if mode == "mkl_all" else step_operand)
                model.forward_backward(params, grads, x, y, n)   # warms the caches
                t = time.perf_counter()
                model.forward_backward(params, grads, x, y, n)
                times[mode].append(time.perf_counter() - t)
        ratios = {mode: round(statistics.median(b / a for a, b in zip(times[mode],
                                                                      times["openblas"])), 3)
                  for mode in MODES[1:]}
        print(f"N = {n}, {threads} thread(s): ms per forward+backward",
              {mode: round(statistics.median(v) * 1e3, 1) for mode, v in times.items()},
              "speed-up over OpenBLAS (paired median):", ratios, flush=True)


if __name__ == "__main__":
    main()
