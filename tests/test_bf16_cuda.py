"""GPU ranks' bf16 with bfloat16 storage (docs/precision.md: issue 45): activations, their
gradients, the LSTM workspaces, the weight copy w16 and the input copy x16 are uint16 device
arrays holding bfloat16 bits (NumPy and Numba have no bfloat16 dtype: it is float32's upper
half); the GEMMs take bfloat16 operands and accumulate in float32 (hpcsgd/device.py: matmul,
CUDA_R_16BF on a GPU); the kernels widen each load to float32 and round each store by
hpcsgd/half.py's rule (widen, stored). Run in Numba's CUDA simulator, in a child process (as
tests/test_mixed_cuda.py), and under `mpiexec -n 2`.

What is compared: the storage against the same GPU rank's float32-buffer emulation
(network.BF16_STORAGE = False; HPCSGD_BF16_STORAGE=0 in a whole run's environment). In the
simulator both round by the same integer rule and multiply by the same NumPy float32 GEMMs of
the same float32 values, so the step, and a whole training run, are equal bit for bit. On a
real GPU (HPCSGD_TEST_GPU=1) the bfloat16 GEMM's sums may run in another order than SGEMM's:
there the step is compared within 2^-5 of each matrix's norm instead (bfloat16's 8 bits,
L = 7 roundings: the bound of tests/test_mixed_cuda.py's docstring with 2^-8 for 2^-10).
"""
import os

import numpy as np
import pytest

from conftest import (CUDA_ENV, REAL_GPU, latest_arrays, make_archive, run_cuda_tests_in_child,
                      run_train, tiny_batch, tiny_gpu_run, tiny_model)

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"
TOL = 2.0 ** -5   # a real GPU only (module docstring)


if not CHILD:
    def test_bf16_cuda_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)   # the simulator, or a GPU with HPCSGD_TEST_GPU=1

    def test_the_environment_switches_a_process_to_the_emulation():
        """HPCSGD_BF16_STORAGE=0 (the run below gives it to its ranks): float32 buffers."""
        import subprocess
        import sys
        code = ("from hpcsgd.model import network as n; "
                "print(n.storage_dtype('bf16', 'cuda'), n.storage_dtype('mixed', 'cuda'))")
        for flag, want in (("0", "float32 float16"), ("1", "uint16 float16")):
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                 env=dict(os.environ, HPCSGD_BF16_STORAGE=flag), check=True)
            assert out.stdout.split() == want.split(), out

    def test_gpu_ranks_bf16_run_with_storage_equals_the_emulation(tmp_path):
        """2 GPU ranks (the simulator's), a tiny DNN, bf16: bfloat16 storage and the float32-
        buffer emulation (HPCSGD_BF16_STORAGE=0 in the ranks' environment) end on the same
        weights and optimizer state, bit for bit."""
        arch = str(tmp_path / "arch")
        make_archive(arch, num_shards=2, utts_per_shard=4, max_len=120)
        opts = tiny_gpu_run(arch, "optim.momentum_tc=100", "train.precision=bf16")
        runs = {}
        for storage in ("1", "0"):
            run = str(tmp_path / f"storage_{storage}")
            proc = run_train(2, opts + [f"train.run_dir={run}"], timeout=300,
                             env=dict(CUDA_ENV, HPCSGD_BF16_STORAGE=storage))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            runs[storage] = latest_arrays(run)
        assert set(runs["1"]) == set(runs["0"]) and "params" in runs["1"]
        for key in runs["1"]:
            if REAL_GPU:
                continue   # cuBLAS's bfloat16 GEMM against SGEMM: not bit for bit (docstring)
            np.testing.assert_array_equal(np.asarray(runs["1"][key]), np.asarray(runs["0"][key]),
                                          err_msg=key)

