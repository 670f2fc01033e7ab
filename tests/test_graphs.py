"""CUDA Graphs of the forward and backward pass (train.cuda_graphs; hpcsgd/graphs.py): a
captured-and-replayed pass equals the eager pass bit for bit (the same kernels, arguments and
order: the simulator's graph is the recorded launches, replayed) and is one launch; a
capture that would copy, allocate or synchronise fails naming it; the trainer with the key
on equals the trainer without it, bit for bit, under mpiexec -n 2 GPU ranks.

Run in a fresh pytest process with NUMBA_ENABLE_CUDASIM=1 (or on the GPU with
HPCSGD_TEST_GPU=1), as the other CUDA test files are."""
import os

import numpy as np
import pytest

from conftest import (CUDA_ENV, make_archive, run_cuda_tests_in_child, run_mpi, run_train,
                      tiny_gpu_run)

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

if not CHILD:
    def test_cuda_graphs_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)

    def test_trainer_with_cuda_graphs_equals_without(tmp_path):
        """2 GPU ranks (the simulator's), striped 1-bit, mixed precision with a backoff
        scaler: the same weights, bit for bit, with train.cuda_graphs on and off; the log
        says the pass is captured."""
        from hpcsgd import checkpoint
        arch = str(tmp_path / "arch")
        make_archive(arch, num_shards=2, utts_per_shard=4, max_len=120)
        opts = tiny_gpu_run(arch, "exchange.aggregation=striped", "train.precision=mixed",
                            "train.loss_scale=backoff")
        runs = {}
        for graphs in (False, True):
            run = tmp_path / f"graphs_{graphs}"
            proc = run_train(2, opts + [f"train.run_dir={run}",
                                        f"train.cuda_graphs={str(graphs).lower()}"],
                             timeout=300, env=dict(CUDA_ENV))
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            runs[graphs] = checkpoint.load(checkpoint.latest(str(run)))[0]
            log = (run / "logs" / "rank0000.log").read_text()
            assert ("CUDA Graphs:" in log) == graphs
        assert set(runs[False]) == set(runs[True])
        for key in runs[False]:
            assert np.array_equal(np.asarray(runs[False][key]), np.asarray(runs[True][key])), key

    def test_cuda_graphs_need_gpu_ranks_and_no_qat(tmp_path):
        arch = str(tmp_path / "arch")
        make_archive(arch, num_shards=1, utts_per_shard=2)
        proc = run_mpi(1, ["-m", "hpcsgd.cli", "train", f"data.train={arch}",
                           f"train.run_dir={tmp_path / 'run'}", "train.cuda_graphs=true"])
        assert proc.returncode != 0
        assert "train.cuda_graphs=true: needs train.device=cuda" in proc.stderr

else:
    from hpcsgd import census
    from hpcsgd.model import build

    census.install()
    N = 8
    RNG = np.random.default_rng(0)
    X = RNG.standard_normal((N, 6)).astype(np.float32)
    Y = RNG.integers(0, 3, N).astype(np.int32)
    DNN = dict(input_dim=6, hidden=[5, 4], num_labels=3, activation="sigmoid")
    BLSTM = dict(type="lstm", input_dim=6, cells=[3], num_labels=3, bidirectional=True,
                 bottleneck=[4], activation="sigmoid", steps=2)

    def passes(shape, graphs, precision="float32", scales=(1.0, 1.0, 1.0, 1.0, 4.0, 4.0)):
        """(CE, hits, gradient, launches) of a pass per loss scale, the same weights."""
        model = build(shape, max_batch=N, device="cuda", precision=precision)
        params, grads = model.new_params(), model.new_params()
        model.init(params, np.random.default_rng(1))
        if graphs:
            model.use_cuda_graphs()
        y = Y.copy()
        if shape.get("type") == "lstm":
            y[0] = -1                       # a context frame outside the loss
        out = []
        for scale in scales:
            before = census.snapshot()
            ce, hits = model.forward_backward(params, grads, X, y, N, loss_scale=scale)
            out.append((ce, hits, grads.flat.copy_to_host(), census.since(before)["launches"]))
        return out

    @pytest.mark.parametrize("shape,precision", [(DNN, "float32"), (DNN, "mixed"),
                                                 (DNN, "bf16"), (BLSTM, "float32")],
                             ids=["dnn", "dnn-mixed", "dnn-bf16", "blstm"])
    def test_replayed_pass_equals_the_eager_pass_bit_for_bit(shape, precision):
        eager, graphed = passes(shape, False, precision), passes(shape, True, precision)
        for (ce, hits, g, _), (ce2, hits2, g2, _) in zip(eager, graphed):
            assert (ce, hits) == (ce2, hits2) and np.array_equal(g, g2)
        launches = [e[3] for e in graphed]
        assert eager[0][3] > 5   # the eager pass: every kernel and GEMM launched
        # first use: eager; second: captured and launched; then replayed; a new loss scale
        # (a kernel argument) is a new graph: eager once, then captured
        assert launches == [eager[0][3], 1, 1, 1, eager[4][3], 1]

    def test_a_capture_that_would_copy_fails_naming_it():
        """A pass that reads back to the host (here: the loss read not deferred) cannot be a
        graph: the capture stops with the reason, and the model still runs eagerly."""
        model = build(DNN, max_batch=N, device="cuda")
        params, grads = model.new_params(), model.new_params()
        model.init(params, np.random.default_rng(1))
        model.use_cuda_graphs()
        model.graphs.ops = type("NoDefer", (), {"defer_loss": False})()   # ops that read
        model.forward_backward(params, grads, X, Y, N)                    # eager
        with pytest.raises(RuntimeError, match="a copy to the host inside a CUDA Graph capture"):
            model.forward_backward(params, grads, X, Y, N)
        model.graphs = None
        ce, _ = model.forward_backward(params, grads, X, Y, N)
        assert np.isfinite(ce)

    def test_quantization_aware_models_are_refused():
        qat = dict(weights="sawb", weight_bits=4)
        model = build({**DNN, "qat": qat}, max_batch=N, device="cuda")
        with pytest.raises(ValueError, match="without qat"):
            model.use_cuda_graphs()
