"""The gradient exchange under a real mpiexec, K = 1..4 (oversubscribed on 2 cores):
allreduce == single-rank training on the same global minibatches, striped + float32 ==
allreduce, striped + onebit at K = 1 == the paper's two-residual loop written out plainly,
replicas bit-identical every step, the same bits twice, and bit-exact resume with both
residuals and the owners' optimizer stripes."""
import json
import os
import shutil

import numpy as np
import pytest

from conftest import (REPO, TRAIN, TrainerRuns, assert_float32_close, latest_arrays,
                      make_archive, run_mpi, run_train)
from hpcsgd import checkpoint



@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("exchange_archive"))
    make_archive(out, num_shards=2, utts_per_shard=8, max_len=200)
    return out


def options(arch, *extra):
    """A tiny model, 1 epoch, momentum on, constant lr; every step checks the replicas."""
    return [f"data.train={arch}", "data.context=2", "model.hidden=[24, 16]",
            "train.minibatch=61", "train.epochs=1", "data.block_frames=300",
            "data.buffer_frames=900", "train.log_every_frames=500", "optim.lr=0.005",
            "optim.momentum_tc=300", "schedule.type=constant", "train.check_every_steps=1", *extra]


RUNS = TrainerRuns(options, timeout=120)
train, reference, arrays = RUNS.train, RUNS.reference, latest_arrays


@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_allreduce_equals_one_rank_on_the_same_global_minibatches(K, arch, tmp_path,
                                                                  tmp_path_factory):
    got = arrays(train(K, arch, tmp_path_factory))["params"]
    want = reference(K, "float", arch, tmp_path)["params"]
    if K == 1:
        np.testing.assert_array_equal(got, want)   # the same arithmetic, in the same order
    else:   # sum of K partial sums vs one sum over the union: rounding only
        assert_float32_close(got, want, reference(K, "float", arch, tmp_path,
                                                  float64=True)["params"])
    assert not np.array_equal(got, reference(K, "float", arch, tmp_path,
                                             "train.stop_after_frames=200")["params"])


def test_the_overlapped_allreduce_on_4_ranks_is_the_one_process_sum(arch, tmp_path,
                                                                    tmp_path_factory):
    """exchange.overlap with a bucket per layer (3 Iallreduces in flight at once on 4 ranks,
    posted as the backward pass finishes each layer): the same trajectory within float32
    rounding, replicas checked every step."""
    run = train(4, arch, tmp_path_factory, "exchange.overlap=true", "exchange.bucket_mb=0")
    assert "overlapped allreduce: 3 bucket(s)" in open(
        os.path.join(run, "logs", "rank0000.log")).read()
    assert_float32_close(arrays(run)["params"], reference(4, "float", arch, tmp_path)["params"],
                         reference(4, "float", arch, tmp_path, float64=True)["params"])


