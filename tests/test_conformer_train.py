"""Conformer encoders in the trainer, under a real mpiexec: 2 ranks against one process on the
same global batches, a striped 1-bit run with double buffering and dropout resumed mid-epoch
bit for bit at 2 -> 2 ranks and moved to 3 as docs/training.md says, every trainer feature
that applies running on it, a Conformer-CTC model with the Conv2d front end learning the
bundled real speech with 1-bit SGD on 2 ranks, and what the config refuses with its reason."""
import json
import os

import numpy as np
import pytest

from conftest import (TrainerRuns, assert_float32_close, assert_moves_from_2_to_3_ranks,
                      latest_arrays, make_archive, run_train)
from hpcsgd import checkpoint, config
from hpcsgd.errors import UserError

# a stride-2 convolution in front (the synthetic archive has up to a token per 4 frames: a
# 4x subsampling would leave most utterances without an alignment), then two blocks
ENCODER = "model.encoder=[conv 8 k3 s2, conformer 8 h2 f12 k3, conformer 8 h2 f12 k5 in]"
FRONT = "model.encoder=[conv2d 3 8, conformer 8 h2 f12 k3]"


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("conformer_archive"))
    make_archive(out, num_shards=3, utts_per_shard=10, dim=6, min_len=20, max_len=160,
                 token_kinds=("phones",), num_tokens=9)
    return out


def options(arch, *extra):
    return [f"data.train={arch}", "model.type=ctc", ENCODER, "train.minibatch=900",
            "data.bucket_frames=1800", "train.epochs=1", "train.log_every_frames=1000",
            "optim.lr=0.0005", "optim.momentum_tc=100", "schedule.type=constant",
            "train.check_every_steps=1", *extra]


RUNS = TrainerRuns(options, timeout=240)
train, reference, arrays = RUNS.train, RUNS.reference, latest_arrays


@pytest.mark.parametrize("extra", [(), ("model.dropout=0.3",), (FRONT,)],
                         ids=["plain", "dropout", "conv2d"])
def test_two_ranks_train_what_one_process_does(extra, arch, tmp_path, tmp_path_factory):
    """Each rank's utterances of a step together are the global batch: one process on their
    union gives the same sum of gradients, within float32 rounding of the float64 trajectory
    (the attention, depthwise convolution and instance norm each utterance's own, dropout's
    masks keyed by utterance, wherever it is dealt)."""
    got = arrays(train(2, arch, tmp_path_factory, *extra))["params"]
    assert_float32_close(got, reference(2, "float", arch, tmp_path, *extra)["params"],
                         reference(2, "float", arch, tmp_path, *extra, float64=True)["params"])


@pytest.mark.parametrize("double_buffering", [False, True])
def test_striped_onebit_with_dropout_resumes_bit_exactly_mid_epoch(double_buffering, arch,
                                                                   tmp_path, tmp_path_factory):
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "train.epochs=2",
             "data.specaugment=true", "model.dropout=0.2",
             f"exchange.double_buffering={str(double_buffering).lower()}")
    full = arrays(train(2, arch, tmp_path_factory, *extra))
    cut = str(tmp_path / "cut")
    for stop in ("train.stop_after_frames=1500", "train.stop_after_frames=0"):
        proc = run_train(2, options(arch, f"train.run_dir={cut}", *extra, stop), timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if stop.endswith("=1500"):
            meta = checkpoint.read_meta(checkpoint.latest(cut))
            assert meta["epoch"] == 0 and 0 < sum(meta["offsets"])
    resumed = arrays(cut)
    assert set(full) == set(resumed)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)


def test_a_run_moves_mid_epoch_from_2_to_3_ranks(arch, tmp_path):
    """As docs/training.md promises for another rank count: the rest of the epoch dealt over
    three, every frame trained once, the residuals folded into the new stripes, the replicas
    identical every step."""
    assert_moves_from_2_to_3_ranks(options, arch, tmp_path, timeout=240)


@pytest.mark.parametrize("extra", [
    ("exchange.aggregation=striped", "exchange.codec=onebit", "exchange.cold_start_frames=1000",
     "exchange.double_buffering=true"),
    ("exchange.aggregation=striped", "exchange.codec=kbit", "exchange.bits=mqgrad",
     "exchange.bits_every_steps=2"),
    ("exchange.aggregation=striped", "exchange.codec=dettmers"),
    ("exchange.overlap=true", "exchange.bucket_mb=0"),
    ("train.probe_every_frames=2000", "train.probe_frames=900", "train.probe_max_minibatch=1800"),
    # gradients are sums over the batch's frames: a scale of 64 keeps them in float16
    ("train.precision=mixed", "train.loss_scale=backoff", "train.loss_scale_init=64"),
    ("train.precision=bf16", "train.loss_scale=none", "exchange.aggregation=striped",
     "exchange.codec=onebit"),
    ("qat.weights=sawb", "qat.weight_bits=4", "exchange.aggregation=striped",
     "exchange.codec=onebit"),
    ("qat.weights=sawb", "qat.weight_bits=4", "qat.activations=bac", "qat.activation_bits=4",
     FRONT),
    ("model.type=rnnt", "model.predictor=[lstm 6]", "model.embed=4", "model.joint=8"),
], ids=["onebit_cold_db", "mqgrad", "dettmers", "overlap", "probe", "mixed", "bf16_onebit",
        "qat_weights", "qat_int4", "rnnt"])
