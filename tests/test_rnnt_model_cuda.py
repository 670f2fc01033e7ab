"""An RNN-T model on a GPU rank, under the CUDA simulator (a child process, as
tests/test_ctc_model_cuda.py): the joint's and the embedding's kernels
(model/kernels_joint_cuda.py) against the CPU ones, a whole transducer's loss and gradient
(encoder, prediction network, joint in sub-batches, the RNN-T loss) against the CPU model, and
2 GPU ranks training an RNN-T model to the CPU ranks' weights under mpiexec, the held-out
loss and greedy token errors of its cross-validation (run on the host) equal to theirs.

Tolerances: the embedding's gather and scatter, the padding and bias kernels copy or add in
the CPU's order (exact); the joint differs by CUDA's tanhf (a few ulp, the simulator's float64
tanh rounded once) against the CPU's ftanh, its sums in the CPU's order: 1e-5 relative. A
network's loss and gradient: 1e-4 of their scale, as test_ctc_model_cuda's."""
import json
import os

import numpy as np
import pytest

from conftest import CUDA_ENV, make_archive, run_cuda_tests_in_child, run_train

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_rnnt_model_on_a_gpu_rank_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    def test_two_gpu_ranks_train_an_rnnt_model_as_cpu_ranks(tmp_path):
        """float32 allreduce on 2 GPU ranks (staged MPI, the simulator's one GPU shared)
        against 2 CPU ranks: the same weights to float tolerance after an epoch, and the same
        held-out loss and greedy token errors (the GPU ranks' CV runs on the host)."""
        from hpcsgd import checkpoint
        arch = str(tmp_path / "arch")
        make_archive(arch, num_shards=2, utts_per_shard=4, dim=3, min_len=12, max_len=40,
                     token_kinds=("phones",), num_tokens=5)
        params, cv = {}, {}
        for device in ("cpu", "cuda"):
            run = str(tmp_path / device)
            proc = run_train(2, [f"data.train={arch}", f"data.cv={arch}", f"train.run_dir={run}",
                                 "model.type=rnnt", "model.encoder=[conv 4 k3 s2, blstm 3]",
                                 "model.predictor=[lstm 3]", "model.embed=2", "model.joint=4",
                                 "train.minibatch=80", "train.epochs=1",
                                 "optim.lr=0.01",
                                 "schedule.type=constant", "train.check_every_steps=1",
                                 f"train.device={device}", "exchange.nccl=false",
                                 "train.log_every_frames=1000"],
                             timeout=900, env=dict(CUDA_ENV))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            params[device] = checkpoint.load(checkpoint.latest(run))[0]["params"]
            cv[device] = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
                          if json.loads(line)["kind"] == "epoch"][-1]
        np.testing.assert_allclose(params["cuda"], params["cpu"], rtol=1e-4, atol=2e-6)
        assert abs(cv["cuda"]["cv_rnnt_per_token"] - cv["cpu"]["cv_rnnt_per_token"]) <= \
            1e-4 * cv["cpu"]["cv_rnnt_per_token"]
        assert cv["cuda"]["cv_token_error_rate"] == cv["cpu"]["cv_token_error_rate"]

