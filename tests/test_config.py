"""hpcsgd.config: every option validated once, errors that name the dotted key, YAML and
overrides, the resolved config written back."""
import os
from types import SimpleNamespace

import pytest

from hpcsgd import config
from hpcsgd.errors import UserError


def test_config_errors_name_the_dotted_key(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train: x\noptim:\n  lrr: 0.1\n")
    with pytest.raises(UserError, match=r"unknown config key optim\.lrr.*optim\.lr"):
        config.load(str(path))
    with pytest.raises(UserError, match=r"optim\.lr: expected float"):
        config.load(None, ["data.train=x", "optim.lr=fast"])
    with pytest.raises(UserError, match=r"train\.minibatch: 0 outside"):
        config.load(None, ["data.train=x", "train.minibatch=0"])
    with pytest.raises(UserError, match=r"model\.activation: 'tanh' is not one of"):
        config.load(None, ["data.train=x", "model.activation=tanh"])
    with pytest.raises(UserError, match=r"data\.train: required"):
        config.load(None, [])
    with pytest.raises(UserError, match=r"init_from_part=encoder: .* train\.init_from is not set"):
        config.load(None, ["data.train=x", "model.type=ctc", "train.init_from_part=encoder"])
    cfg = config.load(None, ["data.train=123", "model.hidden=[8, 4]", "optim.lr=1"])
    assert cfg["data.train"] == "123" and cfg["model.hidden"] == [8, 4] and cfg["optim.lr"] == 1.0
    path.write_text("data:\n  train: x\noptim:\n  lr: 2e-6\n")   # YAML 1.1 reads this as a string
    assert config.load(str(path), ["optim.adagrad_eps=1e-9"])["optim.lr"] == 2e-6
    assert config.load(str(path), ["optim.adagrad_eps=1e-9"])["optim.adagrad_eps"] == 1e-9


def test_dump_round_trips_and_describe_lists_every_key(tmp_path):
    cfg = config.load(None, ["data.train=x", "model.hidden=[8, 4]", "exchange.codec=kbit"])
    path = tmp_path / "resolved.yaml"
    path.write_text(config.dump(cfg))
    assert config.load(str(path)) == cfg
    text = config.describe()
    assert all(key in text for key in config.DEFAULTS)


@pytest.mark.parametrize("wrong, meant", [("optim.learning_rate", "optim.lr"),
                                          ("train.batch_size", "train.minibatch"),
                                          ("optim.momentum", "optim.momentum_tc"),
                                          ("exchange.codecs", "exchange.codec"),
                                          ("model.hiden", "model.hidden")])
def test_an_unknown_key_suggests_the_one_meant(wrong, meant):
    with pytest.raises(UserError, match=rf"unknown config key {wrong} \(did you mean {meant}\?\)"):
        config.load(None, ["data.train=x", f"{wrong}=1"])


def test_adam_local_variance_needs_adam_and_no_freeze():
    for extra in ([], ["optim.type=adam", "optim.momentum_tc=0", "optim.adam_freeze_variance=true",
                       "exchange.cold_start_frames=1000"]):
        with pytest.raises(UserError, match="adam_variance=local.*optim.type=adam, and "
                                            "optim.adam_freeze_variance=false"):
            config.load(None, ["data.train=x", "optim.adam_variance=local", *extra])
    cfg = config.load(None, ["data.train=x", "optim.type=adam", "optim.momentum_tc=0",
                             "optim.adam_variance=local"])
    assert cfg["optim.adam_variance"] == "local"
    with pytest.raises(UserError, match="'owner', 'local'|owner.*local"):
        config.load(None, ["data.train=x", "optim.adam_variance=rank"])


def test_adam_freeze_variance_needs_adam_and_a_cold_start():
    for extra in (["optim.type=sgd", "exchange.cold_start_frames=1000"],
                  ["optim.type=adam", "optim.momentum_tc=0"]):
        with pytest.raises(UserError, match="adam_freeze_variance.*optim.type=adam and "
                                            "exchange.cold_start_frames > 0"):
            config.load(None, ["data.train=x", "optim.adam_freeze_variance=true", *extra])
    cfg = config.load(None, ["data.train=x", "optim.type=adam", "optim.momentum_tc=0",
                             "optim.adam_freeze_variance=true",
                             "exchange.cold_start_frames=1000"])
    assert cfg["optim.adam_freeze_variance"] is True


@pytest.mark.parametrize("extra, why", [
    (["exchange.aggregation=striped"], "striped exchange encodes the whole gradient"),
    (["exchange.allreduce_dtype=float16"], "float16 allreduce rounds the whole gradient"),
    (["train.device=cuda"], "GPU ranks sum on NCCL's stream"),
    (["exchange.double_buffering=true"], "double buffering already overlaps"),
    (["train.precision=mixed", "train.loss_scale=backoff"], "mixed precision rounds and unscales"),
    (["train.clip_gradient_norm=1"], "clipping needs the whole local gradient's norm"),
    (["optim.adagrad=local"], "AdaGrad 'local' rescales"),
    (["optim.type=adam", "optim.momentum_tc=0", "optim.adam_variance=local"],
     "Adam's local second moment rescales"),
    (["qat.weights=max"], "quantization-aware training finishes the weight gradients"),
    (["model.parallel=2"], "split model's layers exchange inside the pass"),
    (["model.type=rnnt", "model.encoder=['blstm 8']"], "transducer's backward pass")])
def test_the_overlapped_allreduce_is_refused_where_the_gradient_changes_after_the_pass(
        extra, why):
    """exchange.overlap=true names what stops it; auto (the default) turns it off there."""
    with pytest.raises(UserError, match=rf"exchange\.overlap=true: .*{why}"):
        config.load(None, ["data.train=x", "exchange.overlap=true", *extra])
    cfg = config.load(None, ["data.train=x", *extra])
    assert cfg["exchange.overlap"] == "auto" and config.overlap_blocker(cfg)
    assert config.overlap_blocker(config.load(None, ["data.train=x"])) is None


RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "jobs",
                       "configs")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(RECIPES) if f.endswith(".yaml")))
