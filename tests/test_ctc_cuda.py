"""The CUDA CTC kernels (hpcsgd.model.kernels_ctc_cuda) against the CPU kernel and the float64
reference, under Numba's CUDA simulator in a child process (as tests/test_lstm_cuda.py; on a
real GPU with HPCSGD_TEST_GPU=1), and both kernels compiled for sm_80 and sm_90 by NVVM with
ptxas's spill report (no GPU needed).

Bounds (derived in tests/test_ctc_loss.py's docstring; u = 2^-24): each float32
implementation is within tol_loss of the exact loss and tol_grad of the exact gradient, its
exp and log counted at CUDA's 2 and 1 ulp; so CPU and CUDA differ by at most twice that.
16-bit storage: the kernel computes in float32 from the widened inputs and rounds only the
final scaled gradient, so its output equals the float32 kernel's result (run on the same
widened inputs) rounded once to the storage type, bit for bit; against the reference that
adds half an ulp of the storage: 2^-11 relative for float16 (plus 2^-25 where the scaled
value is subnormal: half the smallest subnormal's spacing 2^-24), 2^-8 for bfloat16.
"""
import os

import numpy as np
import pytest

from conftest import ptx_compiler, run_cuda_tests_in_child

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_ctc_cuda_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    def test_ctc_kernels_compile_for_sm80_and_sm90_without_spills(monkeypatch):
        """NVVM compiles both kernels with the argument types a float32, float16 and bfloat16
        model launches them with (the forward-only one: float32; its 16-bit loads are the
        gradient kernel's); ptxas (through nvJitLink, hpcsgd/bench/cuda.py) reports no
        register spills, and few enough registers for a block of MAX_THREADS. (Device
        functions compiled for sm_80 are reused for sm_90 in this process: bench cuda forks
        per target for exact cubin sizes; spills and registers are ptxas's per target.)"""
        cuda, types, bench_cuda = ptx_compiler(monkeypatch)
        from hpcsgd.model import kernels_ctc_cuda as KCC

        def arr(dtype, ndim=1):
            return types.Array(dtype, ndim, "C")
        index = (arr(types.int64), arr(types.int32), arr(types.int64))   # frames, ids, offsets
        sigs = []
        for dt in (types.float32, types.float16, types.uint16):
            sigs.append((KCC._ctc_grad_kernel, (arr(dt, 2), arr(dt, 2), types.int64, *index,
                                                types.float32, arr(types.int64),
                                                arr(types.float32), arr(types.float32),
                                                arr(types.float64), arr(types.uint8))))
        for cc in (80, 90):
            monkeypatch.setattr(bench_cuda._Target, "compute_capability", divmod(cc, 10))
            for kernel, sig in sigs:
                ptx, _ = cuda.compile_ptx(kernel.py_func, sig, cc=divmod(cc, 10))
                rep = bench_cuda.ptxas_report(ptx, cc)
                assert 0 < rep["registers"] <= 255 and rep["cubin_bytes"] > 0, rep
                assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (cc, sig, rep)
                # the largest block the wrappers accept must fit a block's 64K registers
                assert rep["registers"] * KCC.MAX_THREADS <= 65536, (cc, sig, rep)