else:
    from numba import cuda

    from hpcsgd.bfloat16 import bits, values as value
    from hpcsgd.device import matmul
    from hpcsgd.model import kernels as K
    from hpcsgd.model import kernels_cuda as KC
    from hpcsgd.model import network

    def rb(v):
        """float32(bfloat16(v))."""
        return value(bits(v))

    def host(a):
        return a.copy_to_host() if hasattr(a, "copy_to_host") else np.array(a)

    def build(kind, device, storage=True, n=12):
        """tiny_model in bf16; storage=False: the float32-buffer emulation on GPU ranks."""
        network.BF16_STORAGE = storage
        try:
            return tiny_model(kind, device, "bf16", n)
        finally:
            network.BF16_STORAGE = True

    batch = tiny_batch

    def step(model, params_host, x, y):
        params, grads = model.new_params(), model.new_params()
        params.flat.copy_to_device(params_host)
        ce, correct = model.forward_backward(params, grads, x, y, len(y))
        bad, amax = model.unscale(grads, 1.0)
        return ce, correct, bad, amax, host(grads.flat)

    def init_params(kind):
        model = build(kind, "cpu")
        params = model.new_params()
        model.init(params, np.random.default_rng(1))
        return model, np.array(params.flat)

    KINDS = ["sigmoid", "relu", "blstm"]

    @pytest.mark.parametrize("kind", KINDS)
    def test_every_activation_buffer_is_bfloat16_bits_and_takes_half_the_bytes(kind):
        bf16 = build(kind, "cuda")
        emulated = build(kind, "cuda", storage=False)
        bufs = bf16.activation_buffers()
        assert {a.dtype for a in bufs.values()} == {np.dtype(np.uint16)}
        assert bf16.storage == np.uint16 and bf16.w16.flat.dtype == np.uint16
        assert bf16.new_params().flat.dtype == np.float32       # master, grads, state
        assert emulated.storage == np.float32
        assert {a.dtype for a in emulated.activation_buffers().values()} == {np.dtype(np.float32)}
        assert 2 * bf16.activation_bytes() == emulated.activation_bytes()
        assert network.storage_dtype("mixed", "cuda") == np.float16
        assert network.storage_dtype("bf16", "cpu") == np.float32

    @pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
    def test_matmul_of_bfloat16_is_a_float64_product_rounded_by_the_rule(trans_a, trans_b):
        """bfloat16 operands (uint16 bits): the product of their values, accumulated in float32
        (here within float32's rounding of a float64 reference: k = 9 terms), rounded once to
        bfloat16 by the rule; into a float32 out the float32 product. Values past float32's
        range round to Inf, a NaN operand gives NaN bits."""
        rng = np.random.default_rng(4)
        a = bits(rng.standard_normal((9, 7) if trans_a else (7, 9)) * 30)
        b = bits(rng.standard_normal((7, 9) if trans_b else (9, 7)) * 30)
        va, vb = value(a), value(b)
        ref = ((va.T if trans_a else va).astype(np.float64)
               @ (vb.T if trans_b else vb).astype(np.float64))
        for out_dtype in (np.uint16, np.float32):
            out = cuda.to_device(np.zeros(ref.shape, out_dtype))
            matmul(cuda.to_device(a), cuda.to_device(b), out, trans_a, trans_b)
            got = host(out)
            f32 = value(got) if out_dtype == np.uint16 else got
            np.testing.assert_allclose(f32, ref, rtol=2.0 ** -8 if out_dtype == np.uint16 else 1e-5)
            if out_dtype == np.uint16:   # the float32 accumulation rounded once by the rule
                want32 = np.matmul(va.T if trans_a else va, vb.T if trans_b else vb)
                np.testing.assert_array_equal(got, bits(want32))
                # and the float64 reference rounded by the rule: equal but where float32's
                # rounding of the sum crossed a bfloat16 tie (none for these values)
                np.testing.assert_array_equal(got, bits(ref))
        big = bits(np.full((2, 2), 3e38))
        out = cuda.to_device(np.zeros((2, 2), np.uint16))
        matmul(cuda.to_device(big), cuda.to_device(big), out)
        assert (host(out) == 0x7F80).all()   # +Inf
        with pytest.raises(TypeError, match="bfloat16"):
            matmul(cuda.to_device(a), cuda.to_device(b),
                   cuda.to_device(np.zeros((7, 7), np.float16)))

    @pytest.mark.parametrize("kind", [K.SIGMOID, K.RELU], ids=["sigmoid", "relu"])
    def test_bfloat16_act_kernels_equal_the_float32_kernels_rounded(kind):
        """Forward: f(z + b) on bfloat16 bits is the float32 kernel's value rounded by the
        rule; backward (the fused kernel): dz likewise, the bias gradient the float32 column
        sums before the rounding, bit for bit."""
        rng = np.random.default_rng(6)
        n, m = 37, 40
        z, b = rb(rng.standard_normal((n, m)) * 3), rb(rng.standard_normal((1, m)))
        d = rb(rng.standard_normal((n, m)))
        z32 = cuda.to_device(z)
        KC.bias_act_forward(z32, cuda.to_device(b), kind)
        z16 = cuda.to_device(bits(z))
        KC.bias_act_forward(z16, cuda.to_device(bits(b)), kind)
        h = rb(z32.copy_to_host())
        np.testing.assert_array_equal(value(z16.copy_to_host()), h)
        h32, gb32 = cuda.to_device(h), cuda.to_device(np.zeros((1, m), np.float32))
        KC.act_backward(h32, cuda.to_device(d), h32, gb32, kind)
        h16, gb16 = cuda.to_device(bits(h)), cuda.to_device(np.zeros((1, m), np.float32))
        KC.act_backward(h16, cuda.to_device(bits(d)), h16, gb16, kind)
        np.testing.assert_array_equal(h16.copy_to_host(), bits(h32.copy_to_host()))
        np.testing.assert_array_equal(gb16.copy_to_host(), gb32.copy_to_host())

    def test_a_kernel_store_keeps_nan_and_overflows_to_inf():
        """The store rule at its edges (hpcsgd/half.py: stored): a NaN stays a NaN, float32's
        largest values round to Inf, ties to even."""
        edge = np.array([[np.nan, 3.4e38, -3.4e38, 1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8,
                          np.inf, 0.0]], np.float32)
        z = cuda.to_device(np.zeros(edge.shape, np.uint16))
        KC.bias_act_forward(z, cuda.to_device(bits(np.zeros(edge.shape))), K.RELU)   # zeros
        assert not host(z).any()
        src = cuda.to_device(edge.reshape(-1))
        out = cuda.to_device(np.zeros(edge.size, np.uint16))
        from hpcsgd.half import round_bf16
        round_bf16(src, out)
        got = host(out)
        assert np.isnan(value(got[0])) and list(got[1:]) == [0x7F80, 0xFF80, 0x3F80, 0x3F82,
                                                             0x7F80, 0]
        np.testing.assert_array_equal(got, bits(edge.reshape(-1)))

    @pytest.mark.parametrize("kind", KINDS)
    def test_bfloat16_storage_equals_the_gpu_emulation_bit_for_bit(kind):
        _, params = init_params(kind)
        x, y = batch()
        bf16 = build(kind, "cuda")
        got = step(bf16, params, x, y)
        want = step(build(kind, "cuda", storage=False), params, x, y)
        assert bf16.storage == np.uint16
        if REAL_GPU:   # cuBLAS's bfloat16 GEMMs against SGEMM's (module docstring)
            assert got[1:3] == want[1:3] and abs(got[0] - want[0]) <= TOL * abs(want[0])
            assert np.linalg.norm(got[4] - want[4]) <= TOL * np.linalg.norm(want[4])
            return
        assert got[:4] == want[:4]
        np.testing.assert_array_equal(got[4], want[4])

    def test_inference_stays_float32_on_the_master_weights():
        """forward() of a bfloat16-storage model: float32 buffers of its own, the float32
        model's log-posteriors."""
        _, params = init_params("sigmoid")
        x, _ = batch()
        bf16 = build("sigmoid", "cuda")
        f32 = tiny_model("sigmoid", "cuda", "float32")
        p16, p32 = bf16.new_params(), f32.new_params()
        p16.flat.copy_to_device(params)
        p32.flat.copy_to_device(params)
        np.testing.assert_array_equal(bf16.forward(p16, x, 12).copy(), f32.forward(p32, x, 12))
