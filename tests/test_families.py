"""The model families (hpcsgd/families/): every model.type's module answers the same questions;
an unknown type is refused by name; a checkpoint's meta["model"] of every family (a dnn's
without a "type", as written before there was a choice) resolves to its module; and the shape
a family writes into a checkpoint is the one today's checkpoints hold, key for key and in
order, so they still load."""
import json
from types import SimpleNamespace

import pytest

from hpcsgd import config
from hpcsgd.errors import UserError
from hpcsgd.families import FAMILIES, family, of_model
from hpcsgd.model import build
from hpcsgd.train import describe_model, model_shape

CONSTANTS = ("UTTERANCES", "SPLITS", "SEQUENCES", "FIRST_LAYER_FLOAT", "OVERLAP_BLOCKER",
             "EVAL_ROWS", "CRITERION", "SEARCHES", "TIMESTAMPS", "GRAPH_TOPOLOGY")
FUNCTIONS = ("check_config", "make_loader", "check_cv", "check_train", "model_rows", "shape",
             "describe", "static_meta", "data_meta", "training_settings", "init_from_part",
             "window_measures", "epoch_measures", "divergence", "share", "log_data", "finish",
             "cross_validate", "evaluate", "priors", "outputs", "infer_note", "posteriors",
             "search", "describe_search")


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_family_answers_every_question(name):
    fam = family(name)
    missing = [k for k in CONSTANTS if not hasattr(fam, k)]
    missing += [k for k in FUNCTIONS if not callable(getattr(fam, k, None))]
    assert not missing, f"families/{name}: {missing}"
    assert fam.CRITERION == ("ce" if not fam.UTTERANCES else name)
    assert set(fam.SEARCHES) <= {"graph", "greedy", "beam"}
    # a graph search needs a graph its outputs feed (search.Graph.check_model), and only then
    assert ("graph" in fam.SEARCHES) == (fam.GRAPH_TOPOLOGY is not None)
    assert fam.GRAPH_TOPOLOGY in ("hmm", "ctc", None)
    assert fam.SEQUENCES or not fam.UTTERANCES   # an utterance is one whole sequence


def test_an_unknown_type_is_refused_by_name():
    with pytest.raises(UserError, match="model type 'attention': expected one of dnn, lstm"):
        family("attention")
    with pytest.raises(UserError, match="config key model.type: 'attention' is not one of"):
        config.load(None, ["data.train=x", "model.type=attention"])


# today's checkpoints' meta["model"], as the trainer wrote them before the families (the
# config below, 40 features, 41 labels/tokens)
OLD = {
    "dnn": {"input_dim": 440, "hidden": [64, 64], "num_labels": 41, "activation": "sigmoid"},
    "lstm": {"type": "lstm", "input_dim": 40, "cells": [16], "num_labels": 41,
             "bidirectional": True, "bottleneck": [], "activation": "sigmoid"},
    "tdnn": {"type": "tdnn", "input_dim": 40, "encoder": ["conv 16 k3", "blstm 8"],
             "num_labels": 41, "activation": "relu"},
    "ctc": {"type": "ctc", "input_dim": 40, "encoder": ["stack 3", "blstm 8"],
            "num_tokens": 41, "activation": "relu"},
    "rnnt": {"type": "rnnt", "input_dim": 40, "encoder": ["stack 3", "blstm 8"],
             "num_tokens": 41, "predictor": ["lstm 8"], "embed": 4, "joint": 8,
             "joint_mode": "add", "activation": "relu"},
}
OVERRIDES = {
    "dnn": ["model.hidden=[64,64]"],
    "lstm": ["model.cells=[16]"],
    "tdnn": ["model.encoder=['conv 16 k3', 'blstm 8']", "model.activation=relu"],
    "ctc": ["model.encoder=['stack 3', 'blstm 8']", "model.activation=relu"],
    "rnnt": ["model.encoder=['stack 3', 'blstm 8']", "model.activation=relu",
             "model.predictor=['lstm 8']", "model.embed=4", "model.joint=8"],
}
DESCRIBED = {"dnn": "440-64-64-41 sigmoid", "lstm": "40-BLSTM 16x1-41",
             "tdnn": "40-[conv 16 k3, blstm 8]-41 relu",
             "ctc": "40-[stack 3, blstm 8]-CTC 41",
             "rnnt": "40-[stack 3, blstm 8]-RNN-T[lstm 8, embed 4, joint 8 add] 41"}


