"""Where a rank's arrays live: host memory (NumPy) or its CUDA device (Numba device arrays),
the few whole-array operations the trainer needs on either, and the device's GEMM.

GPU ranks (`train.device: cuda`) keep parameters, gradients, optimizer state, codec buffers
and residuals in Numba device arrays; CuPy is used only where it beats hand-written code:
cuBLAS GEMMs (here) and NCCL (hpcsgd/comm/gpu.py). Numba and CuPy share the legacy default
stream, so a kernel launched by one is ordered before work of the other without a sync.

Under NUMBA_ENABLE_CUDASIM=1 (tests without a GPU) device arrays are Numba's simulated ones:
host memory behind a device-array interface, every kernel interpreted in Python. The
simulator has no cuBLAS, so `matmul` multiplies the wrapped host arrays with NumPy there; on
a GPU it is cuBLAS through CuPy. Everything else runs the same code on both.
"""
import numpy as np

from hpcsgd import bfloat16, census
from hpcsgd.lazy_cuda import cuda, device_function

DEVICES = ("cpu", "cuda")


def simulated():
    """True when Numba's CUDA simulator stands in for a GPU."""
    from numba import config
    return bool(config.ENABLE_CUDASIM)


def is_device(a):
    """A Numba device array (real or simulated)?"""
    return hasattr(a, "copy_to_host")


def zeros(shape, dtype, device):
    """A zeroed array on the host ("cpu") or the rank's GPU ("cuda")."""
    if device == "cpu":
        return np.zeros(shape, dtype)
    # one host-to-device copy: these are start-up allocations, and a fill kernel would run a
    # Python thread per element in the simulator (78% of a small GPU test run's threads)
    return cuda.to_device(np.zeros(shape, dtype))


def zero(a):
    """a[...] = 0 on either side."""
    if is_device(a):
        fill(a, 0)
    else:
        a[...] = 0


def as_device(a):
    """Numba view of any __cuda_array_interface__ array (Numba, CuPy) without a copy."""
    if isinstance(a, np.ndarray):
        raise TypeError("backend='cuda' takes device arrays (__cuda_array_interface__), got a "
                        "NumPy array; copy it with numba.cuda.to_device first")
    return a if hasattr(a, "copy_to_host") else cuda.as_cuda_array(a)  # Numba as is; CuPy wrapped


def _make_mul_rn(real):
    """mul_rn(a, b): the float32 product a * b rounded once, in a kernel where the GPU must give
    the CPU's bits. NVVM emits a plain `mul.f32` for a float32 product (also for the float64
    product of two float32 values rounded to float32, which it shrinks, exactly), and PTX lets
    ptxas fuse an unrounded mul.f32 with the add or subtract that follows into one FMA, which
    rounds once where the CPU rounds twice (the H100's Dettmers residuals, 2026-11-26). libdevice's
    fmul_rn is PTX's `mul.rn.f32`, which ptxas never contracts. The simulator has no libdevice
    (its stubs give NaN): there a NumPy float32 product, the same rounding."""
    return _rounded_product(real, np.float32, "fmul_rn")


def _make_mul_rn64(real):
    """mul_rn64(a, b): the same for float64 (libdevice's dmul_rn, PTX mul.rn.f64): w - lr * x
    in float64 then rounded to float32, as the CPU computes it, not an FMA."""
    return _rounded_product(real, np.float64, "dmul_rn")


def _rounded_product(real, dtype, intrinsic):
    if real.config.ENABLE_CUDASIM:
        def product(a, b):
            return dtype(a) * dtype(b)
        return real.jit(device=True)(product)
    from numba.cuda import libdevice
    rounded = getattr(libdevice, intrinsic)

    def product(a, b):
        return rounded(a, b)
    return real.jit(device=True)(product)


mul_rn, mul_rn64 = device_function(_make_mul_rn), device_function(_make_mul_rn64)

FILL_THREADS, MAX_GRID, WARP = 256, 65535, 32


@cuda.jit
def fill_kernel(out, value):
    """out (1-D) <- value, grid-stride."""
    for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        out[i] = value


