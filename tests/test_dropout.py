"""Dropout between the encoder's layers (hpcsgd.model.kernels_dropout, its CUDA twin in
kernels_cuda, Network.set_dropout): the CPU kernel against the NumPy reference bit for bit,
the mask's statistics, the mask a function of the utterance and the position (a padded batch is
its utterances alone), the model's gradient by central differences, inference untouched; the
CUDA kernel in the simulator (child process; a GPU with HPCSGD_TEST_GPU=1) bit for bit the
CPU's, 16-bit storage the float32 result rounded once, and compiled for sm_80 and sm_90.

The product x * scale is one float32 multiplication in every implementation, so they agree
exactly; the statistical checks use binomial bounds at 6 standard deviations (a failure by
chance: about 1e-9)."""
import math
import os

import numpy as np
import pytest

from conftest import ptx_compiler, run_cuda_tests_in_child
from hpcsgd.model import kernels_dropout as KD

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"


def case(seed, steps=13, nb=5, m=37):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * nb, m)).astype(np.float32)
    return x, KD.utterance_keys(seed, 2, rng.choice(1000, nb, replace=False))


if not CHILD:
    from hpcsgd.data.utterances import Targets
    from hpcsgd.model import build

    @pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
    def test_cpu_kernel_equals_the_reference_in_place_or_not(p):
        x, keys = case(1)
        want = KD.ref_drop(x, keys, 5, 3, p)
        out = np.full_like(x, np.nan)
        KD.drop(x, out, keys, 5, 3, KD.threshold_of(p), KD.scale_of(p))
        np.testing.assert_array_equal(out, want)
        inplace = x.copy()
        KD.drop(inplace, inplace, keys, 5, 3, KD.threshold_of(p), KD.scale_of(p))
        np.testing.assert_array_equal(inplace, want)
        if p == 0:
            np.testing.assert_array_equal(out, x)   # scale 1, nothing dropped

    def test_the_mask_keeps_1_minus_p_and_its_draws_are_independent():
        """Over 2M elements the kept share is within 6 sigma of 1 - p; two layers' masks (or
        two epochs') agree where independent masks would, p^2 + (1 - p)^2; neighbouring
        steps, channels and utterances are not correlated either."""
        p, steps, nb, m = 0.3, 400, 10, 512
        keys = KD.utterance_keys(0, 0, np.arange(nb))
        masks = [KD.ref_mask(steps * nb, m, k, nb, salt, p)
                 for k, salt in ((keys, 1), (keys, 2), (KD.utterance_keys(0, 1, np.arange(nb)), 1))]
        n = masks[0].size
        assert abs(masks[0].mean() - (1 - p)) <= 6 * math.sqrt(p * (1 - p) / n)
        agree = p * p + (1 - p) ** 2
        bound = 6 * math.sqrt(agree * (1 - agree) / n)
        for other in masks[1:]:
            assert abs(np.mean(masks[0] == other) - agree) <= bound
        grid = masks[0].reshape(steps, nb, m)
        for a, b in ((grid[1:], grid[:-1]), (grid[:, 1:], grid[:, :-1]),
                     (grid[:, :, 1:], grid[:, :, :-1])):
            assert abs(np.mean(a == b) - agree) <= 6 * math.sqrt(agree * (1 - agree) / a.size)

    def test_keys_are_a_function_of_seed_epoch_and_utterance():
        a = KD.utterance_keys(1, 3, np.array([4, 9, 4]))
        assert a[0] == a[2] != a[1]
        assert KD.utterance_keys(1, 3, [9])[0] == a[1]
        assert KD.utterance_keys(2, 3, [4])[0] != a[0] != KD.utterance_keys(1, 4, [4])[0]
        assert a.dtype == np.uint64

    def test_the_mask_follows_the_utterance_not_the_row():
        """The same utterance alone (nb = 1) and third of a padded batch of five: the same
        mask on its valid steps, so it does not matter where the loader deals it."""
        x, keys = case(4)
        steps, nb = 13, 5
        padded = KD.ref_drop(x, keys, nb, 2, 0.4).reshape(steps, nb, -1)
        alone = KD.ref_drop(x.reshape(steps, nb, -1)[:, 2], keys[2:3], 1, 2, 0.4)
        np.testing.assert_array_equal(padded[:, 2], alone)

    def test_bits_do_not_depend_on_threads():
        import numba
        x, keys = case(5, steps=101)
        out = []
        for threads in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(threads)
            try:
                y = np.empty_like(x)
                KD.drop(x, y, keys, 5, 1, KD.threshold_of(0.2), KD.scale_of(0.2))
                out.append(y)
            finally:
                numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
        np.testing.assert_array_equal(*out)

    # ---- the model --------------------------------------------------------------------------

    ENCODER = ["stack 2", "blstm 3", "conv 5 k3"]

    def ctc_net(p, dtype=np.float64, encoder=ENCODER):
        net = build({"type": "ctc", "input_dim": 4, "encoder": encoder, "num_tokens": 6,
                     "activation": "sigmoid"}, max_batch=64, dtype=dtype)
        net.set_dropout(p)
        return net

    def batch(rng, frames, dtype=np.float64, utts=(5, 9, 11)):
        nb, steps = len(frames), int(frames[0])
        x = np.zeros((steps, nb, 4), dtype)
        for b, f in enumerate(frames):
            x[:f, b] = rng.standard_normal((f, 4))
        counts = [2, 1, 1][:nb]
        ids = np.array([1, 2, 2, 5][:sum(counts)], np.int32)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        keys = KD.utterance_keys(1, 0, np.array(utts[:nb]))
        return x.reshape(-1, 4), Targets(np.array(frames, np.int64), ids, offsets, keys)

    def test_dropped_layers_are_the_encoders_but_frame_stacking():
        net = ctc_net(0.3)
        assert [d is not None for d in net.dropped] == [False, True, True, False]
        assert "dropped1" in net.activation_buffers()
        with pytest.raises(ValueError, match="whole utterances"):
            build({"type": "dnn", "input_dim": 4, "hidden": [3], "num_labels": 2}).set_dropout(0.1)

    def test_gradient_by_central_differences():
        """float64 model, sigmoid units, p = 0.3: the gradient with the masks applied in the
        backward pass against a central difference of the loss with the same masks. The CTC
        kernel computes in float32 (its exp and recursions), so the step is 1e-2: truncation
        about 1e-4 relative, the loss's float32 rounding 1e-7 / 1e-2; a backward pass that
        missed or misplaced a mask is off by O(1)."""
        rng = np.random.default_rng(0)
        net = ctc_net(0.3)
        params, grads = net.new_params(), net.new_params()
        net.init(params, rng)
        x, y = batch(rng, [9, 7, 4])
        net.forward_backward(params, grads, x, y, len(x))
        want = grads.flat.copy()
        checked = 0
        for k in rng.choice(params.size, 40, replace=False):
            old = params.flat[k]
            losses = []
            for step in (1e-2, -1e-2):
                params.flat[k] = old + step
                losses.append(net.forward_backward(params, grads, x, y, len(x))[0])
            params.flat[k] = old
            num = (losses[0] - losses[1]) / 2e-2
            assert abs(want[k] - num) <= 1e-2 * max(abs(num), 1e-2), (k, want[k], num)
            checked += abs(num) > 1e-3
        assert checked >= 20
        off = ctc_net(0.0)
        off.forward_backward(params, grads, x, y, len(x))
        assert np.max(np.abs(grads.flat - want)) > 0.1 * np.max(np.abs(want))

    def test_a_padded_batch_is_its_utterances_alone_and_inference_does_not_drop():
        """float64: the loss and gradient of three utterances padded together equal the sums
        of each alone (its key with it) to 1e-12; forward() gives the same posteriors with and
        without dropout set."""
        rng = np.random.default_rng(3)
        net = ctc_net(0.4)
        params = net.new_params()
        net.init(params, rng)
        frames = [9, 7, 4]
        x, y = batch(rng, frames)
        grads = net.new_params()
        loss, _ = net.forward_backward(params, grads, x, y, len(x))
        xt = x.reshape(9, 3, 4)
        alone_loss, alone_grad = 0.0, np.zeros(params.size)
        for b, f in enumerate(frames):
            ids = y.ids[y.offsets[b]:y.offsets[b + 1]]
            t = Targets(np.array([f]), ids, np.array([0, len(ids)]), y.keys[b:b + 1])
            g = net.new_params()
            alone_loss += net.forward_backward(params, g, np.ascontiguousarray(xt[:f, b]), t,
                                               f)[0]
            alone_grad += g.flat
        assert abs(loss - alone_loss) <= 1e-12 * abs(loss)
        np.testing.assert_allclose(grads.flat, alone_grad, rtol=1e-10, atol=1e-12)
        plain = ctc_net(0.0)
        out = net.forward(params, x, len(x), lengths=y.frames).copy()
        np.testing.assert_array_equal(out, plain.forward(params, x, len(x), lengths=y.frames))

    def test_a_training_pass_needs_the_keys():
        rng = np.random.default_rng(1)
        net = ctc_net(0.2, np.float32)
        params = net.new_params()
        net.init(params, rng)
        x, y = batch(rng, [6, 5], np.float32)
        with pytest.raises(ValueError, match="no utterance keys"):
            net.forward_backward(params, net.new_params(), x, y._replace(keys=None), len(x))

    def test_dropout_cuda_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    def test_dropout_kernel_compiles_for_sm80_and_sm90(monkeypatch):
        """NVVM compiles the kernel with float32, float16 and bfloat16 (uint16) arrays; ptxas
        reports no spills."""
        cuda, types, bench_cuda = ptx_compiler(monkeypatch)
        from hpcsgd.model import kernels_cuda as KC
        keys = types.Array(types.uint64, 1, "C")
        sigs = [(types.Array(dt, 2, "C"), types.Array(dt, 2, "C"), keys, types.int64,
                 types.int64, types.int64, types.float32)
                for dt in (types.float32, types.float16, types.uint16)]
        for cc in (80, 90):
            monkeypatch.setattr(bench_cuda._Target, "compute_capability", divmod(cc, 10))
            for sig in sigs:
                ptx, _ = cuda.compile_ptx(KC._drop_kernel.py_func, sig, cc=divmod(cc, 10))
                rep = bench_cuda.ptxas_report(ptx, cc)
                assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, (cc, sig, rep)

