"""device.gemm's call to cublasGemmEx, without a GPU: the row-major arrays as cuBLAS's
column-major transposes, each operand's leading dimension from its row stride, the
transpose flags, the operand and output types (float32, float16, bfloat16 as uint16 bits:
CUDA_R_16BF) and CUBLAS_COMPUTE_32F. A stand-in for CuPy's
cuBLAS binding (this file's gemmEx) carries out exactly what cuBLAS documents for the
arguments it is given, on host memory, so a wrong flag, dimension or leading dimension gives
a wrong product here as it would on a GPU (where the simulator cannot follow: it has no cuBLAS).
"""
import ctypes
import sys
import types

import numpy as np
import pytest

from hpcsgd import bfloat16, device

OP_N, OP_T, R_16F, R_32F, R_16BF, COMPUTE_32F = 0, 1, 2, 0, 14, 68
BF16 = np.uint16   # bfloat16 operands: uint16 arrays of its bits (hpcsgd/model/network.py)


def bf16_of(v):
    """The bfloat16 bits of float64 values: rounded to float32, then to bfloat16 by the rule
    (hpcsgd/bfloat16.py: round to nearest even on the float32 bits)."""
    return bfloat16.bits(np.asarray(v, np.float32))


def values(a):
    """An operand's float64 values (bfloat16 bits widened)."""
    return (bfloat16.values(a) if a.dtype == BF16 else a).astype(np.float64)


class HostArray:
    """A host NumPy view that shows itself as a device array does (__cuda_array_interface__)."""

    def __init__(self, a):
        self.a, self.shape, self.dtype, self.size = a, a.shape, a.dtype, a.size
        strides = None if a.flags.c_contiguous else a.strides
        self.__cuda_array_interface__ = {"data": (a.ctypes.data, False), "shape": a.shape,
                                         "strides": strides, "typestr": a.dtype.str,
                                         "version": 3}


def _column_major(ptr, dtype, rows, cols, ld):
    """The column-major (rows x cols) matrix at ptr with leading dimension ld (cuBLAS's view)."""
    assert ld >= max(1, rows), (ld, rows)
    itemsize = np.dtype(dtype).itemsize
    total = (cols - 1) * ld + rows
    raw = (ctypes.c_byte * (total * itemsize)).from_address(ptr)
    flat = np.frombuffer(raw, dtype=dtype, count=total)
    return np.lib.stride_tricks.as_strided(flat, (rows, cols), (itemsize, ld * itemsize))


CALLS = []


def gemmEx(handle, transa, transb, m, n, k, alpha, A, atype, lda, B, btype, ldb, beta, C,
           ctype, ldc, compute, algo):
    """C (m x n) = alpha op(A) op(B) + beta C, column-major, as cuBLAS defines it."""
    CALLS.append((atype, btype, ctype, compute))
    assert compute == COMPUTE_32F and atype == btype
    dt = {R_16F: np.float16, R_32F: np.float32, R_16BF: BF16}
    alpha = np.frombuffer((ctypes.c_float * 1).from_address(alpha), np.float32)[0]
    beta = np.frombuffer((ctypes.c_float * 1).from_address(beta), np.float32)[0]
    a = _column_major(A, dt[atype], *((m, k) if transa == OP_N else (k, m)), lda)
    b = _column_major(B, dt[btype], *((k, n) if transb == OP_N else (n, k)), ldb)
    c = _column_major(C, dt[ctype], m, n, ldc)
    opa = values(a) if transa == OP_N else values(a).T
    opb = values(b) if transb == OP_N else values(b).T
    result = alpha * (opa @ opb) + beta * values(c)
    c[...] = bf16_of(result) if c.dtype == BF16 else result.astype(c.dtype)


@pytest.fixture
def fake_cublas(monkeypatch):
    cublas = types.SimpleNamespace(CUBLAS_OP_N=OP_N, CUBLAS_OP_T=OP_T,
                                   CUBLAS_COMPUTE_32F=COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT_TENSOR_OP=99, gemmEx=gemmEx,
                                   setStream=lambda handle, stream: None)
    runtime = types.SimpleNamespace(CUDA_R_16F=R_16F, CUDA_R_32F=R_32F)   # no R_16BF: CuPy's
    modules = {"cupy": types.ModuleType("cupy"), "cupy.cuda": types.ModuleType("cupy.cuda"),
               "cupy.cuda.device": types.SimpleNamespace(get_cublas_handle=lambda: 7),
               "cupy_backends": types.ModuleType("cupy_backends"),
               "cupy_backends.cuda": types.ModuleType("cupy_backends.cuda"),
               "cupy_backends.cuda.api": types.SimpleNamespace(runtime=runtime),
               "cupy_backends.cuda.libs": types.SimpleNamespace(cublas=cublas)}
    modules["cupy.cuda"].device = modules["cupy.cuda.device"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    CALLS.clear()
    return CALLS


def views(rng, shape, dtype, strided):
    """A (rows, cols) operand: C-contiguous, or a view of wider rows (a longer row stride, as
    an LSTM's slice of its gates), at an offset."""
    def draw(s):
        v = rng.standard_normal(s)
        return bf16_of(v) if dtype == BF16 else v.astype(dtype)
    if not strided:
        return draw(shape)
    wide = draw((shape[0], shape[1] + 5))
    return wide[:, 3:3 + shape[1]]


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("dtype,out_dtype", [(np.float32, np.float32), (np.float16, np.float16),
                                             (np.float16, np.float32), (BF16, BF16),
                                             (BF16, np.float32)])
@pytest.mark.parametrize("strided", [False, True])
def test_gemm_computes_op_a_times_op_b_in_place(fake_cublas, trans_a, trans_b, dtype, out_dtype,
                                                strided):
    rng = np.random.default_rng(0)
    n, k, m = 5, 7, 3
    a = views(rng, (k, n) if trans_a else (n, k), dtype, strided)
    b = views(rng, (m, k) if trans_b else (k, m), dtype, strided)
    wide = views(rng, (n, m + 5), out_dtype, False)
    out = wide[:, 3:3 + m] if strided else wide[:, :m].copy()
    around = wide.copy()
    device.gemm(HostArray(a), HostArray(b), HostArray(out), trans_a, trans_b)
    want = (values(a.T if trans_a else a) @ values(b.T if trans_b else b))
    want = bf16_of(want) if out_dtype == BF16 else want.astype(out_dtype)
    np.testing.assert_array_equal(out, want)
    if strided:   # only the view was written, not the wider rows around it
        outside = np.ones(wide.shape, bool)
        outside[:, 3:3 + m] = False
        np.testing.assert_array_equal(wide[outside], around[outside])
    ab = {np.float16: R_16F, np.float32: R_32F, BF16: R_16BF}
    assert fake_cublas == [(ab[dtype], ab[dtype], ab[out_dtype], COMPUTE_32F)]


def test_gemm_refuses_a_column_strided_view(fake_cublas):
    a = np.zeros((4, 6), np.float32)[:, ::2]
    b = np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match="expected contiguous rows"):
        device.gemm(HostArray(a), HostArray(b), HostArray(np.zeros((4, 2), np.float32)))