def test_trainer_features_run_on_a_conformer(extra, arch, tmp_path):
    """2 ranks, 2 epochs, replicas identical every step, a finite training loss that falls."""
    run = str(tmp_path / "run")
    proc = run_train(2, options(arch, f"train.run_dir={run}", "train.epochs=2", *extra),
                     timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    epochs = [r for r in records if r["kind"] == "epoch"]
    name = "rnnt" if "model.type=rnnt" in extra else "ctc"
    losses = [e[f"train_{name}_per_token"] for e in epochs]
    assert len(epochs) == 2 and all(np.isfinite(losses)), losses
    assert losses[1] < losses[0], losses


def test_config_refuses_what_a_conformer_cannot_do(arch):
    base = [f"data.train={arch}", "model.type=ctc", ENCODER]
    assert config.load(None, base + ["train.device=cuda"])["train.device"] == "cuda"  # GPU ranks
    for extra, words in ((["model.type=tdnn"], "encoder of whole utterances"),
                         (["model.encoder=[conv 8 k3, conformer 8 h3 f12 k3]"],
                          "3 heads do not divide"),
                         (["model.encoder=[conv 8 k3, conformer 8 h2 f12 k4]"], "odd"),
                         (["model.encoder=[conv 8 k3, conv2d 3 8]"], "first layer only")):
        with pytest.raises(UserError, match=words):
            config.load(None, base + extra)


def test_a_kernel_longer_than_every_utterance_is_named(arch, tmp_path):
    """The archive's longest utterance is 155 frames, 78 steps after the stride-2 convolution:
    a depthwise kernel of 81 is refused naming it and the longest that fits (77); one of 41
    warns, naming the utterances shorter than it."""
    long = "model.encoder=[conv 8 k3 s2, conformer 8 h2 f12 k81]"
    proc = run_train(1, options(arch, f"train.run_dir={tmp_path / 'long'}", long))
    assert proc.returncode == 2 and "longer than the longest utterance" in proc.stderr \
        and "(78 steps:" in proc.stderr and "at most 77 (odd)" in proc.stderr, proc.stderr
    run = str(tmp_path / "warn")
    proc = run_train(1, options(arch, f"train.run_dir={run}", "train.stop_after_frames=1",
                                "model.encoder=[conv 8 k3 s2, conformer 8 h2 f12 k41]"))
    assert proc.returncode == 0, proc.stderr
    assert "shorter than the depthwise kernel (41)" in open(
        os.path.join(run, "logs", "rank0000.log")).read()


def test_init_from_a_blstm_encoder_into_a_conformer_is_named(arch, tmp_path, tmp_path_factory):
    blstm = str(tmp_path / "blstm")
    proc = run_train(1, options(arch, f"train.run_dir={blstm}",
                                "model.encoder=[conv 8 k3 s2, blstm 4]"))
    assert proc.returncode == 0, proc.stderr
    proc = run_train(1, options(arch, f"train.run_dir={tmp_path / 'cf'}",
                                f"train.init_from={blstm}"))
    assert proc.returncode == 2, proc.stderr
    assert "its encoder" in proc.stderr and "conformer 8 h2 f12 k3" in proc.stderr, proc.stderr


def test_a_conformer_learns_real_speech_with_onebit_on_two_ranks(demo_tokens, tmp_path):
    """The bundled so762 demo corpus (200 utterances of 40 speakers, phone tokens), the Conv2d
    front end and two blocks with a frame CE head (it leaves CTC's blank plateau in about 6
    epochs here, 10 without), 2 ranks with the striped 1-bit exchange after a float32 cold
    start of 8 epochs, replicas checked every step: the training loss falls by a tenth in the
    1-bit phase, the held-out CTC loss ends well below the first epoch's and held-out phones
    are recognized (one process on Zen 4, float32 throughout: 2.11/token, CV 2.61, 70% token
    errors after 16 epochs)."""
    out = demo_tokens
    frames = json.load(open(os.path.join(out, "train", "index.json")))["total_frames"]
    run = str(tmp_path / "run")
    proc = run_train(2, [f"data.train={out}/train", f"data.cv={out}/cv", f"train.run_dir={run}",
                         "model.type=ctc", "data.tokens=phones",
                         "model.encoder=[conv2d 16 64, conformer 64 h4 f128 k7, "
                         "conformer 64 h4 f128 k7]", "model.frame_ce=0.3",
                         "train.minibatch=2000", "train.epochs=16",
                         "optim.type=adam", "optim.lr=1e-6", "optim.momentum_tc=0",
                         "schedule.type=constant", f"schedule.warmup_frames={frames}",
                         "exchange.aggregation=striped", "exchange.codec=onebit",
                         f"exchange.cold_start_frames={8 * frames}",
                         "train.check_every_steps=1", "train.log_every_frames=1000000"],
                     timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "cold start over" in open(os.path.join(run, "logs", "rank0000.log")).read()
    epochs = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))
              if json.loads(line)["kind"] == "epoch"]
    assert len(epochs) == 16
    train_loss = [e["train_ctc_per_token"] for e in epochs]
    cv_loss = [e["cv_ctc_per_token"] for e in epochs]
    assert train_loss[-1] < 0.9 * train_loss[7], train_loss
    assert cv_loss[-1] < cv_loss[0] - 0.5, cv_loss
    assert epochs[-1]["cv_token_error_rate"] < 0.9, [e["cv_token_error_rate"] for e in epochs]
