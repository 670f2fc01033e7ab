"""The CUDA RNN-T kernel (hpcsgd.model.kernels_rnnt_cuda) against the CPU kernel and the float64
reference, under Numba's CUDA simulator in a child process (as tests/test_ctc_cuda.py; on a
real GPU with HPCSGD_TEST_GPU=1), and compiled for sm_80 and sm_90 by NVVM with ptxas's spill
report (no GPU needed).

Bounds: tests/test_rnnt_loss.py's docstring derives them (exp and log counted at CUDA's 2 and
1 ulp); each float32 implementation is within tol_loss of the exact loss and tol_grad of the
exact gradient, so CPU and CUDA differ by at most twice that.
"""
import os

import numpy as np
import pytest

from conftest import ptx_compiler, run_cuda_tests_in_child

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_rnnt_cuda_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    def test_rnnt_kernel_compiles_for_sm80_and_sm90_without_spills(monkeypatch):
        """NVVM compiles the kernel with the argument types the wrapper launches it with (the
        logits in float32, float16 and bfloat16 bits);
        ptxas (through nvJitLink, hpcsgd/bench/cuda.py) reports no register spills, and few
        enough registers for a block of MAX_THREADS."""
        cuda, types, bench_cuda = ptx_compiler(monkeypatch)
        from hpcsgd.model import kernels_rnnt_cuda as KRC

        def arr(dtype, ndim=1):
            return types.Array(dtype, ndim, "C")
        for z, cc in ((z, cc) for z in (types.float32, types.float16, types.uint16)
                      for cc in (80, 90)):   # float32 logits, float16 and bfloat16 storage
            sig = (arr(z, 2), arr(types.int64), arr(types.int32), arr(types.int64),
                   arr(types.int64), types.float32, arr(types.float32), arr(types.float32),
                   arr(types.float32), arr(types.float64), arr(types.uint8), types.float32)
            monkeypatch.setattr(bench_cuda._Target, "compute_capability", divmod(cc, 10))
            ptx, _ = cuda.compile_ptx(KRC._rnnt_grad_kernel.py_func, sig, cc=divmod(cc, 10))
            rep = bench_cuda.ptxas_report(ptx, cc)
            assert 0 < rep["registers"] <= 255 and rep["cubin_bytes"] > 0, rep
            assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (cc, rep)
            assert rep["registers"] * KRC.MAX_THREADS <= 65536, (cc, rep)

else:
    from numba import cuda

    from hpcsgd.model import kernels_rnnt as KR
    from hpcsgd.model import kernels_rnnt_cuda as KRC
    from test_rnnt_loss import batch, grad_tol, loss_tol, run_kernel

    def small_batch(seed=0, v=5):
        """Four utterances: 3 x 3 and 4 x 2 lattices, an empty target (skipped) and frames 0."""
        rng = np.random.default_rng(seed)
        return batch(rng, [3, 4, 2, 0], [[1, 2], [3], [], [2]], v)

    def longer_batch():
        """Two utterances of 9 and 6 frames over 23 labels, 7 and 3 targets (diagonals of up
        to 8 nodes and rows of 23: more than the 4 threads), a repeat in the first."""
        rng = np.random.default_rng(5)
        return batch(rng, [9, 6], [[3, 7, 7, 12, 22, 1, 3], [5, 6, 5]], 23)

    def run_cuda(z, frames, ids, off, rows, scale=1.0, lam=0.0, threads=4):
        """The CUDA kernel on device copies: (gradient, loss, feasible)."""
        dev = [cuda.to_device(a) for a in (z, frames, ids, off, rows)]
        alpha, beta = (cuda.to_device(np.full(rows[-1], np.nan, np.float32)) for _ in range(2))
        loss = cuda.to_device(np.full(len(frames), np.nan))
        feasible = cuda.to_device(np.zeros(len(frames), np.uint8))
        KRC.rnnt_loss_grad(*dev, scale, alpha, beta, loss, feasible, lam, threads=threads)
        return dev[0].copy_to_host(), loss.copy_to_host(), feasible.copy_to_host()

    @pytest.mark.parametrize("case,threads,lam,scale", [("small", 4, 0.0, 1.0),
                                                        ("small", 16, 0.3, 1.0),
                                                        ("longer", 4, 0.1, 64.0)])
    def test_equals_cpu_and_reference(case, threads, lam, scale):
        """threads = 4: diagonals and rows strided over the block; 16: idle threads in the
        wavefront and the reductions."""
        z, frames, ids, off, rows = small_batch() if case == "small" else longer_batch()
        g, loss, feasible = run_cuda(z, frames, ids, off, rows, scale, lam, threads)
        g_cpu, loss_cpu, feasible_cpu, *_ = run_kernel(z, frames, ids, off, rows, scale, lam)
        ref_loss, ref_grad, ref_feasible = KR.ref_rnnt(z, frames, ids, off, rows, lam)
        np.testing.assert_array_equal(feasible, ref_feasible.astype(np.uint8))
        np.testing.assert_array_equal(feasible, feasible_cpu)
        assert list(feasible) == ([1, 1, 0, 0] if case == "small" else [1, 1])
        x_max, v = float(np.abs(z).max()), z.shape[1]
        for b in range(len(frames)):
            mine = g[rows[b]:rows[b + 1]]
            if not feasible[b]:
                assert loss[b] == 0 and not mine.any()
                continue
            f, u = int(frames[b]), int(off[b + 1] - off[b])
            tl = loss_tol(ref_loss[b], f, u, x_max, v)
            tg = grad_tol(ref_loss[b], f, u, x_max, v, lam, scale)
            assert abs(loss[b] - ref_loss[b]) <= tl
            assert abs(loss[b] - loss_cpu[b]) <= 2 * tl
            assert np.abs(mine - scale * ref_grad[rows[b]:rows[b + 1]]).max() <= tg
            assert np.abs(mine - g_cpu[rows[b]:rows[b + 1]]).max() <= 2 * tg

    @pytest.mark.parametrize("storage", [np.float16, np.uint16])
    def test_16_bit_logits_give_the_float32_loss_of_their_values(storage):
        """GPU ranks' mixed precision and bf16: a 16-bit z (float16, or uint16 bfloat16 bits)
        is read widened and gets its gradient rounded once. Its losses equal the float32
        kernel's on the same 16-bit values held in float32 (the same float32 arithmetic), and
        its gradient is that kernel's gradient rounded to the format, bit for bit (the same
        float32 value, rounded once by the same rule)."""
        from hpcsgd import bfloat16, half
        z, frames, ids, off, rows = longer_batch()
        rounded = z.copy()
        half.round_to("float16" if storage == np.float16 else "bfloat16")(rounded, rounded)
        z16 = rounded.astype(np.float16) if storage == np.float16 else bfloat16.bits(rounded)
        g32, loss32, feasible32 = run_cuda(rounded, frames, ids, off, rows, 64.0, 0.1)
        g16, loss16, feasible16 = run_cuda(z16, frames, ids, off, rows, 64.0, 0.1)
        np.testing.assert_array_equal(feasible16, feasible32)
        np.testing.assert_array_equal(loss16, loss32)
        want = g32.copy()
        half.round_to("float16" if storage == np.float16 else "bfloat16")(want, want)
        got = g16.astype(np.float32) if storage == np.float16 else bfloat16.values(g16)
        np.testing.assert_array_equal(got, want)