else:
    from numba import cuda

    from hpcsgd.bfloat16 import bits as bf16_bits
    from hpcsgd.bfloat16 import values as bf16_values
    from hpcsgd.model import kernels_cuda as KC

    def run(x, keys, nb, salt, p, inplace=False):
        dx = cuda.to_device(x)
        out = dx if inplace else cuda.device_array_like(dx)
        KC.drop(dx, out, cuda.to_device(keys), nb, salt, KD.threshold_of(p), KD.scale_of(p))
        return out.copy_to_host()

    @pytest.mark.parametrize("p", [0.0, 0.25])
    @pytest.mark.parametrize("inplace", [False, True])
    def test_cuda_kernel_equals_the_cpu_bit_for_bit(p, inplace):
        x, keys = case(7, steps=4, nb=3, m=35)   # 35 columns: two warps, one partial
        want = np.empty_like(x)
        KD.drop(x, want, keys, 3, 2, KD.threshold_of(p), KD.scale_of(p))
        np.testing.assert_array_equal(run(x, keys, 3, 2, p, inplace), want)

    @pytest.mark.parametrize("storage", ["float16", "bfloat16"])
    def test_16_bit_storage_is_the_float32_result_rounded_once(storage):
        x, keys = case(8, steps=3, nb=2, m=33)
        if storage == "float16":
            x16 = x.astype(np.float16)
            want = KD.ref_drop(x16.astype(np.float32), keys, 2, 1, 0.3).astype(np.float16)
            np.testing.assert_array_equal(run(x16, keys, 2, 1, 0.3), want)
        else:
            x16 = bf16_bits(x)
            want = bf16_bits(KD.ref_drop(bf16_values(x16), keys, 2, 1, 0.3))
            np.testing.assert_array_equal(run(x16, keys, 2, 1, 0.3), want)
