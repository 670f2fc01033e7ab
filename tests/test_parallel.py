"""Model parallelism (hpcsgd/model/parallel.py): the split softmax's kernels against the
NumPy reference in one process, the split DNN against the unsplit one under a real mpiexec
(values, gradients, finite differences, traffic), and the trainer on a data x model grid."""
import os
import shutil

import numpy as np
import pytest

from conftest import run_mpi
from hpcsgd.model import kernels_parallel as KP
from hpcsgd.model.kernels import NCHUNK
from hpcsgd.model.parallel import split_columns

HERE = os.path.dirname(os.path.abspath(__file__))


def test_split_columns_deals_the_remainder_to_the_first_ranks():
    assert split_columns(40, 3).tolist() == [0, 14, 27, 40]
    assert split_columns(5, 4).tolist() == [0, 2, 3, 4, 5]
    assert split_columns(8, 1).tolist() == [0, 8]


def group_softmax(z, b, y, M, dtype):
    """The split kernels as M ranks run them, the Allgather done by hand: each rank's gradient
    slice and bias gradient, and each rank's (CE, correct)."""
    bounds = split_columns(z.shape[1], M)
    parts = [z[:, lo:hi].astype(dtype) for lo, hi in zip(bounds[:-1], bounds[1:])]   # copies
    biases = [b[:, lo:hi].astype(dtype) for lo, hi in zip(bounds[:-1], bounds[1:])]
    n = len(y)
    lanes = np.empty((n, 16), dtype)
    stats = [np.empty((n, KP.STATS), dtype) for _ in range(M)]
    for j in range(M):
        KP.split_xent_stats(parts[j], biases[j], y, int(bounds[j]), stats[j], lanes)
    every = np.stack(stats)
    grads, gbs, sums = [], [], []
    for j in range(M):
        gb = np.empty_like(biases[j])
        partial = np.empty((NCHUNK, parts[j].shape[1]), dtype)
        ce_part, correct_part = np.empty(NCHUNK), np.empty(NCHUNK, np.int64)
        KP.split_xent_finish(parts[j], y, int(bounds[j]), j, every, gb, partial, ce_part,
                             correct_part)
        grads.append(parts[j])
        gbs.append(gb)
        sums.append((ce_part.sum(), int(correct_part.sum())))
    return grads, gbs, sums, biases


@pytest.mark.parametrize("M", [1, 2, 3, 5])
def test_split_softmax_kernels_equal_the_reference(M):
    """float32 kernels against the float64 reference of the whole softmax: gradients within a
    few float32 ulps of 1 (posteriors are <= 1), the CE within float32 rounding of its terms,
    the argmax exactly (ties broken to the lowest label, as the unsplit kernel does)."""
    rng = np.random.default_rng(M)
    n, V = 700, 41
    z = rng.normal(0, 3, (n, V)).astype(np.float32)
    b = rng.normal(0, 1, (1, V)).astype(np.float32)
    y = rng.integers(0, V, n).astype(np.int32)
    y[::17] = -1
    z[3, 7] = z[3, 30] = z[3].max() + 1           # a tie across ranks: the lower label wins
    y[3] = 7
    z[4, 9] = z[4, 35] = z[4].max() + 1
    y[4] = 9
    z[6, 2] = z[6, 38] = z[6].max() + 1           # ... and the higher one is not the argmax
    y[6] = 38
    b[0, [7, 30, 9, 35, 2, 38]] = 0.5             # ties of z + b
    grads, gbs, sums, biases = group_softmax(z, b, y, M, np.float32)
    want_g, want_gb, ce, correct, _ = KP.ref_split_softmax(
        np.split(z, split_columns(V, M)[1:-1], axis=1), biases, y)
    for j in range(M):
        assert np.abs(grads[j] - want_g[j]).max() <= 8 * np.finfo(np.float32).eps
        # a column sum of n terms each within 8 ulp of 1
        assert np.abs(gbs[j] - want_gb[j]).max() <= 8 * n * np.finfo(np.float32).eps
        assert sums[j] == sums[0]                  # the same bits on every rank
        assert abs(sums[j][0] - ce) <= 1e-6 * ce
        assert sums[j][1] == correct
    assert correct > 0


