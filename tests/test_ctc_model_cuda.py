"""A CTC model on a GPU rank, under the CUDA simulator (a child process, as
tests/test_lstm_cuda.py): the sequence kernels (unfold, fold, mask) against the CPU kernels,
a whole CTC model's loss and gradient (a strided convolution, a BLSTM on sequences of
different lengths, the CTC loss through model.ops) against the CPU model, mixed precision's
float16 storage against the CPU emulation, and 2 GPU ranks training a CTC model to the CPU
ranks' weights under mpiexec.

Tolerances: unfold and mask copy (exact); fold adds at most k float32 values in the CPU's
order (exact: the same float32 additions). A network's loss and gradient are sums over its
rows of values a few float32 roundings apart (CUDA's expf and logf within 2 ulp of the CPU's
polynomials: the derived CTC bound is tests/test_ctc_loss.py's): 1e-4 of their scale, as
test_lstm_cuda's network check. Float16 storage against the emulation: the same roundings at
the same places, the sums in another order: 2^-7 of each gradient's norm."""
import os

import numpy as np
import pytest

from conftest import CUDA_ENV, make_archive, run_cuda_tests_in_child, run_train

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_ctc_model_on_a_gpu_rank_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    def test_two_gpu_ranks_train_a_ctc_model_as_cpu_ranks(tmp_path):
        """float32 allreduce on 2 GPU ranks (staged MPI, the simulator's one GPU shared)
        against 2 CPU ranks: the same weights to float tolerance after 3 steps."""
        from hpcsgd import checkpoint
        arch = str(tmp_path / "arch")
        make_archive(arch, num_shards=2, utts_per_shard=4, dim=3, min_len=12, max_len=40,
                     token_kinds=("phones",), num_tokens=5)
        params = {}
        for device in ("cpu", "cuda"):
            run = str(tmp_path / device)
            proc = run_train(2, [f"data.train={arch}", f"train.run_dir={run}", "model.type=ctc",
                                 "model.encoder=[conv 4 k3 s2, blstm 3]", "train.minibatch=80",
                                 "train.epochs=1", "train.stop_after_frames=120",
                                 "optim.lr=0.01", "schedule.type=constant",
                                 "train.check_every_steps=1", f"train.device={device}",
                                 "exchange.nccl=false", "train.log_every_frames=1000"],
                             timeout=600, env=dict(CUDA_ENV))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            params[device] = checkpoint.load(checkpoint.latest(run))[0]["params"]
        np.testing.assert_allclose(params["cuda"], params["cpu"], rtol=1e-4, atol=2e-6)