def test_every_shipped_recipe_validates_and_builds(name):
    """Each jobs/configs recipe passes the config's validation and its model builds, so a typo
    in a key or a layer spec fails here and not an hour into a job; the CTC recipes have the
    sizes docs/results.md reports (so762: 40 fbank features, 39 phones and the blank)."""
    from hpcsgd.model import build
    from hpcsgd.train import model_shape
    cfg = config.load(os.path.join(RECIPES, name))
    archive = SimpleNamespace(input_dim=40, num_labels=40,   # what model_shape reads
                              index={"num_labels": 40})
    net = build(model_shape(cfg, archive), max_batch=64)
    reported = {"so762_ctc.yaml": 3_942_440, "so762_w2l.yaml": 3_399_080,
                "so762_conformer_ctc.yaml": 4_008_736, "so762_conformer_rnnt.yaml": 4_441_592,
                "so762_lstm_streaming_ctc.yaml": 3_979_664,
                "so762_lstm_streaming_rnnt.yaml": 4_463_208,
                "so762_lstm_lookahead_ctc.yaml": 3_867_392,
                "so762_lstm_lookahead_rnnt.yaml": 4_339_672,
                "so762_lstm_chunked_ctc.yaml": 3_988_112,
                "so762_lstm_chunked_rnnt.yaml": 4_474_472}
    assert net.size == reported.get(name, net.size) and net.size > 0


def test_a_chunked_blstm_is_refused_on_cuda_ranks():
    """Its windows are gathered with host indexing: the config names the layer and why."""
    base = ["data.train=x", "model.type=ctc", "model.encoder=[lstm 8, blstm 8 c4 r2]"]
    config.load(None, base)
    with pytest.raises(UserError, match=r"chunked BLSTM 'blstm 8 c4 r2' gathers its windows "
                                        r"with host indexing, CPU ranks only"):
        config.load(None, base + ["train.device=cuda"])


def test_a_chunked_blstm_stack_is_refused_with_qat():
    """BLSTMs inside a window read inputs QAT does not quantize: named, with the way out."""
    base = ["data.train=x", "model.type=ctc", "model.encoder=[lstm 8, blstm 8 c4 r2 l2]"]
    config.load(None, base)
    with pytest.raises(UserError, match=r"'blstm 8 c4 r2 l2' runs 2 BLSTMs inside each window"
                                        r".*leave out l2"):
        config.load(None, base + ["qat.weights=max"])
