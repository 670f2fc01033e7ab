"""Quantization-aware training in the trainer, under a real mpiexec: K ranks against one
process on the same global minibatches, bit-exact resume of the learned clip values with
1-bit SGD, fine-tuning from a float checkpoint with the linear decay, and the integer export
whose evaluation equals the fake-quantized model's."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import TrainerRuns, latest_arrays, make_archive, run_train
from hpcsgd.model.legacy_names import legacy_names
from hpcsgd.model_io import load_model, pack_int4, unpack_int4

# INT4 weights with SAWB, INT4 inputs with learned ranges (the features' start narrow enough
# to clip some: the clips get a gradient from the first step)
QAT = ("qat.weights=sawb", "qat.weight_bits=4", "qat.activations=pact",
       "qat.activation_bits=4", "qat.pact_init=1.0")


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("qat_archive"))
    make_archive(out, num_shards=2, utts_per_shard=8, max_len=200)
    return out


def options(arch, *extra):
    """A tiny DNN, 1 epoch, momentum on, constant lr; every step checks the replicas."""
    return [f"data.train={arch}", "data.context=2", "model.hidden=[24, 16]",
            "train.minibatch=61", "train.epochs=1", "data.block_frames=300",
            "data.buffer_frames=900", "train.log_every_frames=500", "optim.lr=0.005",
            "optim.momentum_tc=300", "schedule.type=constant", "train.check_every_steps=1",
            *extra]


RUNS = TrainerRuns(options, timeout=120)
train, reference, arrays = RUNS.train, RUNS.reference, latest_arrays
CLI = [sys.executable, "-m", "hpcsgd.cli"]
WEIGHTS = ("enc.0.w", "enc.1.w", "out.w")   # the DNN's weight matrices
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


def test_one_rank_equals_the_single_process_reference(arch, tmp_path, tmp_path_factory):
    got = arrays(train(1, arch, tmp_path_factory, *QAT))["params"]
    want = reference(1, "float", arch, tmp_path, *QAT)["params"]
    np.testing.assert_array_equal(got, want)
    float_run = reference(1, "float", arch, tmp_path)["params"]
    assert got.size == float_run.size + 3 * 2   # a learned [lo, hi] per layer input


def test_two_ranks_equal_one_process_adding_their_gradients(arch, tmp_path, tmp_path_factory):
    """At K = 2 the Allreduce adds two gradients: one float32 addition, exactly what the
    reference does with each rank's gradient of its own batch. (Learned and weight-derived
    ranges do not depend on how a minibatch is split; the dynamic MAX/SAWB input ranges do:
    they are each rank's, docs/qat.md.)"""
    got = arrays(train(2, arch, tmp_path_factory, *QAT))["params"]
    want = reference(2, "float", arch, tmp_path, *QAT, "--per-rank")["params"]
    np.testing.assert_array_equal(got, want)


def evaluate(model, arch, tmp_path):
    """`hpcsgd eval MODEL` on the archive: its JSON."""
    js = str(tmp_path / f"eval-{os.path.basename(model)}.json")
    p = subprocess.run(CLI + ["eval", model, "--data", arch, "--json", js], capture_output=True,
                       text=True, env=ENV, timeout=120)
    assert p.returncode == 0, p.stderr
    return json.load(open(js))


def clip_values(run):
    _, params, _ = load_model(run)
    return {name: params[name].copy() for name in params.views if name.startswith("clip_")}


