"""hpcsgd.config: every option validated once, errors that name the dotted key, YAML and
overrides, the resolved config written back."""
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