else:
    from numba import cuda

    from hpcsgd.bfloat16 import bits as bf16_bits
    from hpcsgd.bfloat16 import values as bf16_values
    from hpcsgd.model import kernels_ctc as KC
    from hpcsgd.model import kernels_ctc_cuda as KCC
    from test_ctc_loss import batch, grad_tol, loss_tol

    def small_batch(seed=0, v=5):
        """Five sequences, T = 7: a repeat, a skip, an empty target, an infeasible one
        (4 frames < 3 + 2 repeats) and frames 0; padding on all but the first."""
        rng = np.random.default_rng(seed)
        targets = [[1, 2, 2], [3, 1, 4], [], [2, 2, 2], [1]]
        return batch(rng, [7, 6, 3, 4, 0], targets, v, t_max=7)

    def run_cuda(z, bias, nb, frames, ids, off, scale=1.0, threads=4):
        """The CUDA kernel on device copies: (gradient as stored, loss, feasible)."""
        ws = KC.workspace_offsets(frames, off)
        dev = [cuda.to_device(a) for a in (z, bias, frames, ids, off, ws)]
        alpha, beta = (cuda.to_device(np.full(ws[-1], np.nan, np.float32)) for _ in range(2))
        loss, feasible = cuda.to_device(np.full(nb, np.nan)), cuda.to_device(np.zeros(nb, np.uint8))
        KCC.ctc_loss_grad(dev[0], dev[1], nb, dev[2], dev[3], dev[4], scale, dev[5], alpha, beta,
                          loss, feasible, threads=threads)
        return dev[0].copy_to_host(), loss.copy_to_host(), feasible.copy_to_host()

    def run_cpu(z, bias, nb, frames, ids, off, scale=1.0):
        ws = KC.workspace_offsets(frames, off)
        g = z.copy()
        loss, feasible = np.zeros(nb), np.zeros(nb, np.uint8)
        KC.ctc_loss_grad(g, bias, nb, frames, ids, off, scale, ws, np.zeros(ws[-1], np.float32),
                         np.zeros(ws[-1], np.float32), loss, feasible)
        return g, loss, feasible

    def bounds(z, bias, nb, frames, off, ref_loss, scale=1.0):
        """Per sequence (tol_loss, tol_grad) of one float32 implementation."""
        v = z.shape[1]
        x_max = float(np.abs(z.astype(np.float64) + bias).max())
        out = []
        for b in range(nb):
            f, ns = int(frames[b]), int(2 * (off[b + 1] - off[b]) + 1)
            out.append((loss_tol(ref_loss[b], f, ns, x_max, v),
                        grad_tol(ref_loss[b], f, ns, x_max, v, scale)))
        return out

    def longer_batch():
        """Two sequences of 20 and 17 frames over 41 labels, 8 and 5 targets (17 and 11
        states: more than 16 threads), a repeat in the first."""
        rng = np.random.default_rng(5)
        targets = [[3, 7, 7, 12, 40, 1, 3, 9], [5, 6, 5, 2, 8]]
        return batch(rng, [20, 17], targets, 41, t_max=20)

    @pytest.mark.parametrize("case,threads", [("small", 4), ("small", 16), ("longer", 16)])
    def test_float32_equals_cpu_and_reference(case, threads):
        """threads = 4: the states (up to 7) and labels (5) strided over the block; 16: idle
        threads in the reductions; the longer case strides states and labels over 16."""
        z, bias, nb, frames, ids, off = small_batch() if case == "small" else longer_batch()
        g, loss, feasible = run_cuda(z, bias, nb, frames, ids, off, threads=threads)
        g_cpu, loss_cpu, feasible_cpu = run_cpu(z, bias, nb, frames, ids, off)
        ref_loss, ref_grad, ref_feasible = KC.ref_ctc(z, bias, nb, frames, ids, off)
        np.testing.assert_array_equal(feasible, ref_feasible.astype(np.uint8))
        np.testing.assert_array_equal(feasible, feasible_cpu)
        assert list(feasible) == ([1, 1, 1, 0, 0] if case == "small" else [1, 1])
        for b, (tl, tg) in enumerate(bounds(z, bias, nb, frames, off, ref_loss)):
            f = frames[b]
            rows = g[b::nb]
            if not feasible[b]:
                assert loss[b] == 0 and not rows.any()
                continue
            assert not rows[f:].any()                     # padding: exactly 0
            assert abs(loss[b] - ref_loss[b]) <= tl
            assert abs(loss[b] - loss_cpu[b]) <= 2 * tl
            assert np.abs(rows[:f] - ref_grad[b::nb][:f]).max() <= tg
            assert np.abs(rows[:f] - g_cpu[b::nb][:f]).max() <= 2 * tg

    def test_float16_storage_is_the_float32_result_rounded_once():
        z, bias, nb, frames, ids, off = small_batch(1)
        z16, b16 = z.astype(np.float16), bias.astype(np.float16)
        scale = 1024.0
        g16, loss16, _ = run_cuda(z16, b16, nb, frames, ids, off, scale)
        z32, b32 = z16.astype(np.float32), b16.astype(np.float32)   # the same values
        g32, loss32, _ = run_cuda(z32, b32, nb, frames, ids, off, scale)
        assert g16.dtype == np.float16
        np.testing.assert_array_equal(g16, g32.astype(np.float16))
        np.testing.assert_array_equal(loss16, loss32)
        ref_loss, ref_grad, _ = KC.ref_ctc(z32, b32, nb, frames, ids, off)
        for b, (tl, tg) in enumerate(bounds(z32, b32, nb, frames, off, ref_loss, scale)):
            want = scale * ref_grad[b::nb]
            err = np.abs(g16[b::nb].astype(np.float64) - want)
            assert (err <= tg * (1 + 2.0 ** -11) + 2.0 ** -11 * np.abs(want) + 2.0 ** -25).all()

    def test_bfloat16_storage_is_the_float32_result_rounded_once():
        z, bias, nb, frames, ids, off = small_batch(2)
        zb, bb = bf16_bits(z), bf16_bits(bias)                 # uint16 arrays of bfloat16 bits
        scale = 256.0
        gb, loss_b, _ = run_cuda(zb, bb, nb, frames, ids, off, scale)
        z32, b32 = bf16_values(zb), bf16_values(bb)
        g32, loss32, _ = run_cuda(z32, b32, nb, frames, ids, off, scale)
        assert gb.dtype == np.uint16
        np.testing.assert_array_equal(gb, bf16_bits(g32))
        np.testing.assert_array_equal(loss_b, loss32)
        ref_loss, ref_grad, _ = KC.ref_ctc(z32, b32, nb, frames, ids, off)
        for b, (tl, tg) in enumerate(bounds(z32, b32, nb, frames, off, ref_loss, scale)):
            want = scale * ref_grad[b::nb]
            err = np.abs(bf16_values(gb[b::nb]).astype(np.float64) - want)
            assert (err <= tg * (1 + 2.0 ** -8) + 2.0 ** -8 * np.abs(want)).all()