else:
    from numba import cuda

    from hpcsgd.data.utterances import Targets
    from hpcsgd.model import kernels_joint as KJ
    from hpcsgd.model import kernels_joint_cuda as KJC
    from hpcsgd.model.kernels_rnnt import lattice_offsets
    from hpcsgd.decode.rnnt import greedy_search
    from hpcsgd.model.transducer import on_host, rnnt

    @pytest.mark.parametrize("mode", ["add", "mul"])
    def test_joint_and_embedding_kernels_equal_the_cpu_kernels(mode):
        rng = np.random.default_rng(3)
        nb, width = 3, 5
        frames = np.array([4, 3, 2], np.int64)
        u1 = np.array([2, 4, 1], np.int64)
        pos = np.array([1, 0, 2], np.int64)   # the predictor's order: longest target first
        enc = rng.standard_normal((4 * nb, width)).astype(np.float32)
        pred = rng.standard_normal((4 * nb, width)).astype(np.float32)
        for b0, b1 in ((0, 3), (1, 3)):   # the whole batch, and a sub-batch
            rows = lattice_offsets(frames[b0:b1], u1[b0:b1] - 1)
            offs = np.zeros(nb + 1, np.int64)
            offs[b0:b1 + 1] = rows
            n = int(rows[-1])
            shape = (nb, pos, frames, u1, offs, b0, b1, KJ.MODES[mode])
            h = np.zeros((n, width), np.float32)
            KJ.joint_forward(enc, pred, *shape, h)
            dev = [cuda.to_device(a) for a in (pos, frames, u1, offs)]
            d_shape = (nb, *dev, b0, b1, KJ.MODES[mode])
            d_h = cuda.to_device(np.full_like(h, np.nan))
            KJC.joint_forward(cuda.to_device(enc), cuda.to_device(pred), *d_shape, d_h,
                              int(np.max(np.diff(rows))))
            np.testing.assert_allclose(d_h.copy_to_host(), h, rtol=1e-5, atol=1e-6)
            dh = rng.standard_normal((n, width)).astype(np.float32)
            denc = rng.standard_normal(enc.shape).astype(np.float32)   # accumulated into
            dpred = rng.standard_normal(pred.shape).astype(np.float32)
            d_dh, d_denc, d_dpred = (cuda.to_device(a) for a in (dh, denc, dpred))
            KJ.joint_backward(dh, h, enc, pred, *shape, denc, dpred)
            KJC.joint_backward(d_dh, cuda.to_device(h), n, cuda.to_device(enc),
                               cuda.to_device(pred), *d_shape, d_denc, d_dpred,
                               int(frames[b0:b1].max()), int(u1[b0:b1].max()))
            np.testing.assert_allclose(d_dh.copy_to_host(), dh, rtol=1e-6, atol=1e-7)
            np.testing.assert_allclose(d_denc.copy_to_host(), denc, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(d_dpred.copy_to_host(), dpred, rtol=1e-5, atol=1e-6)
        table = rng.standard_normal((6, 3)).astype(np.float32)
        tok = np.array([0, 4, -1, 4, 2, -1, 0], np.int64)
        out = np.zeros((len(tok), 3), np.float32)
        KJ.embed(table, tok, out)
        d_tok, d_out = cuda.to_device(tok), cuda.to_device(np.full_like(out, np.nan))
        KJC.embed(cuda.to_device(table), d_tok, d_out)
        np.testing.assert_array_equal(d_out.copy_to_host(), out)
        dy = rng.standard_normal(out.shape).astype(np.float32)
        g = np.full_like(table, np.nan)
        KJ.embed_backward(dy, tok, g)
        d_g = cuda.to_device(np.full_like(table, np.nan))
        KJC.embed_backward(cuda.to_device(dy), d_tok, d_g)
        np.testing.assert_array_equal(d_g.copy_to_host(), g)
        x = rng.standard_normal(out.shape).astype(np.float32)
        d_x = cuda.to_device(x)
        KJ.zero_padding(x, tok)
        KJC.zero_padding(d_x, d_tok)
        b = rng.standard_normal((1, 3)).astype(np.float32)
        KJ.add_bias(x, b)
        KJC.add_bias(d_x, cuda.to_device(b))
        KJ.add_into(x, dy)
        KJC.add_into(d_x, cuda.to_device(dy))
        np.testing.assert_array_equal(d_x.copy_to_host(), x)

    def _batch(rng, lens, dim):
        x = np.zeros((max(lens), len(lens), dim), np.float32)
        for b, n in enumerate(lens):
            x[:n, b] = rng.standard_normal((n, dim))
        tokens = [max(1, n // 5) for n in lens]
        ids = rng.integers(1, 6, sum(tokens)).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int64)
        return x.reshape(-1, dim), Targets(np.array(lens, np.int64), ids, offsets)

    @pytest.mark.parametrize("precision, budget", [("float32", None), ("float32", 1),
                                                   ("mixed", 1), ("bf16", None)])
    def test_an_rnnt_model_on_the_gpu_equals_the_cpu_model(precision, budget):
        """The same weights and batch on both, the joint whole and (budget 1 byte) one
        utterance per sub-batch. float32: loss and every gradient within 1e-4 of their
        scale, the encoder's output (forward) within 1e-4. mixed and bf16 (the GPU's 16-bit
        storage against the CPU's emulation in float32 buffers, a static scale of 256): each
        gradient within 2^-7 (float16), 2^-5 (bfloat16) of its norm -- the same roundings at
        the same places but a few: the GPU rounds a GEMM's output before the bias is added
        and the tanh's gradient before the joint's sums (test_ctc_model_cuda's bounds)."""
        rng = np.random.default_rng(8)
        args = (3, ["conv 6 k3 s2", "blstm 4"], 6)
        kw = dict(predictor=["lstm 3"], embed=2, joint=5, max_batch=64, precision=precision)
        cpu, gpu = rnnt(*args, **kw), rnnt(*args, **kw, device="cuda")
        if precision != "float32":
            assert gpu.layers[-1].storage.itemsize == 2 and cpu.layers[-1].storage == np.float32
        if budget:
            cpu.layers[-1].joint_budget = gpu.layers[-1].joint_budget = budget
        params = cpu.new_params()
        cpu.init(params, np.random.default_rng(0))
        d_params = gpu.new_params()
        d_params.flat.copy_to_device(params.flat)
        x, targets = _batch(rng, [16, 13, 9], 3)
        scale = 256.0 if precision != "float32" else 1.0
        g_cpu, g_gpu = cpu.new_params(), gpu.new_params()
        loss_cpu, tok = cpu.forward_backward(params, g_cpu, x, targets, len(x), loss_scale=scale)
        loss_gpu, tok_gpu = gpu.forward_backward(d_params, g_gpu, x, targets, len(x),
                                                 loss_scale=scale)
        assert tok == tok_gpu == len(targets.ids)
        # the joint's high-water mark (h and the logits of its largest sub-batch): halved by
        # 16-bit storage, where the CPU's emulation holds float32 buffers
        width = 2 if precision != "float32" else 4
        assert gpu.layers[-1].high_water * 4 == cpu.layers[-1].high_water * width > 0
        tol = {"float32": 1e-4, "mixed": 2.0 ** -7, "bf16": 2.0 ** -5}[precision]
        assert abs(loss_cpu - loss_gpu) <= tol * abs(loss_cpu)
        if precision != "float32":
            cpu.unscale(g_cpu, scale)
            gpu.unscale(g_gpu, scale)
        got = g_gpu.flat.copy_to_host()
        for m in g_cpu.matrices:
            want = g_cpu.flat[m.offset:m.offset + m.size]
            have = got[m.offset:m.offset + m.size]
            assert np.linalg.norm(have - want) <= tol * np.linalg.norm(want) + 1e-7, m.name
        if precision == "float32":
            out_cpu = cpu.forward(params, x, len(x), lengths=targets.frames).copy()
            out_gpu = gpu.forward(d_params, x, len(x), lengths=targets.frames)
            assert out_gpu.shape == out_cpu.shape == (8 * 3, 5)
            np.testing.assert_allclose(out_gpu, out_cpu, rtol=1e-4, atol=1e-5)
            # a search of the GPU model (decode, eval, CV) runs on its host twin
            layer, weights, _ = on_host(gpu, d_params)
            assert layer.device == "cpu" and gpu.layers[-1].device == "cuda"
            lengths = cpu.out_lengths(len(x), targets.frames)
            want = greedy_search(cpu.layers[-1], params, out_cpu, lengths)
            got = greedy_search(layer, weights, np.array(out_gpu), lengths)
            assert [list(h) for h in got] == [list(h) for h in want]