@pytest.mark.parametrize("K", [2, 3])
def test_ranks_without_frames_post_the_overlapped_buckets_in_step(K):
    """A rank whose share of a step is empty posts every bucket after the backward pass the
    others overlapped them with: the collectives match (no hang, no truncation) and the
    weights are the one-buffer Allreduce's bit for bit (tests/mpi/overlap_ranks.py)."""
    proc = run_mpi(K, [os.path.join(REPO, "tests", "mpi", "overlap_ranks.py")], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("overlap ok") == K, proc.stdout


MIXED = ("train.precision=mixed", "train.loss_scale=static", "train.loss_scale_init=1024")


@pytest.mark.parametrize("K", [1, 2, 3])
def test_mixed_allreduce_equals_one_mixed_rank_on_the_same_global_minibatches(
        K, arch, tmp_path, tmp_path_factory):
    """Mixed precision: K ranks round K partial weight gradients to float16 where one rank
    rounds their sum; both are the float64 trajectory plus float16 rounding."""
    got = arrays(train(K, arch, tmp_path_factory, *MIXED))["params"]
    want = reference(K, "float", arch, tmp_path, *MIXED)["params"]
    if K == 1:
        np.testing.assert_array_equal(got, want)   # the same arithmetic, in the same order
    else:
        assert_float32_close(got, want, reference(K, "float", arch, tmp_path, *MIXED,
                                                  float64=True)["params"])
    assert not np.array_equal(got, arrays(train(K, arch, tmp_path_factory))["params"])


@pytest.mark.parametrize("K", [2, 3, 4])
def test_striped_float32_equals_allreduce(K, arch, tmp_path, tmp_path_factory):
    base = arrays(train(K, arch, tmp_path_factory))
    got = arrays(train(K, arch, tmp_path_factory, "exchange.aggregation=striped",
                       "exchange.codec=float32"))
    ref32 = reference(K, "float", arch, tmp_path)["params"]
    ref64 = reference(K, "float", arch, tmp_path, float64=True)["params"]
    assert_float32_close(got["params"], ref32, ref64)     # both the same sum, in other orders
    assert_float32_close(base["params"], ref32, ref64)
    # momentum lives only on the owner's stripe: K compact pieces that tile the full vector
    pieces = [got[f"rank{r:04d}/opt/velocity"] for r in range(K)]
    assert sum(p.size for p in pieces) == base["opt/velocity"].size
    assert max(p.size for p in pieces) < base["opt/velocity"].size / (K - 0.5)


@pytest.mark.parametrize("feedback", [True, False])
def test_striped_onebit_on_one_rank_equals_the_two_residual_loop(feedback, arch, tmp_path,
                                                                  tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "optim.adagrad=aggregate",
             f"exchange.error_feedback={str(feedback).lower()}")
    got = arrays(train(1, arch, tmp_path_factory, *extra))
    want = reference(1, "onebit", arch, tmp_path, *extra)
    np.testing.assert_array_equal(got["params"], want["params"])
    np.testing.assert_array_equal(got["rank0000/exchange/residual1"], want["residual1"])
    np.testing.assert_array_equal(got["rank0000/exchange/residual2"], want["residual2"])
    assert np.abs(want["residual2"]).sum() > 0   # the second quantization really happened
    float_run = arrays(train(1, arch, tmp_path_factory))["params"]
    assert not np.allclose(got["params"], float_run, atol=1e-6)


@pytest.mark.parametrize("K", [2, 3, 4])
def test_striped_onebit_replicas_agree_and_the_same_seed_gives_the_same_bits(K, arch, tmp_path,
                                                                             tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "optim.adagrad=aggregate")
    first = train(K, arch, tmp_path_factory, *extra)   # check_every_steps=1: CRC every step
    again = str(tmp_path / "again")
    proc = run_mpi(K, TRAIN + options(arch, f"train.run_dir={again}", *extra), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, b = arrays(first), arrays(again)
    assert set(a) == set(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    # each rank has its own first residual (its own data), so the residuals differ
    assert not np.array_equal(a["rank0000/exchange/residual1"], a["rank0001/exchange/residual1"])
    # 1-bit with feedback learns about as well as float32 on this toy problem
    ce = [json.loads(line) for line in open(os.path.join(first, "metrics.jsonl"))]
    epoch = [r for r in ce if r["kind"] == "epoch"][-1]
    assert np.isfinite(epoch["train_ce"])
    phases = [r for r in ce if r["kind"] == "train"][-1]["exchange_s"]
    assert set(phases) == {"encode", "alltoallv", "owner", "allgatherv", "decode_apply"}


@pytest.mark.parametrize("adagrad", ["aggregate", "after_momentum"])
def test_the_fused_owner_pass_trains_the_same_bits_as_the_three_passes(adagrad, arch,
                                                                       tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", f"optim.adagrad={adagrad}",
             "optim.weight_decay=0.0001")
    fused = arrays(train(3, arch, tmp_path_factory, *extra))
    three = arrays(train(3, arch, tmp_path_factory, *extra, "exchange.fuse_owner=false"))
    assert set(fused) == set(three)
    for name in fused:
        np.testing.assert_array_equal(fused[name], three[name], err_msg=name)
    phases = [json.loads(line) for line in open(os.path.join(
        train(3, arch, tmp_path_factory, *extra, "exchange.fuse_owner=false"), "metrics.jsonl"))]
    assert {"decode_sum", "post_process", "reencode"} <= set(
        [r for r in phases if r["kind"] == "train"][-1]["exchange_s"])


DETTMERS_REFRESH = ("exchange.codec=dettmers", "exchange.dettmers_block=64",
                    "exchange.dettmers_refresh=3")


@pytest.mark.parametrize("K,codec", [(2, ("exchange.codec=onebit",)),
                                     (3, ("exchange.codec=onebit",)), (2, DETTMERS_REFRESH)],
                         ids=["2-onebit", "3-onebit", "2-dettmers_refresh"])
def test_striped_onebit_resumes_bit_exactly_with_both_residuals(K, codec, arch, tmp_path,
                                                                 tmp_path_factory):
    """(Dettmers with its scales reused for 3 encodes: the packed buffers that hold them are
    checkpointed too, so the resumed run reuses the scales the whole run reused.)"""
    extra = ("exchange.aggregation=striped", *codec, "optim.adagrad=aggregate", "train.epochs=2")
    full = arrays(train(K, arch, tmp_path_factory, *extra))
    cut = str(tmp_path / "cut")
    total = json.load(open(os.path.join(arch, "index.json")))["total_frames"]
    for stop in (f"train.stop_after_frames={total * 3 // 2}", "train.stop_after_frames=0"):
        proc = run_train(K, options(arch, f"train.run_dir={cut}", *extra, stop), timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if stop.endswith("=0"):
            assert "resumed from" in open(os.path.join(cut, "logs", "rank0001.log")).read()
        else:
            mid = arrays(cut)
    resumed = arrays(cut)
    assert set(full) == set(resumed)
    for r in range(K):
        assert f"rank{r:04d}/exchange/residual2" in full
        assert np.abs(mid[f"rank{r:04d}/exchange/residual1"]).sum() > 0
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)
    assert not np.array_equal(mid["params"], full["params"])


def test_a_striped_checkpoint_is_re_striped_at_an_epoch_end(arch, tmp_path, tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit")
    run = str(tmp_path / "run")
    shutil.copytree(train(2, arch, tmp_path_factory, *extra), run)   # an epoch-end checkpoint
    proc = run_train(3, options(arch, f"train.run_dir={run}", *extra, "train.epochs=2"),
                     timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = open(os.path.join(run, "logs", "rank0002.log")).read()
    assert "re-striped the optimizer state" in log and "folded into the new stripes" in log


def test_a_run_moves_mid_epoch_from_2_to_3_to_2_ranks(arch, tmp_path):
    """Cut twice mid-epoch and resumed at another K each time: the rest of the epoch is
    re-dealt (every frame once: the epochs end at multiples of the archive's frames), the
    optimizer stripes re-sliced, both residuals folded (not restarted), replicas agree."""
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "train.epochs=2",
             "optim.adagrad=aggregate")
    run = str(tmp_path / "run")
    total = json.load(open(os.path.join(arch, "index.json")))["total_frames"]
    for K, stop in ((2, total // 3), (3, total * 3 // 4), (2, 0)):
        proc = run_train(K, options(arch, f"train.run_dir={run}", *extra,
                                    f"train.stop_after_frames={stop}"), timeout=180)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if stop:
            mid = arrays(run)
            meta = checkpoint.read_meta(checkpoint.latest(run))
            assert meta["epoch"] == 0 and 0 < sum(meta["offsets"]) < total
            assert all(np.abs(mid[f"rank{r:04d}/exchange/residual1"]).sum() > 0
                       for r in range(K))
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert log.count("re-dealt from 2 to 3 ranks") == 1 and "re-dealt from 3 to 2" in log
    assert "folded into the new stripes" in log
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    assert [e["frames"] for e in epochs] == [total, 2 * total]
    final = arrays(run)
    assert np.isfinite(final["params"]).all()
    assert sum(final[f"rank{r:04d}/opt/velocity"].size for r in range(2)) == final["params"].size


@pytest.mark.parametrize("codec", ["kbit", "dettmers", "float16"])
def test_other_codecs_through_the_striped_exchange_keep_replicas_identical(codec, arch,
                                                                           tmp_path_factory):
    """(Dettmers with a scale per 64 values refreshed every 3rd step: each send buffer keeps
    its scales between steps, and every rank still decodes the same bits.)"""
    run = train(3, arch, tmp_path_factory, "exchange.aggregation=striped",
                f"exchange.codec={codec}", "exchange.bits=3", "exchange.dettmers_block=64",
                "exchange.dettmers_refresh=3")
    got = arrays(run)["params"]
    base = arrays(train(3, arch, tmp_path_factory))["params"]
    assert np.isfinite(got).all() and not np.array_equal(got, base)
    assert np.abs(got - base).max() < 0.05   # close to float32 training after one short epoch


def test_float16_allreduce_is_close_to_float32(arch, tmp_path_factory):
    got = arrays(train(2, arch, tmp_path_factory, "exchange.allreduce_dtype=float16"))["params"]
    base = arrays(train(2, arch, tmp_path_factory))["params"]
    assert not np.array_equal(got, base)
    np.testing.assert_allclose(got, base, rtol=0, atol=2e-3)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("shape", [(5, 2048), (3, 37), (1, 9304), (0, 16)])
def test_onebit_decode_apply_equals_decode_then_optimizer_apply(backend, shape):
    """The fused final decode gives the same bits as decode followed by Optimizer.apply."""
    from hpcsgd import optim
    from hpcsgd.codecs import make_codec
    rng = np.random.default_rng(1)
    codec = make_codec("onebit", backend)
    g = rng.standard_normal(shape).astype(np.float32)
    packed = np.zeros(codec.packed_nbytes(*shape), np.uint8)
    codec.encode(g, np.zeros_like(g), packed)
    w = rng.standard_normal(shape).astype(np.float32)
    want, u = w.copy(), np.empty_like(w)
    codec.decode(packed, u)
    optim.Optimizer(max(w.size, 1)).apply(want.reshape(-1), u.reshape(-1), 0.0123)
    codec.decode_apply(packed, w, 0.0123)
    np.testing.assert_array_equal(w, want)


@pytest.mark.parametrize("mode", ["allreduce", "onebit", "kbit"])
def test_parameters_are_exchanged_as_their_specs_say(mode):
    """A "float" parameter is summed exactly (never through the 1-bit codec), a "none" one is
    never touched, the codec ones are updated, and replicas agree (tests/mpi/exchange_specs.py)."""
    script = os.path.join(os.path.dirname(__file__), "mpi", "exchange_specs.py")
    proc = run_mpi(3, [script, mode], timeout=120)
    assert proc.returncode == 0 and f"OK {mode} K=3" in proc.stdout, proc.stdout + proc.stderr


# --- the cold start (exchange.cold_start_frames, issue 18) ---------------------------------------

def cold_frames(arch):
    return json.load(open(os.path.join(arch, "index.json")))["total_frames"] // 3


def test_the_cold_start_trains_as_the_float32_exchange_then_switches(arch, tmp_path_factory):
    F = cold_frames(arch)
    striped = ("exchange.aggregation=striped", "train.stop_after_frames=" + str(F))
    cold = train(2, arch, tmp_path_factory, *striped, "exchange.codec=onebit",
                 f"exchange.cold_start_frames={F}")
    exact = train(2, arch, tmp_path_factory, *striped, "exchange.codec=float32")
    a, b = arrays(cold), arrays(exact)
    for name in a:   # up to frame F: the float32 exchange, bit for bit (residuals zero)
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    log = open(os.path.join(cold, "logs", "rank0000.log")).read()
    assert f"cold start: the float32 exchange until frame {F:,}" in log
    assert "cold start over at frame" in log
    records = [json.loads(line) for line in open(os.path.join(cold, "metrics.jsonl"))]
    assert [r["codec"] for r in records if r["kind"] == "cold_start_end"] == ["onebit"]
    # after it: 1-bit, unlike the float32 run and unlike 1-bit from the start
    whole = ("exchange.aggregation=striped", "exchange.codec=onebit")
    after = arrays(train(2, arch, tmp_path_factory, *whole, f"exchange.cold_start_frames={F}"))
    assert not np.array_equal(after["params"], arrays(train(2, arch, tmp_path_factory, *whole,
                                                            "exchange.codec=float32"))["params"])
    assert not np.array_equal(after["params"], arrays(train(2, arch, tmp_path_factory,
                                                            *whole))["params"])
    assert np.abs(after["rank0000/exchange/residual1"]).sum() > 0


@pytest.mark.parametrize("double_buffering", ["false", "true"])
def test_a_run_resumed_inside_and_after_the_cold_start_is_bit_exact(double_buffering, arch,
                                                                      tmp_path,
                                                                      tmp_path_factory):
    F = cold_frames(arch)
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit",
             f"exchange.cold_start_frames={F}", f"exchange.double_buffering={double_buffering}",
             "train.epochs=2")
    full = arrays(train(2, arch, tmp_path_factory, *extra))
    for stop in (F // 2, F + F // 2):   # inside the cold start, and after it
        cut = str(tmp_path / f"cut{stop}")
        for last in (f"train.stop_after_frames={stop}", "train.stop_after_frames=0"):
            proc = run_train(2, options(arch, f"train.run_dir={cut}", *extra, last),
                             timeout=120)
            assert proc.returncode == 0, proc.stdout + proc.stderr
        resumed = arrays(cut)
        for name in full:
            np.testing.assert_array_equal(full[name], resumed[name], err_msg=f"{stop}: {name}")


# --- Adam at the owner (optim.type=adam, issue 18) ----------------------------------------------

ADAM = ("optim.type=adam", "optim.momentum_tc=0", "optim.lr=0.00002")


@pytest.mark.parametrize("K", [1, 2, 3])
def test_adam_at_the_owner_equals_adam_on_one_rank(K, arch, tmp_path, tmp_path_factory):
    """Allreduce (every rank runs Adam on the whole sum) and striped float32 (each owner on
    its stripe, 1/K of Adam's moments) against the single-process Adam on the same global
    minibatches."""
    ref32 = reference(K, "float", arch, tmp_path, *ADAM)["params"]
    ref64 = reference(K, "float", arch, tmp_path, *ADAM, float64=True)["params"]
    full = arrays(train(K, arch, tmp_path_factory, *ADAM))
    owner = arrays(train(K, arch, tmp_path_factory, *ADAM, "exchange.aggregation=striped",
                         "exchange.codec=float32"))
    if K == 1:
        np.testing.assert_array_equal(full["params"], ref32)
    else:
        assert_float32_close(full["params"], ref32, ref64)
        pieces = [owner[f"rank{r:04d}/opt/sqr"] for r in range(K)]   # the second moment
        assert sum(p.size for p in pieces) == full["opt/sqr"].size
    assert_float32_close(owner["params"], ref32, ref64)
    assert not np.array_equal(full["params"], arrays(train(K, arch, tmp_path_factory))["params"])


def resumed_mid_run(arch, tmp_path, tmp_path_factory, extra, keep=None):
    """A 2-rank run of `extra` (2 epochs) stopped half-way through its second epoch and
    resumed to the end: (the uninterrupted run's arrays, the resumed run's); `keep`: a
    directory to copy the stopped run to."""
    full = arrays(train(2, arch, tmp_path_factory, *extra))
    cut = str(tmp_path / "cut")
    total = json.load(open(os.path.join(arch, "index.json")))["total_frames"]
    for stop in (f"train.stop_after_frames={total * 3 // 2}", "train.stop_after_frames=0"):
        proc = run_train(2, options(arch, f"train.run_dir={cut}", *extra, stop), timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if keep and stop.endswith(f"={total * 3 // 2}"):
            shutil.copytree(cut, keep)
    resumed = arrays(cut)
    assert set(full) == set(resumed)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)
    return full, resumed


def test_one_bit_adam_at_the_owner_resumes_bit_exactly(arch, tmp_path, tmp_path_factory):
    extra = (*ADAM, "exchange.aggregation=striped", "exchange.codec=onebit", "train.epochs=2")
    full, _ = resumed_mid_run(arch, tmp_path, tmp_path_factory, extra)
    assert full["opt/adam_p"] > 0


@pytest.mark.parametrize("double_buffering", ["false", "true"])
def test_adams_second_moment_frozen_at_the_cold_starts_end(double_buffering, arch, tmp_path,
                                                           tmp_path_factory):
    """optim.adam_freeze_variance (1-bit Adam's rule): the float32 warm-up learns Adam's
    second moment, the 1-bit phase leaves it as it was at the cold start's end (each owner's
    stripe of it), while the first moment and the weights go on; a run resumed in the 1-bit
    phase is bit exact."""
    F = cold_frames(arch)
    extra = (*ADAM, "exchange.aggregation=striped", "exchange.codec=onebit",
             f"exchange.cold_start_frames={F}", f"exchange.double_buffering={double_buffering}",
             "train.epochs=2")
    freeze = (*extra, "optim.adam_freeze_variance=true")
    at_end = arrays(train(2, arch, tmp_path_factory, *freeze, f"train.stop_after_frames={F}"))
    full_run = train(2, arch, tmp_path_factory, *freeze)
    full, moving = arrays(full_run), arrays(train(2, arch, tmp_path_factory, *extra))
    for r in range(2):
        sqr = f"rank{r:04d}/opt/sqr"
        np.testing.assert_array_equal(full[sqr], at_end[sqr], err_msg=sqr)
        assert not np.array_equal(moving[sqr], at_end[sqr])
        assert not np.array_equal(full[f"rank{r:04d}/opt/velocity"],
                                  at_end[f"rank{r:04d}/opt/velocity"])
    assert full["opt/sqr_weight"] == at_end["opt/sqr_weight"] < moving["opt/sqr_weight"]
    assert not np.array_equal(full["params"], moving["params"])
    assert "Adam's second moment frozen" in open(
        os.path.join(full_run, "logs", "rank0000.log")).read()
    cut = str(tmp_path / "cut")
    for last in (f"train.stop_after_frames={F + F // 2}", "train.stop_after_frames=0"):
        proc = run_train(2, options(arch, f"train.run_dir={cut}", *freeze, last), timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = arrays(cut)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)


# --- Adam's second moment on each rank's own gradient (optim.adam_variance=local) ---------------

LOCAL = (*ADAM, "optim.adam_variance=local")


@pytest.mark.parametrize("K", [2, 3])
def test_adam_with_local_second_moments_equals_the_per_rank_reference(K, arch, tmp_path,
                                                                      tmp_path_factory):
    """Each rank divides its own gradient by its own second moment before the exchange; the
    owners (striped float32) or every rank (allreduce) keep the first moment of the sum: the
    per-rank reference (one optimizer per rank in one process) within float32 rounding of its
    float64 trajectory, and not Adam at the owner."""
    ref32 = reference(K, "float", arch, tmp_path, *LOCAL, "--per-rank")["params"]
    ref64 = reference(K, "float", arch, tmp_path, *LOCAL, "--per-rank", float64=True)["params"]
    for extra in ((), ("exchange.aggregation=striped", "exchange.codec=float32")):
        got = arrays(train(K, arch, tmp_path_factory, *LOCAL, *extra))
        assert_float32_close(got["params"], ref32, ref64)
        assert all(got[f"rank{r:04d}/opt/sqr"].size == got["params"].size for r in range(K))
    owner = arrays(train(K, arch, tmp_path_factory, *ADAM))["params"]
    assert np.linalg.norm(owner - ref64) > 100 * np.linalg.norm(ref32 - ref64)


def test_one_bit_adam_with_local_second_moments_resumes_and_moves_to_3_ranks(arch, tmp_path,
                                                                              tmp_path_factory):
    """1-bit SGD with the local second moments and double buffering: a resume mid-epoch is bit
    exact (each rank's own second moment in its file); the same checkpoint resumed on 3
    ranks starts every rank's second moment from the old ranks' mean, and the replicas agree
    at every step after; another optim.adam_variance is refused by name."""
    extra = (*LOCAL, "exchange.aggregation=striped", "exchange.codec=onebit",
             "exchange.double_buffering=true", "train.epochs=2")
    moved = str(tmp_path / "moved")
    resumed_mid_run(arch, tmp_path, tmp_path_factory, extra, keep=moved)
    mid = arrays(moved)
    total = json.load(open(os.path.join(arch, "index.json")))["total_frames"]
    assert not np.array_equal(mid["rank0000/opt/sqr"], mid["rank0001/opt/sqr"])
    # the epoch end: no exchange in flight, which a move to another K refuses
    proc = run_train(2, options(arch, f"train.run_dir={moved}", *extra,
                                f"train.stop_after_frames={total * 2}",
                                "exchange.double_buffering=false"), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run_train(3, options(arch, f"train.run_dir={moved}", *extra, "train.epochs=3",
                                "exchange.double_buffering=false"), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = open(os.path.join(moved, "logs", "rank0002.log")).read()
    assert "local second moment starts from the old ranks' mean" in log
    after = arrays(moved)
    assert np.isfinite(after["params"]).all() and "rank0002/opt/sqr" in after
    proc = run_train(3, options(arch, f"train.run_dir={moved}", *ADAM, "train.epochs=4",
                                "exchange.aggregation=striped", "exchange.codec=onebit"),
                     timeout=120)
    assert proc.returncode != 0 and "optim.adam_variance=local" in proc.stdout + proc.stderr