# ---- the compute stream: where the model's kernels and GEMMs go (train.cuda_graphs)
_COMPUTE = []   # [(CuPy stream, its Numba twin)] once use_compute_stream() made one
RECORDER = None  # the simulator's graph being captured: a list of (launch, args) (graphs.py)


def use_compute_stream():
    """GPU ranks that capture CUDA Graphs (hpcsgd/graphs.py): the model's kernels and GEMMs
    go to one stream made here, a *blocking* one: capturable (the legacy default stream is
    not), and ordered with the legacy stream both ways, where the optimizer, the codecs, the
    copies and the MPI staging stay, so nothing else needs an event or a wait. The simulator
    has no streams (every launch completes in order): nothing to make."""
    if not _COMPUTE and not simulated():
        cp = cupy_module()
        stream = cp.cuda.Stream(non_blocking=False)
        _COMPUTE.append((stream, cuda.external_stream(stream.ptr)))


def compute_stream():
    """The Numba stream the model's kernels launch on: 0 (the legacy default stream) unless
    use_compute_stream() made one."""
    return _COMPUTE[0][1] if _COMPUTE else 0


def capture_stream():
    """The CuPy stream of compute_stream() (None: the legacy one)."""
    return _COMPUTE[0][0] if _COMPUTE else None


def on_stream(config):
    """A launch configuration (grid, block) on the compute stream: (grid, block, stream)."""
    return (*config, compute_stream())


