"""GPU ranks' mixed precision with float16 storage (docs/precision.md: issue 45): activations,
their gradients, the weight copy w16 and the input copy x16 are float16 device arrays, the
GEMMs take float16 operands and accumulate in float32 (hpcsgd/device.py: matmul), the
kernels compute in float32 on float16 arrays (hpcsgd/model/kernels_cuda.py). The CPU
emulation (float32 buffers holding float16 values, model/ops.py: HalfOps) stays the
reference; in Numba's CUDA simulator (re-run in a child process, as tests/test_model_cuda.py)
and under `mpiexec -n 2` with GPU ranks against CPU ranks.

What is compared, and how closely:
- the float16-storage step against the same GPU rank's float32-buffer emulation
  (network.FLOAT16_STORAGE = False): the same kernels and, in the simulator, the same NumPy
  GEMMs, so bit for bit -- every stored float16 is the float32 value the emulation rounds;
- against the CPU emulation: the GPU kernels differ from the CPU's in float32's last bits
  (CUDA's expf against the CPU's Cephes polynomial, float64 against float32 chunked sums), and
  a float32 difference of one ulp before a float16 rounding can flip that rounding by one
  float16 ulp (2^-10 of the value at most: 11 significant bits). A gradient element is a sum
  over products of stored values, each reached through L such roundings (DNN 6-5-3: x16 and
  w16 are equal bit for bit, then z1, h1, z2, the loss gradient, dx, dz1 and the weight
  gradient's own rounding in unscale: L = 7), so to first order it moves by at most
  L 2^-10 of the sum of its terms' magnitudes; in the 2-norm over a matrix, where signs mix,
  by at most L 2^-10 = 2^-7.2 of the matrix's norm: the tolerance is 2^-7 of each matrix's
  norm (and of the cross-entropy). A lost or doubled contribution, a missed rounding or a
  double one (float16 of float16 of a float64) is far larger; in the simulator the two
  usually agree bit for bit (not assumed).
- loss-scale decisions (skips, the scale) are equal exactly: a Backoff scaler starting at
  2^24 overflows float16 (S |softmax - onehot| > 65504) and backs off, step by step, on both.
"""
import json
import os

import numpy as np
import pytest

from conftest import (CUDA_ENV, latest_arrays, make_archive, run_cuda_tests_in_child, run_train,
                      tiny_batch, tiny_model)

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"
TOL = 2.0 ** -7   # of a matrix's 2-norm: L = 7 float16 roundings of 2^-10 (module docstring)


def close_by_matrix(got, want, names_views, tol=TOL):
    """Each parameter matrix of flat `got` within tol of flat `want`'s, in the 2-norm."""
    for name, (lo, hi) in names_views.items():
        g, w = got[lo:hi].astype(np.float64), want[lo:hi].astype(np.float64)
        assert np.linalg.norm(g - w) <= tol * np.linalg.norm(w) + 1e-30, (
            name, np.linalg.norm(g - w), np.linalg.norm(w))


if not CHILD:
    def test_mixed_cuda_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)   # the simulator, or a GPU with HPCSGD_TEST_GPU=1

    @pytest.fixture(scope="module")
    def arch(tmp_path_factory):
        out = str(tmp_path_factory.mktemp("mixed_archive"))
        make_archive(out, num_shards=2, utts_per_shard=4, max_len=120)
        return out

    def options(arch, run_dir, *extra):
        """A tiny model; a Backoff scaler from 2^19: the first steps overflow float16 and are
        skipped, then it trains; a window of 3 doubles the scale again (another overflow)."""
        return [f"data.train={arch}", "data.context=1", "model.hidden=[8]",
                "train.minibatch=16", "train.epochs=1", "train.stop_after_frames=224",
                "data.block_frames=100", "data.buffer_frames=400",
                "train.log_every_frames=1000", "optim.lr=0.01", "optim.momentum_tc=100",
                "schedule.type=constant", "train.check_every_steps=1",
                "train.precision=mixed", "train.loss_scale=backoff",
                "train.loss_scale_init=524288", "train.loss_scale_window=3",
                f"train.run_dir={run_dir}", *extra]

    def skips(run_dir):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [(r["frames"], r["scale"], r["new_scale"]) for r in map(json.loads, f)
                    if r.get("kind") == "skip"]

    def test_gpu_ranks_mixed_run_equals_cpu_ranks(arch, tmp_path):
        """2 GPU ranks (float16 storage, simulator) and 2 CPU ranks (the emulation), the same
        run: the same skipped steps and scales, and every weight matrix within TOL of the
        CPU run's total update (the module docstring: a step's gradient within L float16
        ulps, summed by the optimizer over the steps)."""
        runs = {}
        for device, env in (("cpu", {}), ("cuda", CUDA_ENV)):
            run_dir = str(tmp_path / device)
            proc = run_train(2, options(arch, run_dir, f"train.device={device}"), timeout=600,
                             env=env)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            runs[device] = (skips(run_dir), latest_arrays(run_dir))
        (cpu_skips, cpu), (gpu_skips, gpu) = runs["cpu"], runs["cuda"]
        assert cpu_skips and cpu_skips == gpu_skips, (cpu_skips, gpu_skips)
        assert gpu_skips[0][1] == 524288.0 and len({s for _, s, _ in gpu_skips}) >= 2
        # the start: the config's init (train.seed 0) of the model 4 x 3 frames - 8 - 5
        from hpcsgd.model.dnn import dnn
        start = dnn(12, [8], 5, "sigmoid", max_batch=1).new_params()
        dnn(12, [8], 5, "sigmoid", max_batch=1).init(start, np.random.default_rng(0))
        start = start.flat.astype(np.float64)
        got, want = gpu["params"].astype(np.float64), cpu["params"].astype(np.float64)
        assert got.shape == want.shape == start.shape
        moved = np.linalg.norm(want - start)
        assert moved > 0
        assert np.linalg.norm(got - want) <= TOL * moved, (np.linalg.norm(got - want), moved)