else:
    from numba import cuda

    from hpcsgd.data.utterances import Targets
    from hpcsgd.model import kernels_cuda as KC
    from hpcsgd.model import kernels_seq as KS
    from hpcsgd.model.ctc import ctc
    from hpcsgd.model.lengths import Lengths

    def test_sequence_kernels_equal_the_cpu_kernels():
        rng = np.random.default_rng(4)
        nb, steps_in, c, k, s, d = 3, 9, 4, 5, 2, 1
        left, steps_out = (k - 1) * d // 2, -(-steps_in // s)
        shape = (nb, steps_in, steps_out, k, s, d, left)
        x = rng.standard_normal((steps_in * nb, c)).astype(np.float32)
        cols = np.zeros((steps_out * nb, k * c), np.float32)
        KS.unfold(x, cols, *shape)
        d_cols = cuda.to_device(np.full_like(cols, np.nan))
        KC.unfold(cuda.to_device(x), d_cols, *shape)
        np.testing.assert_array_equal(d_cols.copy_to_host(), cols)
        dx = np.zeros_like(x)
        KS.fold(cols, dx, *shape)
        d_dx = cuda.to_device(np.full_like(x, np.nan))
        KC.fold(d_cols, d_dx, *shape)
        np.testing.assert_array_equal(d_dx.copy_to_host(), dx)
        lengths = Lengths([9, 6, 2])
        want = x.copy()
        KS.mask_rows(want, lengths.batch_sizes, lengths.nb)
        d_x = cuda.to_device(x)
        KC.mask_rows(d_x, cuda.to_device(lengths.batch_sizes), lengths.nb)
        np.testing.assert_array_equal(d_x.copy_to_host(), want)

    def _batch(rng, lens, dim):
        x = np.zeros((max(lens), len(lens), dim), np.float32)
        for b, n in enumerate(lens):
            x[:n, b] = rng.standard_normal((n, dim))
        ids = rng.integers(1, 6, sum(n // 5 for n in lens)).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum([n // 5 for n in lens])]).astype(np.int64)
        return x.reshape(-1, dim), Targets(np.array(lens, np.int64), ids, offsets,
                                           np.arange(3, 3 + len(lens), dtype=np.uint64))

    def _frame_labels(rng, lens, stride, num_labels):
        """Frame labels at the output rate, time-major, -1 on the padding."""
        steps = [-(-n // stride) for n in lens]
        labels = np.full((steps[0], len(lens)), -1, np.int32)
        for b, m in enumerate(steps):
            labels[:m, b] = rng.integers(0, num_labels, m)
        return labels.reshape(-1)

    @pytest.mark.parametrize("precision,encoder,dropout", [
        ("float32", ["conv 6 k3 s2", "blstm 4"], 0.0), ("mixed", ["conv 6 k3 s2", "blstm 4"], 0.0),
        ("float32", ["conv 6 k3 s2", "blstm 4", "head"], 0.3),
        ("mixed", ["conv 6 k3 s2", "blstm 4", "head"], 0.0),
        ("float32", ["conv 6 k3 s2", "blstm 4"], 0.3), ("mixed", ["conv 6 k3 s2", "blstm 4"], 0.3),
        ("float32", ["lstm 4", "conv 5 k3 d2 ahead"], 0.0),
        ("float32", ["conv 6 k3 s2 ln", "conv 5 k3 d2 ln"], 0.0),
        ("mixed", ["conv 6 k3 s2 ln", "conv 5 k3 d2 ln"], 0.0),
        ("float32", ["conv 6 k3 s2 in", "conv 5 k3 d2 in"], 0.0),
        ("mixed", ["conv 6 k3 s2 in", "conv 5 k3 d2 in"], 0.0)])
    def test_a_ctc_model_on_the_gpu_equals_the_cpu_model(precision, encoder, dropout):
        """The same weights and batch on both: float32 within 1e-4 of the gradient's scale;
        mixed (float16 storage on the GPU, the float32-buffer emulation on the CPU) within
        2^-7 of each matrix's gradient norm, at a static scale of 256. The all-convolutional
        encoder with layer or instance norms (kernels_norm_cuda) as well as the DS2-like one,
        and the latter with dropout (the same masks from the same utterance keys), and with
        a frame CE head ("head": model.frame_ce, 4 frame labels at weight 0.5)."""
        rng = np.random.default_rng(7)
        head = 4 if "head" in encoder else 0
        encoder = [e for e in encoder if e != "head"]
        cpu = ctc(3, encoder, 6, max_batch=64, precision=precision, frame_labels=head)
        gpu = ctc(3, encoder, 6, max_batch=64, device="cuda", precision=precision,
                  frame_labels=head)
        cpu.layers[-1].frame_ce = gpu.layers[-1].frame_ce = 0.5 if head else 0.0
        cpu.set_dropout(dropout)
        gpu.set_dropout(dropout)
        params = cpu.new_params()
        cpu.init(params, np.random.default_rng(0))
        d_params = gpu.new_params()
        d_params.flat.copy_to_device(params.flat)
        x, targets = _batch(rng, [16, 13, 9], 3)
        if head:
            targets = targets._replace(labels=_frame_labels(rng, [16, 13, 9], 2, head))
        scale = 256.0 if precision == "mixed" else 1.0
        g_cpu, g_gpu = cpu.new_params(), gpu.new_params()
        loss_cpu, tok = cpu.forward_backward(params, g_cpu, x, targets, len(x), loss_scale=scale)
        loss_gpu, tok_gpu = gpu.forward_backward(d_params, g_gpu, x, targets, len(x),
                                                 loss_scale=scale)
        assert tok == tok_gpu == len(targets.ids)
        assert abs(loss_cpu - loss_gpu) <= 1e-4 * abs(loss_cpu)
        if head:   # the head's CE and hits: the same rows, sums in another order
            (ce_c, n_c, hit_c), (ce_g, n_g, hit_g) = cpu.pop_frame_ce(), gpu.pop_frame_ce()
            assert n_c == n_g == 20 and ce_c > 0 and abs(ce_c - ce_g) <= 1e-4 * ce_c
            assert abs(hit_c - hit_g) <= 2   # an argmax near a tie may flip
        if precision == "mixed":
            cpu.unscale(g_cpu, scale)
            gpu.unscale(g_gpu, scale)
        got = g_gpu.flat.copy_to_host()
        for m in g_cpu.matrices:
            want = g_cpu.flat[m.offset:m.offset + m.size]
            have = got[m.offset:m.offset + m.size]
            bound = (2 ** -7 if precision == "mixed" else 1e-4) * np.linalg.norm(want) + 1e-7
            assert np.linalg.norm(have - want) <= bound, m.name
        out_cpu = cpu.forward(params, x, len(x), lengths=targets.frames).copy()
        out_gpu = gpu.forward(d_params, x, len(x), lengths=targets.frames)
        valid = KS.ref_mask(np.ones((len(out_cpu), 1)), [8, 7, 5], 3)[:, 0] > 0
        np.testing.assert_allclose(out_gpu[valid], out_cpu[valid], rtol=1e-4, atol=1e-5)