def one_thread_each(n, most=256):
    """(blocks, threads) of a launch with one thread per element of n (n >= 1): blocks of
    `most` threads, narrowed to n for a smaller array, and halved (a warp at least) while
    that leaves fewer than census.FILL_BLOCKS blocks (2 per SM of an H100), so a mid-sized
    array still reaches every SM. No idle threads: on a GPU they would only take a block's
    slots, and in Numba's simulator each is a Python thread to start (the tests' tiny models
    exchange matrices of tens of values)."""
    threads = min(most, n)
    while threads // 2 >= WARP and -(-n // threads) < census.FILL_BLOCKS:
        threads //= 2
    return -(-n // threads), threads


def fill(a, value):
    """Every element of the C-contiguous device array a (any shape) <- value."""
    a = as_device(a)
    if a.size:   # grid-stride: capping the grid gives the same result
        blocks, threads = one_thread_each(a.size, FILL_THREADS)
        fill_kernel[on_stream((min(blocks, MAX_GRID), threads))](a.reshape(a.size), value)


def to_host(a):
    """A NumPy view (host array) or copy (device array) of a; for checkpoints and logs.
    A device-to-host copy is a sync point."""
    return a.copy_to_host() if is_device(a) else a


def host_copy(a):
    """A NumPy copy of a, never a view (snapshots that must not change)."""
    return a.copy_to_host() if is_device(a) else np.array(a, copy=True)


def assign(dst, src):
    """dst[...] = src, where either may be on the device (same shape and dtype)."""
    if is_device(dst):
        dst.copy_to_device(src if is_device(src) else np.ascontiguousarray(src, dst.dtype))
    else:
        dst[...] = to_host(src)


def synchronize(device):
    """Wait for the device's queued work: before timing a phase or handing a buffer to a
    library that does not follow the stream (MPI). A no-op on the host."""
    if device == "cuda":
        cuda.synchronize()


def matmul(a, b, out, trans_a=False, trans_b=False, accumulate=False, scratch=None):
    """out = op(a) @ op(b), op = transpose where asked, for 2-D arrays on one side;
    accumulate=True: out += op(a) @ op(b) (cuBLAS's beta = 1; a host array needs `scratch`,
    a preallocated array of out's shape, for the product before the add: NumPy has no beta).
    Device arrays: cuBLAS via CuPy (zero-copy views of the Numba arrays; a transpose is a
    cuBLAS flag, not a copy); float32 operands give a float32 out (SGEMM), float16 operands
    (GPU ranks' mixed precision) a float16 or float32 out, uint16 operands (bfloat16 bits:
    bf16) a uint16 (bfloat16) or float32 out, accumulated in float32 either way and rounded
    once to out's dtype (gemm: cublasGemmEx, CUBLAS_COMPUTE_32F). In the simulator the same
    arithmetic up to the order of the sums: the operands widened to float32, NumPy's float32
    matmul, one rounding to out's dtype (bfloat16 by hpcsgd/bfloat16.py's rule). Host arrays:
    NumPy's BLAS."""
    if not is_device(out):
        if accumulate:
            np.matmul(a.T if trans_a else a, b.T if trans_b else b, out=scratch)
            np.add(out, scratch, out=out)
        else:
            np.matmul(a.T if trans_a else a, b.T if trans_b else b, out=out)
        return
    if a.dtype != b.dtype or (a.dtype != out.dtype and (a.dtype not in SIXTEEN_BIT
                                                        or out.dtype != np.float32)):
        raise TypeError(f"matmul: operands {a.dtype} and {b.dtype} into {out.dtype}: expected "
                        f"one dtype, or float16 operands (bfloat16: uint16) into their own "
                        f"dtype or float32")
    if RECORDER is not None:   # the simulator capturing a graph: replayed later, as cuBLAS's
        RECORDER.append((matmul, (a, b, out, trans_a, trans_b, accumulate)))
        return
    census.note_launch("cublas_gemm", census.FILL_BLOCKS)   # a cuBLAS kernel (or two)
    if simulated():   # host memory behind the simulated arrays; no cuBLAS to call
        x, y = a._ary, b._ary
        if x.dtype == np.float32 and not accumulate:
            np.matmul(x.T if trans_a else x, y.T if trans_b else y, out=out._ary)
            return
        x, y = _widened(x), _widened(y)   # float16 or bfloat16 -> float32: exact
        with np.errstate(over="ignore"):   # beyond float16's range: Inf, as cuBLAS stores it
            product = np.matmul(x.T if trans_a else x, y.T if trans_b else y)
            if accumulate:   # beta = 1: the old out widened, added in float32, rounded once
                product += _widened(out._ary)
            # bfloat16 bits by the kernels' rule (hpcsgd/bfloat16.py), else NumPy's conversion
            out._ary[...] = bfloat16.bits(product) if out.dtype == np.uint16 else product
        return
    gemm(a, b, out, trans_a, trans_b, accumulate)


def batched_matmul(a, b, out, trans_a=False, trans_b=False):
    """out[i] = op(a[i]) @ op(b[i]) for stacks of matrices (3-D or more, the last two axes
    the matrices', the leading ones the same on all three): the attention's
    per-utterance-and-head products (hpcsgd.model.conformer). Host arrays: NumPy's matmul,
    one BLAS GEMM per matrix. Device arrays (C-contiguous, one dtype; 16-bit operands as
    matmul takes them, into their own dtype or float32): one cuBLAS strided-batched GEMM
    (gemm_strided_batched: float32 accumulation, one rounding to out's dtype); in the
    simulator NumPy on the host memory behind the simulated arrays, as matmul there."""
    if not is_device(out):
        np.matmul(np.swapaxes(a, -1, -2) if trans_a else a,
                  np.swapaxes(b, -1, -2) if trans_b else b, out=out)
        return
    if a.dtype != b.dtype or (a.dtype != out.dtype and (a.dtype not in SIXTEEN_BIT
                                                        or out.dtype != np.float32)):
        raise TypeError(f"batched_matmul: operands {a.dtype} and {b.dtype} into {out.dtype}: "
                        f"expected one dtype, or 16-bit operands into float32")
    if RECORDER is not None:   # the simulator capturing a graph: replayed later
        RECORDER.append((batched_matmul, (a, b, out, trans_a, trans_b)))
        return
    census.note_launch("cublas_gemm", census.FILL_BLOCKS)
    if simulated():
        x, y = a._ary, b._ary
        x, y = (np.swapaxes(x, -1, -2) if trans_a else x), (np.swapaxes(y, -1, -2) if trans_b
                                                             else y)
        if x.dtype == np.float32:
            np.matmul(x, y, out=out._ary)
            return
        with np.errstate(over="ignore"):   # beyond float16's range: Inf, as cuBLAS stores it
            product = np.matmul(_widened(x), _widened(y))   # exact widening, float32 sums
            out._ary[...] = bfloat16.bits(product) if out.dtype == np.uint16 else product
        return
    gemm_strided_batched(a, b, out, trans_a, trans_b)


SIXTEEN_BIT = (np.dtype(np.float16), np.dtype(np.uint16))   # float16, bfloat16 bits


def _widened(x):
    """A 16-bit host array's values as float32 (exact): float16 converted, or uint16
    bfloat16 bits shifted into float32's upper half."""
    return bfloat16.values(x) if x.dtype == np.uint16 else x.astype(np.float32)


def _ld(a):
    """The leading dimension of a row-major 2-D device array as cuBLAS (column-major) reads it:
    its row stride in elements (a view of wider rows has a longer one); unit column stride."""
    strides, itemsize = a.__cuda_array_interface__["strides"], a.dtype.itemsize
    if strides is None:   # C-contiguous
        return max(a.shape[1], 1)
    if strides[1] != itemsize or strides[0] % itemsize:
        raise ValueError(f"matmul: a {a.shape} view with strides {strides}: expected "
                         f"contiguous rows")
    return max(strides[0] // itemsize, 1)


def gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    """out (n, m) = op(a) @ op(b) on a GPU through cublasGemmEx: float32 operands into float32
    (SGEMM's arithmetic: CUBLAS_COMPUTE_32F, no TF32), float16 operands into float16 or float32
    and bfloat16 operands (uint16 arrays: CUDA_R_16BF) into bfloat16 or float32
    (float32 multiply-accumulate, tensor cores allowed: CUBLAS_GEMM_DEFAULT_TENSOR_OP), alpha = 1,
    beta = 0 (1: accumulate) in float32, so each output is a float32 sum rounded once to
    out's dtype. Called
    directly rather than through cupy.matmul: CuPy picks CUBLAS_COMPUTE_32F for float16 too
    (cupy/_core/_routines_linalg.pyx: tensordot_core_v11, unless cupy._core.set_compute_type
    chose PEDANTIC), but it has no float16 x float16 -> float32 product (its out must have the
    operands' dtype), which the weight gradients need; its compute type is a process-wide
    setting anyone may change; and for a view with a longer row stride (an LSTM's slice of
    its gates) it may copy into a temporary from its pool, which a CUDA Graph would keep
    pointing at after the pool gave it to something else (hpcsgd/graphs.py). Here every
    operand is read in place (its row stride is cuBLAS's leading dimension) on the compute
    stream. Row-major arrays are cuBLAS's column-major transposes: out^T = op(b)^T op(a)^T."""
    n, m = out.shape
    k = a.shape[0] if trans_a else a.shape[1]
    if not (n and m):
        return
    if k == 0:
        if not accumulate:
            fill(out, 0)
        return
    cublas, handle, types = _cublas()
    ctype, abtype = types[np.dtype(out.dtype)], types[np.dtype(a.dtype)]
    one, beta = np.ones(1, np.float32), np.full(1, float(accumulate), np.float32)
    cublas.gemmEx(handle,
                  cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N,
                  cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N,
                  m, n, k, one.ctypes.data, _ptr(b), abtype, _ld(b),
                  _ptr(a), abtype, _ld(a), beta.ctypes.data,
                  _ptr(out), ctype, _ld(out), cublas.CUBLAS_COMPUTE_32F,
                  cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)


def _ptr(v):
    return v.__cuda_array_interface__["data"][0]


def _cublas():
    """(CuPy's cuBLAS binding, its handle set to the compute stream, {dtype: cudaDataType})."""
    from cupy.cuda import device as cupy_device
    from cupy_backends.cuda.api import runtime
    from cupy_backends.cuda.libs import cublas
    # CuPy's runtime module names no bfloat16 type (cupy_backends/cuda/api/_runtime_enum.pxd
    # stops at CUDA_C_8U): cudaDataType's CUDA_R_16BF is 14 (library_types.h)
    types = {np.dtype(np.float16): runtime.CUDA_R_16F, np.dtype(np.float32): runtime.CUDA_R_32F,
             np.dtype(np.uint16): getattr(runtime, "CUDA_R_16BF", 14)}
    handle = cupy_device.get_cublas_handle()
    stream = capture_stream()   # the handle's stream is whatever CuPy's last call set: say it
    cublas.setStream(handle, stream.ptr if stream is not None else 0)
    return cublas, handle, types


def _batch_stride(a, what):
    """A C-contiguous stack's matrices: (count, row length = leading dimension, elements
    between consecutive matrices)."""
    strides, shape = a.__cuda_array_interface__["strides"], tuple(a.shape)
    if strides is not None and tuple(strides) != tuple(
            int(np.prod(shape[i + 1:])) * a.dtype.itemsize for i in range(len(shape))):
        raise ValueError(f"batched_matmul: {what} {shape} with strides {strides}: expected a "
                         f"C-contiguous stack")
    return int(np.prod(shape[:-2])), max(shape[-1], 1), shape[-2] * shape[-1]


def gemm_strided_batched(a, b, out, trans_a=False, trans_b=False):
    """out[i] (n, m) = op(a[i]) @ op(b[i]) on a GPU through cublasGemmStridedBatchedEx, for
    C-contiguous stacks (..., rows, cols) with the same leading axes: gemm's types and
    arithmetic (float32 operands into float32, 16-bit ones into their own dtype or float32;
    CUBLAS_COMPUTE_32F, alpha 1, beta 0: each output a float32 sum rounded once), each
    matrix read in place at its offset (count x rows x cols elements apart), one launch for
    every (utterance, head) pair, on the compute stream."""
    if tuple(a.shape[:-2]) != tuple(out.shape[:-2]) or tuple(b.shape[:-2]) != tuple(
            out.shape[:-2]):
        raise ValueError(f"batched_matmul: stacks {a.shape}, {b.shape} into {out.shape}: "
                         f"expected the same leading axes")
    n, m = out.shape[-2], out.shape[-1]
    k = a.shape[-2] if trans_a else a.shape[-1]
    count, ldo, so = _batch_stride(out, "out")
    _, lda, sa = _batch_stride(a, "a")
    _, ldb, sb = _batch_stride(b, "b")
    if not (count and n and m):
        return
    if k == 0:
        fill(out, 0)
        return
    cublas, handle, types = _cublas()
    ctype, abtype = types[np.dtype(out.dtype)], types[np.dtype(a.dtype)]
    one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
    # row-major stacks are cuBLAS's column-major transposes: out^T = op(b)^T op(a)^T each
    cublas.gemmStridedBatchedEx(handle,
                                cublas.CUBLAS_OP_T if trans_b else cublas.CUBLAS_OP_N,
                                cublas.CUBLAS_OP_T if trans_a else cublas.CUBLAS_OP_N,
                                m, n, k, one.ctypes.data, _ptr(b), abtype, ldb, sb,
                                _ptr(a), abtype, lda, sa, zero.ctypes.data,
                                _ptr(out), ctype, ldo, so, count, cublas.CUBLAS_COMPUTE_32F,
                                cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP)


def norm2(a):
    """The 2-norm of a 1-D float array on either side, as a Python float (a device-to-host
    copy of one number: a sync point). GPU ranks: CuPy's reduction; the simulator: NumPy on
    the host memory behind the simulated array."""
    if not is_device(a):
        return float(np.sqrt(np.dot(a, a)))
    census.note_launch("cupy_norm", census.FILL_BLOCKS)
    census.COUNTS["syncs"] += 1
    if simulated():
        host = a._ary
        return float(np.sqrt(np.dot(host, host)))
    cp = cupy_module()
    return float(cp.linalg.norm(cp.asarray(a)))


def cupy_module():
    """CuPy, imported on first use (GPU ranks only). Numba's arrays live on the legacy default
    stream, as CuPy's work does, so CuPy need not synchronise when it wraps one (it would by
    default: a host sync per GEMM)."""
    import os
    os.environ.setdefault("CUPY_CUDA_ARRAY_INTERFACE_SYNC", "0")
    import cupy
    return cupy