@pytest.mark.parametrize("double_buffering", ["false", "true"])
def test_a_qat_run_with_onebit_sgd_resumes_bit_exactly(double_buffering, arch, tmp_path,
                                                       tmp_path_factory):
    """Learned clips on the weights and inputs, exchanged in float32 beside the 1-bit codec:
    stopped mid-epoch and resumed, the same bits as the uninterrupted run."""
    extra = ("qat.weights=pact", "qat.weight_bits=4", "qat.activations=pact",
             "qat.activation_bits=4", "qat.pact_init=1.0", "exchange.aggregation=striped",
             "exchange.codec=onebit", "train.epochs=2",
             f"exchange.double_buffering={double_buffering}")
    full_run = train(2, arch, tmp_path_factory, *extra)
    full = arrays(full_run)
    cut = str(tmp_path / "cut")
    for stop in ("train.stop_after_frames=400", "train.stop_after_frames=0"):
        proc = run_train(2, options(arch, f"train.run_dir={cut}", *extra, stop),
                         timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    resumed = arrays(cut)
    assert set(full) == set(resumed)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)
    clips = clip_values(full_run)
    assert clips["clip_in0"][0, 1] != 1.0 and clips["clip_enc.0.w"][0, 0] > 0   # they learned


def test_fine_tuning_starts_from_the_float_weights_with_a_linear_decay(arch, tmp_path,
                                                                       tmp_path_factory):
    source = train(1, arch, tmp_path_factory)
    run = str(tmp_path / "tuned")
    proc = run_train(1, options(arch, f"train.run_dir={run}", *QAT,
                                f"train.init_from={source}", "optim.lr=0",
                                "train.stop_after_frames=61"), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(train.init_from): a fresh optimizer and schedule" in \
        open(os.path.join(run, "logs", "rank0000.log")).read()
    _, src, _ = load_model(source)
    _, tuned, _ = load_model(run)
    for name in src.views:   # lr 0: the float weights, unchanged
        np.testing.assert_array_equal(tuned[name], src[name], err_msg=name)
    assert tuned["clip_in0"].tolist() == [[-1.0, 1.0]]
    # the linear decay: lr0 (1 - frames before the step / the run's frames)
    run = str(tmp_path / "linear")
    proc = run_train(1, options(arch, f"train.run_dir={run}", *QAT,
                                f"train.init_from={source}", "schedule.type=linear",
                                "train.epochs=2", "train.log_every_frames=200"),
                     timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    total = 2 * json.load(open(os.path.join(arch, "index.json")))["total_frames"]
    lines = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    steps = [r for r in lines if r["kind"] == "train"]
    assert len(steps) >= 4
    for r in steps:
        assert 0.005 * (1 - r["frames"] / total) - 1e-12 <= r["lr"] \
            <= 0.005 * (1 - (r["frames"] - 61) / total) + 1e-12
    bad = subprocess.run(CLI + ["train"] + options(arch, f"train.run_dir={tmp_path / 'bad'}",
                                                   "model.hidden=[24]",
                                                   f"train.init_from={source}"),
                         capture_output=True, text=True, env=ENV, timeout=120)
    assert bad.returncode == 2
    assert "parameter out.w (24, 5) not in the checkpoint (there: (16, 5))" in bad.stderr


def test_a_sawb_width_without_coefficients_is_a_config_error(arch, tmp_path):
    proc = subprocess.run(CLI + ["train"] + options(arch, f"train.run_dir={tmp_path}",
                                                    "qat.weights=sawb", "qat.weight_bits=5"),
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2 and "SAWB's coefficients are published for [2, 3, 4, 8]" \
        in proc.stderr


def test_int4_codes_pack_two_per_byte():
    codes = np.array([-8, 7, -1, 0, 3, -5, 1], np.int8)
    packed = pack_int4(codes)
    assert packed.dtype == np.uint8 and len(packed) == 4
    assert packed[0] == (0x8 | (0x7 << 4))   # the first value in the low nibble
    np.testing.assert_array_equal(unpack_int4(packed, 7), codes)


def test_an_integer_file_with_the_old_parameter_names_still_loads(arch, tmp_path,
                                                                  tmp_path_factory):
    """A file `hpcsgd export --int4` wrote before the parameters were named by where they live
    (W0, b0, W1 ... clip_W0): the same weights as today's file (hpcsgd/model/legacy_names.py)."""
    run = train(1, arch, tmp_path_factory, *QAT)
    out, old = str(tmp_path / "model.h5"), str(tmp_path / "old.h5")
    proc = subprocess.run(CLI + ["export", run, "--int4", "--out", out], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    model, params, _ = load_model(out)
    legacy = legacy_names(model.layers)
    assert legacy["enc.0.w"] == "W0" and legacy["out.b"] == "b2"
    assert legacy["clip_enc.1.w"] == "clip_W1"
    with h5py.File(out) as f, h5py.File(old, "w") as g:
        g.attrs.update(f.attrs)
        for kind in f:
            for name in f[kind]:
                f.copy(f[kind][name], g, f"{kind}/{legacy.get(name, name)}")
        assert sorted(g["int"]) == ["W0", "W1", "W2"]
    _, again, _ = load_model(old)
    np.testing.assert_array_equal(again.flat, params.flat)


@pytest.mark.parametrize("width", ["--int4", "--int8"])
def test_the_exported_integer_model_evaluates_as_the_fake_quantized_one(width, arch, tmp_path,
                                                                        tmp_path_factory):
    run = train(1, arch, tmp_path_factory, *QAT)
    out = str(tmp_path / "model.h5")
    proc = subprocess.run(CLI + ["export", run, width, "--out", out], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    bits = int(width[-1])
    with h5py.File(out) as f:
        assert f["int/enc.0.w"].dtype == (np.uint8 if bits == 4 else np.int8)
        sizes = [int(np.prod(f[f"int/{w}"].attrs["shape"])) for w in WEIGHTS]
        stored = [f[f"int/{w}"].nbytes for w in WEIGHTS]
        assert sorted(f["float"]) == ["clip_in0", "clip_in1", "clip_in2", "enc.0.b", "enc.1.b",
                                      "out.b"]
    assert sizes == [20 * 24, 24 * 16, 16 * 5]   # 5 spliced frames of 4 features in
    assert stored == [(n + 1) // 2 if bits == 4 else n for n in sizes]
    results = []
    for model in (run, out):
        results.append(evaluate(model, arch, tmp_path))
        h5 = str(tmp_path / f"post{len(results)}")
        p = subprocess.run(CLI + ["infer", model, "--data", arch, "--out", h5, "--format",
                                  "hdf5", "--output", "logpost"],
                           capture_output=True, text=True, env=ENV, timeout=120)
        assert p.returncode == 0, p.stderr
        with h5py.File(h5 + ".h5") as f:
            results[-1]["values"] = f["values"][:]
    # the integer weights s * k are the fake-quantized weights bit for bit: the same outputs
    np.testing.assert_array_equal(results[0].pop("values"), results[1].pop("values"))
    assert results[0]["ce"] == results[1]["ce"]
    assert results[0]["frame_accuracy"] == results[1]["frame_accuracy"]


CHANNEL = ("qat.weights=sawb", "qat.weight_bits=4", "qat.weight_scale=channel",
           "qat.activations=bac", "qat.activation_bits=4", "qat.pact_init=1.0")


def test_a_clip_value_per_output_unit_trains_exports_and_evaluates_as_trained(arch, tmp_path,
                                                                              tmp_path_factory):
    """qat.weight_scale=channel: one rank = the single-process reference bit for bit; the
    export keeps a step per output unit (step/<W>) and evaluates as the checkpoint."""
    run = train(1, arch, tmp_path_factory, *CHANNEL)
    np.testing.assert_array_equal(arrays(run)["params"],
                                  reference(1, "float", arch, tmp_path, *CHANNEL)["params"])
    out = str(tmp_path / "channel.h5")
    proc = subprocess.run(CLI + ["export", run, "--int4", "--out", out], capture_output=True,
                          text=True, env=ENV, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out) as f:
        assert f["step/enc.0.w"].shape == (24,) and len(np.unique(f["step/enc.0.w"][()])) > 1
        assert "step" not in f["int/enc.0.w"].attrs
    results = [evaluate(model, arch, tmp_path) for model in (run, out)]
    assert results[0]["ce"] == results[1]["ce"]
    assert results[0]["frame_accuracy"] == results[1]["frame_accuracy"]
