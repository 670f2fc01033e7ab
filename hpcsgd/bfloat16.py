"""bfloat16 on NumPy arrays: the rounding rule's reference (hpcsgd/half.py's kernels are tested
against it) and the uint16 arrays that hold bfloat16's bits on GPU ranks (NumPy has no
bfloat16 dtype; a bfloat16 is a float32's upper 16 bits). NumPy only: hpcsgd/device.py's
simulated GEMM rounds its bfloat16 outputs here, below everything that launches a kernel.

    round_bf16_ref(src, dst)   dst = float32(bfloat16(src)), the rule on whole arrays
    bits(v)                    uint16 bits of bfloat16(v)
    values(b)                  float32 values of bfloat16 bits (exact)
"""
import numpy as np


def round_bf16_ref(src, dst):
    """dst = float32(bfloat16(src)) by the same rule on whole arrays (uint64: no wrap-around)."""
    b = np.ascontiguousarray(src, np.float32).view(np.uint32).astype(np.uint64)
    nan = (b & 0x7FFFFFFF) > 0x7F800000
    rounded = np.where(nan, b | 0x00400000, b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    dst[...] = rounded.astype(np.uint32).view(np.float32).reshape(np.shape(src))


def bits(v):
    """float values (rounded to float32 first) -> the uint16 bits of their bfloat16 rounding."""
    rounded = np.empty(np.shape(v), np.float32)
    round_bf16_ref(v, rounded)
    return (rounded.view(np.uint32) >> 16).astype(np.uint16)


def values(b):
    """bfloat16 bits (uint16) -> their float32 values: the bits shifted into the upper half."""
    return (np.asarray(b).astype(np.uint32) << 16).view(np.float32)
