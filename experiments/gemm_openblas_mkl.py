"""NumPy's OpenBLAS (what hpcsgd's GEMMs call) against PyTorch's MKL on the GEMMs of a CTC
step (so762_ctc.yaml's second BLSTM layer: 512 inputs, 4 x 256 gates per direction) at one
rank's rows of a 2 x 1 step (667 = 2000 frames stacked by 3) and of a 1-rank step (1333): GFLOP/s
on one thread, the median of 7. On Intel (EMR) MKL is 1.15-1.3x OpenBLAS on these shapes,
which is where PyTorch's 2 x 1 step passes hpcsgd's GEMM roofline (experiments/ctc_step_bench.md).

    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 python experiments/gemm_openblas_mkl.py
(torch is a benchmark peer, not a dependency: pip install torch)
"""
import time

import numpy as np
import torch


def median_time(f, repeats=7):
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return sorted(times)[repeats // 2]


def main():
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    rows = 667
    shapes = [(rows, 512, 2048, False, False, "x @ W"), (512, rows, 2048, True, False, "x^T @ dgates"),
              (rows, 2048, 512, False, True, "dgates @ W^T"), (256, rows, 1024, True, False, "h^T @ dgates (gU)"),
              (2 * rows - 1, 512, 2048, False, False, "x @ W, 1 rank")]
    for m, k, n, trans_a, trans_b, name in shapes:
        a = rng.standard_normal((k, m) if trans_a else (m, k), dtype=np.float32)
        b = rng.standard_normal((n, k) if trans_b else (k, n), dtype=np.float32)
        a_op, b_op = (a.T if trans_a else a), (b.T if trans_b else b)
        out = np.empty((m, n), np.float32)
        t_numpy = median_time(lambda: np.matmul(a_op, b_op, out=out))
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        ta, tb = (ta.t() if trans_a else ta), (tb.t() if trans_b else tb)
        tout = torch.empty(m, n)
        t_torch = median_time(lambda: torch.mm(ta, tb, out=tout))
        flop = 2 * m * k * n
        print(f"{name:18s} {m}x{k}x{n}: numpy/OpenBLAS {flop / t_numpy / 1e9:6.1f} GFLOP/s, "
              f"torch/MKL {flop / t_torch / 1e9:6.1f} GFLOP/s ({t_numpy / t_torch:.2f}x)")


if __name__ == "__main__":
    main()