def test_split_log_softmax_equals_the_reference():
    rng = np.random.default_rng(0)
    n, V, M = 50, 13, 3
    z = rng.normal(0, 4, (n, V)).astype(np.float32)
    b = rng.normal(0, 1, (1, V)).astype(np.float32)
    bounds = split_columns(V, M)
    parts = [np.ascontiguousarray(z[:, lo:hi]) for lo, hi in zip(bounds[:-1], bounds[1:])]
    stats = [np.empty((n, KP.STATS), np.float32) for _ in range(M)]
    for j in range(M):
        KP.split_lse_stats(parts[j], np.ascontiguousarray(b[:, bounds[j]:bounds[j + 1]]),
                           stats[j])
    every = np.stack(stats)
    for part in parts:
        KP.split_lse_finish(part, every)
    logpost = KP.ref_split_softmax([z], [b], np.zeros(n, np.int32))[4]
    # log-posteriors of magnitude up to ~30: float32 rounding of z + b - lse
    assert np.abs(np.concatenate(parts, axis=1) - logpost).max() <= 64 * np.finfo(np.float32).eps


@pytest.mark.parametrize("M, hidden, labels, activation",
                         [(2, "7,5", 5, "sigmoid"), (3, "7,5", 5, "sigmoid"),
                          (3, "8", 40, "relu"), (4, "9,4", 5, "relu")])
def test_split_dnn_equals_the_unsplit_one(M, hidden, labels, activation):
    """tests/mpi/parallel_network.py: values, gradients, posteriors, finite differences,
    traffic counted against the formula, whole matrices (uneven splits: 5 over 3 and 4,
    7 over 2 and 3, 40 over 3)."""
    proc = run_mpi(M, [os.path.join(HERE, "mpi", "parallel_network.py"), hidden, str(labels),
                       activation], timeout=240)
    assert proc.returncode == 0 and f"OK M={M}" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("M, codec", [(2, "float16"), (3, "dettmers"), (2, "dettmers_linear")])
def test_coded_activation_traffic_is_each_block_decoded(M, codec):
    """tests/mpi/parallel_codec.py: the Allgather and the Reduce_scatter with a codec, bit for
    bit against the codec run locally, and the bytes counted = the packed sizes."""
    proc = run_mpi(M, [os.path.join(HERE, "mpi", "parallel_codec.py"), codec], timeout=120)
    assert proc.returncode == 0 and f"OK {codec} M={M}" in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_onebit_slices_encode_as_the_whole_columns_with_the_groups_column_sums(backend):
    """A codec column cut in parts, as a model group's slices hold it: each part encoded with
    the parts' column sums added (model.codec_columns=whole) decodes to the whole column's
    encoding, cut, and leaves its part of the whole column's residual. Values on a dyadic
    grid make every float64 sum exact in any order: bit for bit. With each part's own sums
    (codec_columns=slice) the means differ."""
    from hpcsgd.codecs import make_codec
    rng = np.random.default_rng(5)
    n_cols, n_rows, cuts = 37, 70, [0, 23, 24, 70]
    g = (rng.integers(-512, 512, (n_cols, n_rows)) / 1024).astype(np.float32)
    r = (rng.integers(-64, 64, (n_cols, n_rows)) / 4096).astype(np.float32)
    codec = make_codec("onebit", backend)
    whole_r, packed = r.copy(), np.zeros(codec.packed_nbytes(n_cols, n_rows), np.uint8)
    codec.encode(g, whole_r, packed)
    want = np.zeros_like(g)
    codec.decode(packed, want)
    spans = list(zip(cuts, cuts[1:]))
    parts = [(np.ascontiguousarray(g[:, a:b]), np.ascontiguousarray(r[:, a:b])) for a, b in spans]
    sums = np.zeros((n_cols, 4))
    for gp, rp in parts:
        mine = np.zeros((n_cols, 4))
        codec.column_sums(gp, rp, mine)
        sums += mine
    for (a, b), (gp, rp) in zip(spans, parts):
        own_r, own = rp.copy(), np.zeros(codec.packed_nbytes(n_cols, b - a), np.uint8)
        codec.encode(gp, own_r, own)
        out = np.zeros(codec.packed_nbytes(n_cols, b - a), np.uint8)
        codec.encode(gp, rp, out, sums=sums)
        got, alone = np.zeros_like(gp), np.zeros_like(gp)
        codec.decode(out, got)
        codec.decode(own, alone)
        np.testing.assert_array_equal(got, want[:, a:b])
        np.testing.assert_array_equal(rp, whole_r[:, a:b])
        assert not np.array_equal(alone, want[:, a:b])