def _loader(name):
    """What model_shape reads of a loader: a dnn's input is spliced (+-5 frames)."""
    return SimpleNamespace(input_dim=440 if name == "dnn" else 40, num_labels=41,
                           index={"num_labels": 40})


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_checkpoint_shape_is_todays_and_resolves_to_its_family(name):
    cfg = config.load(None, ["data.train=x", f"model.type={name}"] + OVERRIDES[name])
    shape = model_shape(cfg, _loader(name))
    assert json.dumps(shape) == json.dumps(OLD[name])   # the same keys in the same order
    assert of_model(shape) is FAMILIES[name]
    assert describe_model(shape) == DESCRIBED[name]
    net = build(shape, max_batch=64)
    assert net.num_labels == 41


def test_quantization_and_the_frame_ce_head_keep_their_places_in_the_shape():
    cfg = config.load(None, ["data.train=x", "model.type=ctc", "model.frame_ce=0.5",
                             "qat.weights=sawb", "qat.weight_bits=4"] + OVERRIDES["ctc"])
    shape = model_shape(cfg, _loader("ctc"))
    assert list(shape) == list(OLD["ctc"]) + ["qat", "frame_labels"]
    assert shape["frame_labels"] == 40
    assert describe_model(shape).startswith("40-[stack 3, blstm 8]-CTC 41 + frame CE 40")
    cfg = config.load(None, ["data.train=x", "model.type=rnnt", "qat.weights=sawb"]
                      + OVERRIDES["rnnt"])
    assert config.qat_of(cfg)["first_layer"] == "float"   # auto: the RNN-T family's choice


def test_init_from_takes_a_ctc_encoder_into_an_rnnt_only():
    assert family("rnnt").init_from_part("ctc", "p") == "encoder"
    assert family("rnnt").init_from_part("rnnt", "p") == "all"
    with pytest.raises(UserError, match="a dnn model; an RNN-T starts from a CTC"):
        family("rnnt").init_from_part("dnn", "p")
    assert all(family(n).init_from_part(n, "p") == "all" for n in ("dnn", "lstm", "tdnn", "ctc"))


def test_the_graph_each_family_feeds_and_the_batches_it_takes():
    """What decode's graph check, the builder and the benchmarks ask instead of the type."""
    assert {n: f.GRAPH_TOPOLOGY for n, f in FAMILIES.items()} == \
        {"dnn": "hmm", "lstm": "hmm", "tdnn": "hmm", "ctc": "ctc", "rnnt": None}
    assert [n for n, f in FAMILIES.items() if not f.SEQUENCES] == ["dnn"]
    assert [n for n, f in FAMILIES.items() if f.UTTERANCES] == ["ctc", "rnnt"]


def test_only_the_dnn_splits_and_only_the_transducer_blocks_the_overlap():
    assert [n for n, f in FAMILIES.items() if f.SPLITS] == ["dnn"]
    with pytest.raises(ValueError, match=r"model type 'lstm' is not split yet \(dnn only\)"):
        build(OLD["lstm"], group=SimpleNamespace(size=2))
    with pytest.raises(UserError, match="model.parallel=2 and model.type=lstm: model "
                                        "parallelism needs model.type=dnn"):
        config.load(None, ["data.train=x", "model.type=lstm", "model.parallel=2"])
    cfg = config.load(None, ["data.train=x", "model.type=rnnt"] + OVERRIDES["rnnt"])
    assert "transducer's backward pass" in config.overlap_blocker(cfg)
