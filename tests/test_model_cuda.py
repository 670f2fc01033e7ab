"""CUDA DNN kernels (hpcsgd.model.kernels_cuda) against the NumPy references, and the CUDA
Optimizer against the CPU one, under the CUDA simulator.

NUMBA_ENABLE_CUDASIM must be set before numba is first imported, and other test modules
import numba earlier in the same process; so the parent test re-runs this file in a fresh
pytest process with the variable set (HPCSGD_CUDASIM_CHILD=1 selects the real tests there).
With HPCSGD_TEST_GPU=1 (tests/conftest.py) the child runs on the machine's GPU instead.
Inputs are tiny: the simulator runs every CUDA thread as a Python thread (a softmax row, one
128-thread block, costs ~0.2 s).
"""
import math
import os

import numpy as np
import pytest

from conftest import run_cuda_tests_in_child

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_cuda_model_kernels_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)   # the simulator, or a GPU with HPCSGD_TEST_GPU=1

else:
    from numba import cuda

    from hpcsgd.model import kernels as K
    from hpcsgd.device import fill
    from hpcsgd.model import kernels_cuda as KC
    from hpcsgd.optim import ADAGRAD_PLACES, Optimizer

    KINDS = {"sigmoid": K.SIGMOID, "relu": K.RELU}
    SHAPES = [(1, 1), (5, 7), (33, 40)]   # 33 rows > SUM_LANES, 40 columns > COL_TILE
    TOL = dict(rtol=1e-5, atol=1e-6)

    def close(dev, ref):
        np.testing.assert_allclose(dev.copy_to_host(), ref, **TOL)

    def inputs(shape, seed=0, scale=3.0):
        rng = np.random.default_rng(seed)
        n, m = shape
        z = (rng.standard_normal((n, m)) * scale).astype(np.float32)
        b = rng.standard_normal((1, m)).astype(np.float32)
        return rng, z, b

    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
    def test_bias_act_forward(shape, kind):
        _, z, b = inputs(shape)
        dz = cuda.to_device(z)
        KC.bias_act_forward(dz, cuda.to_device(b), kind)
        close(dz, K.ref_bias_act_forward(z, b, kind))

    @pytest.mark.parametrize("alias", [True, False], ids=["dz_is_h", "dz_separate"])
    @pytest.mark.parametrize("shape", SHAPES)
    @pytest.mark.parametrize("kind", KINDS.values(), ids=KINDS.keys())
    def test_act_backward(shape, kind, alias):
        rng, z, b = inputs(shape)
        h = K.ref_bias_act_forward(z, b, kind).astype(np.float32)
        h[0, 0] = 0.0                      # relu: the derivative at exactly 0 is 0
        d = rng.standard_normal(shape).astype(np.float32)
        hd = cuda.to_device(h)
        dz = hd if alias else cuda.to_device(np.full(shape, np.nan, np.float32))
        gb = cuda.to_device(np.full((1, shape[1]), np.nan, np.float32))
        KC.act_backward(hd, cuda.to_device(d), dz, gb, kind)
        ref_dz, ref_gb = K.ref_act_backward(h, d, kind)
        close(dz, ref_dz)
        close(gb, ref_gb)
        if not alias:
            np.testing.assert_array_equal(hd.copy_to_host(), h)

    def softmax_on_device(z, b, y):
        n, m = z.shape
        dz, gb = cuda.to_device(z), cuda.to_device(np.full((1, m), np.nan, np.float32))
        ce_rows = cuda.to_device(np.full(n + 3, np.nan))           # longer than N: allowed
        correct_rows = cuda.to_device(np.full(n + 3, 7, np.int32))
        ce, correct = KC.softmax_xent_backward(dz, cuda.to_device(b), cuda.to_device(y), gb,
                                               ce_rows, correct_rows)
        assert isinstance(ce, float) and isinstance(correct, int)
        return dz, gb, ce, correct

    def check_softmax(z, b, y):
        grad, gb_ref, ce_ref, correct_ref, logpost = K.ref_softmax_xent(z, b, y)
        dz, gb, ce, correct = softmax_on_device(z, b, y)
        close(dz, grad)
        close(gb, gb_ref)
        assert ce == pytest.approx(ce_ref, rel=1e-5)
        assert correct == correct_ref
        lp = cuda.to_device(z)
        KC.log_softmax_forward(lp, cuda.to_device(b))
        close(lp, logpost)
        KC.exp_inplace(lp)
        close(lp, np.exp(logpost))
        return ce, correct

    @pytest.mark.parametrize("shape", [(1, 1), (1, 7), (5, 40)])
    def test_softmax_xent_and_log_softmax(shape):
        rng, z, b = inputs(shape, seed=1)
        check_softmax(z, b, rng.integers(0, shape[1], shape[0]).astype(np.int32))

    def test_softmax_ties_and_underflow():
        """Rows of 300 columns (> ROW_THREADS = 128, so a thread holds several): argmax ties
        inside one thread (5, 133, 261) and across threads (70 and 200 in threads 70 and 72;
        60 and 130 in threads 60 and 2, the higher column in the earlier thread) go to the
        lowest index; a huge logit underflows the other posteriors, and the CE stays exact
        (log-sum-exp)."""
        m = 300
        z = np.zeros((5, m), np.float32)
        b = np.zeros((1, m), np.float32)
        z[0, [5, 133, 261]] = 4.0        # tie within thread 5: first is 5
        z[1, [200, 70]] = 4.0            # ties across threads: first is 70 ...
        z[2, [130, 60]] = 4.0            # ... and 60
        z[3, 17] = 1e4                   # exp(-1e4) = 0: the label's posterior underflows
        z[4, 250] = 1e4
        y = np.array([5, 70, 60, 0, 250], np.int32)
        ce, correct = check_softmax(z, b, y)
        assert correct == 4              # all but row 3
        # rows 0-2: logsumexp - 4; row 3: 1e4 - 0; row 4: 1e4 - 1e4
        expected = (math.log(m - 3 + 3 * math.exp(4)) - 4 + 2 * (math.log(m - 2 + 2 * math.exp(4)) - 4)
                    + 1e4)
        assert ce == pytest.approx(expected, abs=1e-4)

    def test_same_inputs_same_bytes():
        rng, z, b = inputs((4, 150), seed=2)
        y = rng.integers(0, 150, 4).astype(np.int32)
        d = rng.standard_normal(z.shape).astype(np.float32)
        runs = []
        for _ in range(2):
            dz, gb, ce, correct = softmax_on_device(z, b, y)
            h = cuda.to_device(z)
            KC.bias_act_forward(h, cuda.to_device(b), K.SIGMOID)
            gb2 = cuda.to_device(np.zeros_like(b))
            KC.act_backward(h, cuda.to_device(d), h, gb2, K.SIGMOID)
            runs.append([dz.copy_to_host().tobytes(), gb.copy_to_host().tobytes(),
                         np.float64(ce).tobytes(), correct, h.copy_to_host().tobytes(),
                         gb2.copy_to_host().tobytes()])
        assert runs[0] == runs[1]

    @pytest.mark.parametrize("shape,dtype", [((3, 5), np.float32), ((300,), np.float64),
                                             ((2, 2, 2), np.int32), ((0,), np.float32)])
    def test_fill(shape, dtype):
        a = cuda.to_device(np.ones(shape, dtype))
        fill(a, 0)
        np.testing.assert_array_equal(a.copy_to_host(), np.zeros(shape, dtype))
        fill(a, 3)
        np.testing.assert_array_equal(a.copy_to_host(), np.full(shape, 3, dtype))

    def test_column_sums_of_zero_rows():
        out = cuda.to_device(np.ones((1, 4), np.float32))
        KC.column_sums(cuda.device_array((0, 4), np.float32), out)
        np.testing.assert_array_equal(out.copy_to_host(), np.zeros((1, 4), np.float32))

    def test_wrappers_reject_host_arrays():
        z = np.zeros((2, 3), np.float32)
        with pytest.raises(TypeError, match="device arrays"):
            KC.bias_act_forward(z, np.zeros((1, 3), np.float32), K.RELU)

    # ---- mixed precision: the float16 kernels (hpcsgd/half.py) against the CPU's -------------

    def test_round_half_and_scale_cuda_equal_the_cpu():
        from hpcsgd import half
        rng = np.random.default_rng(3)
        v = np.concatenate([(rng.standard_normal(300) * 3e4).astype(np.float32),
                            np.float32([65520.0, 65519.0, 1e-8, -2.0 ** -25, np.inf])])
        want = np.empty_like(v)
        half.round_half(v, want)
        dev = cuda.to_device(v)
        out = cuda.to_device(np.zeros_like(v))
        half.round_half(dev, out)
        np.testing.assert_array_equal(out.copy_to_host(), want)
        half.scale(dev, 2.0 ** -7)
        np.testing.assert_array_equal(dev.copy_to_host(), v * np.float32(2.0 ** -7))

    @pytest.mark.parametrize("use_half", [True, False])
    def test_unscale_cuda_equals_the_cpu(use_half):
        from hpcsgd import half
        rng = np.random.default_rng(4)
        g = (rng.standard_normal(700) * 5e4).astype(np.float32)
        g[[3, 9]] = [np.nan, -np.inf]
        cpu = g.copy()
        want = half.unscale(cpu, 2.0 ** 9, use_half)
        dev = cuda.to_device(g)
        got = half.unscale(dev, 2.0 ** 9, use_half)
        assert got == want
        ok = np.isfinite(cpu)
        np.testing.assert_array_equal(dev.copy_to_host()[ok], cpu[ok])

    def test_a_mixed_gpu_model_gives_the_cpu_models_gradient():
        from hpcsgd.model.dnn import dnn
        rng = np.random.default_rng(5)
        x = rng.standard_normal((9, 6)).astype(np.float32)
        y = rng.integers(0, 3, 9).astype(np.int32)
        out = []
        for device in ("cpu", "cuda"):
            model = dnn(6, [5], 3, max_batch=9, device=device, precision="mixed")
            params, grads = model.new_params(), model.new_params()
            model.init(params, np.random.default_rng(1))
            ce, _ = model.forward_backward(params, grads, x, y, 9, loss_scale=2.0 ** 8)
            bad, amax = model.unscale(grads, 2.0 ** 8)
            flat = grads.flat if device == "cpu" else grads.flat.copy_to_host()
            out.append((ce, bad, flat))
        # float16 stores on both: the kernels' float32 results differ by rounding only
        # (TOL), which a float16 rounding can turn into one float16 ulp
        assert out[0][1] == out[1][1] == 0
        np.testing.assert_allclose(out[1][2], out[0][2], rtol=2.0 ** -9, atol=1e-6)
        assert abs(out[1][0] - out[0][0]) <= 1e-5 * abs(out[0][0])

    # ---- optimizer: CUDA path against the CPU path ------------------------------------------

    SIZE, STRIPES = 37, [(0, 20), (20, 20), (20, 37)]   # an empty stripe: nothing to launch
    OPT_CASES = [(p, T, wd) for p in ADAGRAD_PLACES for T in (0.0, 3000.0) for wd in (0.0, 1e-3)]
    OPT_CASES += [(a, 0.0, wd) for a in ("adam", "adam_local") for wd in (0.0, 1e-3)]

    def opt_pair(place, T, wd):
        kw = dict(momentum_time_constant=T, adagrad=place, adagrad_time_constant=5000.0,
                  weight_decay=wd)
        if place.startswith("adam"):   # Adam: its own moments, v at the owner or per rank
            kw.update(adagrad="off", kind="adam",
                      adam_variance="local" if place == "adam_local" else "owner")
        return Optimizer(SIZE, **kw), Optimizer(SIZE, device="cuda", **kw)

    def grads(seed):
        rng = np.random.default_rng(seed)
        out = []
        for n in (256, 512, 128):
            g = (rng.standard_normal(SIZE) * 0.01 * n).astype(np.float32)
            g[:3] = 0                    # parameters without a gradient (AdaGrad eps guard)
            out.append((g, n))
        return out

    def assert_state_close(cpu, gpu):
        for name in ("velocity", "sqr"):
            np.testing.assert_allclose(getattr(gpu, name).copy_to_host(), getattr(cpu, name),
                                       rtol=1e-5, atol=1e-7)
        assert gpu.sqr_weight == cpu.sqr_weight

    @pytest.mark.parametrize("place,T,wd", OPT_CASES, ids=[f"{p}-T{T:g}-wd{wd:g}"
                                                           for p, T, wd in OPT_CASES])
    def test_optimizer_cuda_matches_cpu(place, T, wd):
        w0 = np.random.default_rng(3).standard_normal(SIZE).astype(np.float32)
        # distributed composition: begin_step, pre_exchange, post_exchange per stripe, apply
        cpu, gpu = opt_pair(place, T, wd)
        w_cpu, w_gpu = w0.copy(), cuda.to_device(w0)
        for step, (g, n) in enumerate(grads(4)):
            lr = 1e-3 / (step + 1)
            g_gpu = cuda.to_device(g)
            for opt, w, gr in ((cpu, w_cpu, g), (gpu, w_gpu, g_gpu)):
                opt.begin_step(n, n // 2)
                opt.pre_exchange(gr)
                for lo, hi in STRIPES:
                    opt.post_exchange(gr, w, lo, hi)
                for lo, hi in STRIPES:
                    opt.apply(w, gr, lr, lo, hi)
            np.testing.assert_allclose(g_gpu.copy_to_host(), g, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(w_gpu.copy_to_host(), w_cpu, rtol=1e-5, atol=1e-7)
            assert_state_close(cpu, gpu)
        # single process: fused step()
        cpu, gpu = opt_pair(place, T, wd)
        w_cpu, w_gpu = w0.copy(), cuda.to_device(w0)
        for step, (g, n) in enumerate(grads(5)):
            g_gpu = cuda.to_device(g)
            cpu.step(w_cpu, g, 1e-3, n)
            gpu.step(w_gpu, g_gpu, 1e-3, n)
            np.testing.assert_allclose(g_gpu.copy_to_host(), g, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(w_gpu.copy_to_host(), w_cpu, rtol=1e-5, atol=1e-7)
            assert_state_close(cpu, gpu)
        assert not np.array_equal(w_cpu, w0)

    def test_optimizer_cuda_state_round_trip():
        rng = np.random.default_rng(6)
        opt = Optimizer(SIZE, 3000.0, "aggregate", device="cuda")
        state = opt.state_dict()
        assert state["velocity"] is opt.velocity and hasattr(state["sqr"], "copy_to_host")
        host = {"velocity": rng.standard_normal(SIZE).astype(np.float32),
                "sqr": rng.random(SIZE).astype(np.float32), "sqr_weight": 12.5}
        opt.load_state_dict(host)                        # from host arrays
        back = opt.host_state_dict()
        assert isinstance(back["velocity"], np.ndarray) and back["sqr_weight"] == 12.5
        np.testing.assert_array_equal(back["velocity"], host["velocity"])
        np.testing.assert_array_equal(back["sqr"], host["sqr"])
        back["sqr"][:] = 0                               # a copy, not a view
        np.testing.assert_array_equal(opt.sqr.copy_to_host(), host["sqr"])
        other = Optimizer(SIZE, 3000.0, "aggregate", device="cuda")
        other.load_state_dict(opt.state_dict())          # from device arrays
        np.testing.assert_array_equal(other.velocity.copy_to_host(), host["velocity"])
        assert other.velocity is not opt.velocity
        cpu = Optimizer(SIZE, 3000.0, "aggregate")
        cpu.load_state_dict(opt.host_state_dict())       # GPU checkpoint -> CPU optimizer
        np.testing.assert_array_equal(cpu.sqr, host["sqr"])
        with pytest.raises(ValueError, match="velocity: shape"):
            opt.load_state_dict(dict(host, velocity=np.zeros(SIZE + 1, np.float32)))