else:
    from numba import cuda

    from hpcsgd.device import matmul
    from hpcsgd.loss_scale import Backoff
    from hpcsgd.model import kernels as K
    from hpcsgd.model import kernels_cuda as KC
    from hpcsgd.model import network

    def r16(a):
        """The float32 values of float16(a) (round to nearest even; Inf past 65504)."""
        with np.errstate(over="ignore"):
            return np.asarray(a, np.float32).astype(np.float16).astype(np.float32)

    def host(a):
        return a.copy_to_host() if hasattr(a, "copy_to_host") else np.array(a)

    def build(kind, device, storage=True, n=12):
        """tiny_model in mixed; storage=False: the float32-buffer emulation on GPU ranks."""
        network.FLOAT16_STORAGE = storage
        try:
            return tiny_model(kind, device, "mixed", n)
        finally:
            network.FLOAT16_STORAGE = True

    batch = tiny_batch

    def step(model, params_host, scale, x, y):
        params, grads = model.new_params(), model.new_params()
        if model.device == "cpu":
            params.flat[...] = params_host
        else:
            params.flat.copy_to_device(params_host)
        ce, correct = model.forward_backward(params, grads, x, y, len(y), loss_scale=scale)
        bad, amax = model.unscale(grads, scale)
        return ce, correct, bad, amax, host(grads.flat)

    def init_params(kind):
        model = build(kind, "cpu")
        params = model.new_params()
        model.init(params, np.random.default_rng(1))
        return model, np.array(params.flat)

    KINDS = ["sigmoid", "relu", "blstm"]

    # ---- storage: what is float16, and the bytes ------------------------------------------

    @pytest.mark.parametrize("kind", KINDS)
    def test_every_activation_buffer_is_float16_and_takes_half_the_bytes(kind):
        mixed = build(kind, "cuda")
        f32 = tiny_model(kind, "cuda", "float32")
        bufs = mixed.activation_buffers()
        assert {a.dtype for a in bufs.values()} == {np.dtype(np.float16)}
        assert mixed.w16.flat.dtype == np.float16 and mixed.storage == np.float16
        assert mixed.new_params().flat.dtype == np.float32       # master, grads, state
        assert mixed.x_in.dtype == np.float32                    # host frames' staging
        # the float32 model's activations, delta and workspaces: exactly twice the bytes
        # of the same buffers in float16 (x16 is mixed's own)
        x16 = bufs["x16"].size * 2
        assert mixed.activation_bytes() - x16 == f32.activation_bytes() // 2
        assert mixed.activation_bytes(6) == mixed.activation_bytes() // 2
        cpu = build(kind, "cpu")
        assert cpu.storage == np.float32 and cpu.activation_bytes() == 2 * mixed.activation_bytes()

    # ---- the GEMM: float16 operands, float32 accumulation, one rounding --------------------

    @pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True)])
    def test_matmul_of_float16_rounds_a_float32_product_once(trans_a, trans_b):
        """float16 operands (stored transposed where asked) into a float16 out: the float32
        product of the widened operands rounded once (not a float16 accumulation: the
        operands' products and sums are not float16 values); into a float32 out (the weight
        gradients): that float32 product."""
        rng = np.random.default_rng(4)
        a = r16(rng.standard_normal((9, 7) if trans_a else (7, 9)) * 30)
        b = r16(rng.standard_normal((7, 9) if trans_b else (9, 7)) * 30)
        want32 = np.matmul(a.T if trans_a else a, b.T if trans_b else b)
        for out_dtype, want in ((np.float16, r16(want32)), (np.float32, want32)):
            out = cuda.to_device(np.full(want.shape, np.nan, out_dtype))
            matmul(cuda.to_device(a.astype(np.float16)), cuda.to_device(b.astype(np.float16)),
                   out, trans_a, trans_b)
            np.testing.assert_array_equal(out.copy_to_host().astype(np.float32), want)
        a, b = r16(a * 10), r16(b * 10)   # products past 65504: Inf, as cuBLAS stores them
        want = r16(np.matmul(a.T if trans_a else a, b.T if trans_b else b))
        assert np.isinf(want).any() and np.isfinite(want).any()
        out = cuda.to_device(np.zeros(want.shape, np.float16))
        matmul(cuda.to_device(a.astype(np.float16)), cuda.to_device(b.astype(np.float16)),
               out, trans_a, trans_b)
        np.testing.assert_array_equal(out.copy_to_host().astype(np.float32), want)

    def test_matmul_of_a_strided_float16_view():
        """The BLSTM's GEMMs read one direction's columns of the gate rows."""
        rng = np.random.default_rng(5)
        gates = r16(rng.standard_normal((6, 8)))
        u = r16(rng.standard_normal((2, 4)))
        dev = cuda.to_device(gates.astype(np.float16))
        out = cuda.to_device(np.zeros((6, 2), np.float16))
        matmul(dev[:, 4:], cuda.to_device(u.astype(np.float16)), out, trans_b=True)
        np.testing.assert_array_equal(out.copy_to_host().astype(np.float32),
                                      r16(gates[:, 4:] @ u.T))
        with pytest.raises(TypeError, match="float16 operands"):
            matmul(dev, cuda.to_device(u), cuda.to_device(np.zeros((6, 4), np.float32)))

    # ---- the kernels: float16 arrays, float32 arithmetic -----------------------------------

    @pytest.mark.parametrize("kind", [K.SIGMOID, K.RELU], ids=["sigmoid", "relu"])
    def test_float16_act_kernels_equal_the_float32_kernels_rounded(kind):
        """Forward: f(z + b) of float16 z and b is the float32 kernel's value rounded. Backward
        (the fused kernel): dz the float32 kernel's rounded, the bias gradient its float32
        column sums of dz before the rounding (the emulation's), bit for bit (the same
        float64 sums in the same order)."""
        rng = np.random.default_rng(6)
        n, m = 37, 40   # more rows than SUM_LANES, more columns than COL_TILE
        z, b = r16(rng.standard_normal((n, m)) * 3), r16(rng.standard_normal((1, m)))
        d = r16(rng.standard_normal((n, m)))
        z32 = cuda.to_device(z)
        KC.bias_act_forward(z32, cuda.to_device(b), kind)
        z16 = cuda.to_device(z.astype(np.float16))
        KC.bias_act_forward(z16, cuda.to_device(b.astype(np.float16)), kind)
        h = r16(z32.copy_to_host())
        np.testing.assert_array_equal(z16.copy_to_host().astype(np.float32), h)
        h32, gb32 = cuda.to_device(h), cuda.to_device(np.zeros((1, m), np.float32))
        KC.act_backward(h32, cuda.to_device(d), h32, gb32, kind)
        h16, gb16 = cuda.to_device(h.astype(np.float16)), cuda.to_device(np.zeros((1, m),
                                                                                  np.float32))
        KC.act_backward(h16, cuda.to_device(d.astype(np.float16)), h16, gb16, kind)
        np.testing.assert_array_equal(h16.copy_to_host().astype(np.float32),
                                      r16(h32.copy_to_host()))
        np.testing.assert_array_equal(gb16.copy_to_host(), gb32.copy_to_host())

    def test_float16_softmax_stores_the_scaled_gradient_rounded_once():
        """The float16 logits' loss gradient is the float32 kernel's times the scale, rounded
        once (2^12: some values past 65504 become Inf, as the emulation's); the bias gradient
        the float32 column sums before it; CE and hits the same; a masked row all zero."""
        rng = np.random.default_rng(7)
        n, m = 19, 37
        z, b = r16(rng.standard_normal((n, m)) * 4), r16(rng.standard_normal((1, m)))
        y = rng.integers(0, m, n).astype(np.int32)
        y[[2, 5]] = -1
        scale = 2.0 ** 12
        outs = []
        for dtype in (np.float32, np.float16):
            dz = cuda.to_device(z.astype(dtype))
            gb = cuda.to_device(np.zeros((1, m), np.float32))
            stats = cuda.to_device(np.zeros((n, 2), np.float32))
            ce, hits = KC.softmax_xent_backward(dz, cuda.to_device(b.astype(dtype)),
                                                cuda.to_device(y), gb,
                                                cuda.to_device(np.zeros(n)),
                                                cuda.to_device(np.zeros(n, np.int32)),
                                                stats, scale)
            outs.append((dz.copy_to_host().astype(np.float32), gb.copy_to_host(), ce, hits))
        (g32, gb32, ce32, hits32), (g16, gb16, ce16, hits16) = outs
        np.testing.assert_array_equal(g16, r16(g32 * np.float32(scale)))   # float32 unscaled
        np.testing.assert_array_equal(gb16, gb32)
        assert (ce16, hits16) == (ce32, hits32)
        assert not g16[[2, 5]].any()

    # ---- a model's step: the float16 storage against the emulations -----------------------

    @pytest.mark.parametrize("scale", [1.0, 2.0 ** 10])
    @pytest.mark.parametrize("kind", KINDS)
    def test_float16_storage_equals_the_gpu_emulation_bit_for_bit(kind, scale):
        _, params = init_params(kind)
        x, y = batch()
        got = step(build(kind, "cuda"), params, scale, x, y)
        want = step(build(kind, "cuda", storage=False), params, scale, x, y)
        assert got[:4] == want[:4]
        np.testing.assert_array_equal(got[4], want[4])

    @pytest.mark.parametrize("kind", KINDS)
    def test_float16_storage_equals_the_cpu_emulation_within_float16_flips(kind):
        """The CPU emulation is the reference: the same w16 and x16 bit for bit, the same
        overflow vote, every matrix's gradient and the CE within TOL (module docstring)."""
        cpu_model, params = init_params(kind)
        x, y = batch()
        gpu_model = build(kind, "cuda")
        got = step(gpu_model, params, 2.0 ** 10, x, y)
        want = step(cpu_model, params, 2.0 ** 10, x, y)
        np.testing.assert_array_equal(host(gpu_model.w16.flat).astype(np.float32),
                                      cpu_model.w16.flat)
        np.testing.assert_array_equal(host(gpu_model.x16)[:len(y)].astype(np.float32),
                                      cpu_model.x16[:len(y)])
        assert got[2] == want[2] == 0 and got[1] == want[1]
        assert abs(got[0] - want[0]) <= TOL * abs(want[0])
        views = {m.name: (m.offset, m.offset + m.size) for m in cpu_model.new_params().matrices}
        close_by_matrix(got[4], want[4], views)

    def test_inference_stays_float32_on_the_master_weights():
        """forward() of a float16-storage model: float32 buffers of its own, the float32
        model's log-posteriors (cross-validation and eval are float32 on every rank)."""
        model, params = init_params("sigmoid")
        x, _ = batch()
        gpu = build("sigmoid", "cuda")
        f32 = tiny_model("sigmoid", "cuda", "float32")
        outs = []
        for m in (gpu, f32):
            p = m.new_params()
            p.flat.copy_to_device(params)
            outs.append(np.array(m.forward(p, x, len(x))))
        np.testing.assert_array_equal(outs[0], outs[1])
        assert {a.dtype for a in gpu.activation_buffers().values()} == {np.dtype(np.float16)}

    def test_loss_scale_decisions_are_the_cpus(tmp_path):
        """A Backoff scaler from 2^24 on both: S |softmax - onehot| overflows float16 until S
        is small enough, each overflow a skipped step and a halving; then a window of 2
        doubles S again. The same skips and scales step by step on the GPU (float16
        storage) as on the CPU emulation, and the weights within TOL after the run."""
        from hpcsgd.comm.exchange import Allreduce
        from hpcsgd.optim import Optimizer
        from hpcsgd.step import Step, gradient_buffers
        from mpi4py import MPI
        _, init = init_params("sigmoid")
        x, y = batch(n=12, seed=8)
        y[1] = 0
        history, weights = {}, {}
        for device in ("cpu", "cuda"):
            model = build("sigmoid", device)
            params = model.new_params()
            if device == "cpu":
                params.flat[...] = init
            else:
                params.flat.copy_to_device(init)
            scaler = Backoff(2.0 ** 24, 1.0, 2.0 ** 24, 2)
            ex = Allreduce(MPI.COMM_SELF, params.size, "float32", device=device)
            st = Step(model, params, gradient_buffers(model, False),
                      Optimizer(params.size, device=device), ex, device=device, scaler=scaler)
            seen = []
            for _ in range(14):
                st.run(lambda k: (x[:k], y[:k]), np.array([len(y)]), 0, 1e-2)
                seen.append((scaler.scale, scaler.skipped))
            history[device], weights[device] = seen, host(params.flat)
        assert history["cpu"] == history["cuda"]
        assert history["cpu"][-1][1] >= 5          # the overflows happened and were skipped
        assert len({s for s, _ in history["cpu"]}) >= 3   # halvings and a doubling
        moved = np.linalg.norm(weights["cpu"].astype(np.float64) - init)
        assert moved > 0
        assert np.linalg.norm(weights["cuda"].astype(np.float64) - weights["cpu"]) <= TOL * moved