# --- the trainer on a data x model grid -----------------------------------------------------

from conftest import (TrainerRuns, assert_float32_close, latest_arrays, make_archive,  # noqa: E402
                      run_train)


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("parallel_archive"))
    make_archive(out, num_shards=2, utts_per_shard=8, max_len=200, num_labels=7)
    return out


def options(arch, *extra):
    """A tiny model whose widths do not divide by 2 or 3 (uneven splits), 1 epoch, momentum,
    constant lr; every step checks the replicas of each data group."""
    return [f"data.train={arch}", "data.context=2", "model.hidden=[25, 17]",
            "train.minibatch=61", "train.epochs=1", "data.block_frames=300",
            "data.buffer_frames=900", "train.log_every_frames=500", "optim.lr=0.005",
            "optim.momentum_tc=300", "schedule.type=constant", "train.check_every_steps=1",
            *extra]


RUNS = TrainerRuns(options, timeout=180)


@pytest.mark.parametrize("D, M", [(1, 2), (1, 3), (2, 2)])
def test_a_grid_trains_as_one_rank_on_the_same_global_minibatches(D, M, arch, tmp_path,
                                                                   tmp_path_factory):
    """D x M ranks (float32 allreduce over each data group, float32 activations) against the
    single-process reference on D ranks' global minibatches: the checkpoint's whole matrices
    are the float64 trajectory plus float32 rounding, as far from it as the float32
    reference is (conftest.assert_float32_close)."""
    run = RUNS.train(D * M, arch, tmp_path_factory, f"model.parallel={M}")
    got = latest_arrays(run)["params"]
    want = RUNS.reference(D, "float", arch, tmp_path)["params"]
    want64 = RUNS.reference(D, "float", arch, tmp_path, float64=True)["params"]
    assert got.shape == want.shape     # whole matrices, whatever M
    assert_float32_close(got, want, want64)
    assert not np.array_equal(got, RUNS.reference(D, "float", arch, tmp_path,
                                                  "train.stop_after_frames=200")["params"])


STRIPED = ("exchange.aggregation=striped",)


def test_striped_float32_runs_over_each_data_group_of_slices(arch, tmp_path, tmp_path_factory):
    """2 x 2 with the striped float32 exchange equals the single-process reference as above;
    the owners' stripes and residuals are per world rank."""
    run = RUNS.train(4, arch, tmp_path_factory, "model.parallel=2", *STRIPED,
                     "exchange.codec=float32")
    got = latest_arrays(run)
    assert_float32_close(got["params"], RUNS.reference(2, "float", arch, tmp_path)["params"],
                         RUNS.reference(2, "float", arch, tmp_path, float64=True)["params"])
    assert {f"rank{r:04d}/exchange/residual1" for r in range(4)} <= set(got)


@pytest.mark.parametrize("feedback", ["true", "false"])
def test_striped_onebit_on_a_grid_equals_onebit_on_the_unsplit_model(feedback, arch,
                                                                     tmp_path_factory):
    """2 x 2 striped 1-bit SGD against 2-rank 1-bit SGD on the unsplit model: each slice's
    columns are quantized with the whole columns' means (the model group adds their sums),
    so the two runs are the same computation and differ by the float rounding of their
    summation orders (the split GEMMs, the sums added over the group): no farther apart
    than the float32 striped exchange at 2 x 2 is from its 2-rank run (times the factor of
    conftest.assert_float32_close). With each slice's own means (model.codec_columns=slice)
    the runs are another computation: many times farther apart."""
    onebit = (*STRIPED, "exchange.codec=onebit", f"exchange.error_feedback={feedback}")
    params = {name: latest_arrays(RUNS.train(K, arch, tmp_path_factory, *extra))["params"]
              .astype(np.float64)
              for name, K, extra in [
                  ("grid", 4, ("model.parallel=2", *onebit)),
                  ("unsplit", 2, onebit),
                  ("slice", 4, ("model.parallel=2", "model.codec_columns=slice", *onebit)),
                  ("grid32", 4, ("model.parallel=2", *STRIPED, "exchange.codec=float32")),
                  ("unsplit32", 2, (*STRIPED, "exchange.codec=float32"))]}
    noise = (np.linalg.norm(params["grid32"] - params["unsplit32"])
             + 1e-7 * np.linalg.norm(params["unsplit32"]))
    dist = np.linalg.norm(params["grid"] - params["unsplit"])
    print(f"1-bit grid vs unsplit {dist:.3g}, float32 {noise:.3g}, slice "
          f"{np.linalg.norm(params['slice'] - params['unsplit']):.3g}")
    assert dist <= 10 * noise, (dist, noise)
    assert np.linalg.norm(params["slice"] - params["unsplit"]) > 100 * noise
    start = latest_arrays(RUNS.train(2, arch, tmp_path_factory, *onebit,
                                     "train.stop_after_frames=1"))["params"]
    assert not np.array_equal(params["unsplit"], start)


