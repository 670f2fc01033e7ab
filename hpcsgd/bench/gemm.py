"""This machine's GEMM limits: float32 matmul GFLOP/s for a DNN's training shapes, the BLAS's
best on a large square product (`bench train` times the step's GEMMs alone itself, the
model's forward and backward with hpcsgd.model.ops.GemmOnly). OpenBLAS threads are set at run time through the
library numpy loaded (ctypes), so one process can measure 1 thread and all cores.
"""
import ctypes
import glob
import os

import numpy as np

_BLAS = None


def _blas():
    """numpy's bundled OpenBLAS (scipy-openblas wheel) or None if it cannot be found."""
    global _BLAS
    if _BLAS is None:
        libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
        found = glob.glob(os.path.join(libs, "libscipy_openblas*.so*"))
        _BLAS = ctypes.CDLL(found[0]) if found else False
    return _BLAS or None


def blas_threads(n=None):
    """Set OpenBLAS's thread count (if n) and return it (None: not an OpenBLAS we know)."""
    lib = _blas()
    if lib is None:
        return None
    if n:
        lib.scipy_openblas_set_num_threads64_(int(n))
    return int(lib.scipy_openblas_get_num_threads64_())


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
