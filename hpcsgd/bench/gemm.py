"""This machine's GEMM limits: float32 matmul GFLOP/s for a DNN's training shapes, the BLAS's
best on a large square product (`bench train` times the step's GEMMs alone itself, the
model's forward and backward with hpcsgd.model.ops.GemmOnly). OpenBLAS threads are set at
run time through the library numpy loaded (hpcsgd.threads.blas_threads), so one process can
measure 1 thread and all cores.
"""
import numpy as np

def gemm_timer(m, k, n, transpose_a=False, transpose_b=False):
    """(run, flop): one product C(m,n) = A(m,k) @ B(k,n) into a preallocated C (A or B read
    transposed, as the backward pass does), to time alone or in alternation with another."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((k, m) if transpose_a else (m, k), dtype=np.float32)
    b = rng.standard_normal((n, k) if transpose_b else (k, n), dtype=np.float32)
    a, b = (a.T if transpose_a else a), (b.T if transpose_b else b)
    c = np.empty((m, n), np.float32)
    np.matmul(a, b, out=c)       # first touch, BLAS thread start-up
    return (lambda: np.matmul(a, b, out=c)), 2.0 * m * k * n


def training_shapes(dims, n):
    """(label, m, k, n, transpose_a, transpose_b) of every distinct GEMM of one training step
    of the DNN with layer sizes dims on n frames: forward a @ W, dW = a.T @ dZ, dX = dZ @ W.T."""
    out = {}
    for l, (i, o) in enumerate(zip(dims[:-1], dims[1:])):
        out.setdefault(f"fwd {n}x{i} @ {i}x{o}", (n, i, o, False, False))
        out.setdefault(f"dW {i}x{n} @ {n}x{o}", (i, n, o, True, False))
        if l > 0:
            out.setdefault(f"dX {n}x{o} @ {o}x{i}", (n, o, i, False, True))
    return out