def resume(src, K, arch, tmp_path, name, *extra):
    """A copy of run directory `src` resumed on K ranks with these options; its directory."""
    run = str(tmp_path / name)
    shutil.copytree(src, run)
    proc = run_train(K, options(arch, f"train.run_dir={run}", *extra), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run, proc.stdout + open(os.path.join(run, "logs", "rank0000.log")).read()


def test_a_split_run_resumes_bit_exactly_and_at_another_model_size(arch, tmp_path,
                                                                     tmp_path_factory):
    """2 epochs at 1 x 2 = 1 epoch, a checkpoint, and 1 more at 1 x 2 (bit for bit); the same
    checkpoint resumed at M = 1 and M = 3 re-slices the whole matrices and the momentum and
    trains on as the single-process reference does (to float32 rounding); a checkpoint of
    M = 1 resumed at M = 2 too."""
    straight = latest_arrays(RUNS.train(2, arch, tmp_path_factory, "model.parallel=2",
                                        "train.epochs=2"))["params"]
    first = RUNS.train(2, arch, tmp_path_factory, "model.parallel=2")
    again, _ = resume(first, 2, arch, tmp_path, "again", "model.parallel=2", "train.epochs=2")
    np.testing.assert_array_equal(latest_arrays(again)["params"], straight)
    want = RUNS.reference(1, "float", arch, tmp_path, "train.epochs=2")["params"]
    want64 = RUNS.reference(1, "float", arch, tmp_path, "train.epochs=2",
                            float64=True)["params"]
    for K, M in ((1, 1), (3, 3)):
        run, log = resume(first, K, arch, tmp_path, f"m{M}", f"model.parallel={M}",
                          "train.epochs=2")
        assert "re-sliced from 1 x 2 to 1 x" in log, log
        assert_float32_close(latest_arrays(run)["params"], want, want64)
    run, log = resume(RUNS.train(1, arch, tmp_path_factory), 2, arch, tmp_path, "m1to2",
                      "model.parallel=2", "train.epochs=2")
    assert "re-sliced from 1 x 1 to 1 x 2" in log, log
    assert_float32_close(latest_arrays(run)["params"], want, want64)


def test_eight_bit_activations_train_close_to_float32_activations(arch, tmp_path,
                                                                     tmp_path_factory):
    """1 x 2 with Dettmers 8-bit activations: the run trains (its weights leave the float32
    run's by far less than they moved from the start) and its log says what moved."""
    base = latest_arrays(RUNS.train(2, arch, tmp_path_factory, "model.parallel=2"))["params"]
    run = RUNS.train(2, arch, tmp_path_factory, "model.parallel=2",
                     "model.activation_codec=dettmers")
    got = latest_arrays(run)["params"]
    start = RUNS.reference(1, "float", arch, tmp_path, "train.stop_after_frames=1")["params"]
    assert 0 < np.linalg.norm(got - base) < 0.2 * np.linalg.norm(base - start)
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "activations dettmers between them" in log


def test_a_split_model_fine_tunes_from_an_unsplit_run(arch, tmp_path_factory):
    """train.init_from into a 1 x 2 model: each rank takes its columns of the whole matrices,
    so its first step is the unsplit model's first step from the same weights (the two
    differ by float32 reassociation, far below 1e-4 of what the step changed)."""
    source = RUNS.train(1, arch, tmp_path_factory)
    init = latest_arrays(source)["params"]
    one = latest_arrays(RUNS.train(1, arch, tmp_path_factory, f"train.init_from={source}",
                                   "train.stop_after_frames=1"))["params"]
    split = latest_arrays(RUNS.train(2, arch, tmp_path_factory, f"train.init_from={source}",
                                     "train.stop_after_frames=1", "model.parallel=2"))["params"]
    step = np.abs(one - init).max()
    assert step > 0 and np.abs(split - one).max() <= 1e-4 * step
