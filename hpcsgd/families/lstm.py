"""The (B)LSTM frame classifier (model.type lstm): LSTM layers, optional Dense bottlenecks and a
softmax over the archive's labels (model/lstm.py), trained on chunks of data.chunk frames with
their left and right context (data/sequences.py: SequenceLoader). What it shares with the
other frame classifiers is families/hybrid.py's."""
from hpcsgd.families.common import describe_qat
from hpcsgd.families.hybrid import (CRITERION, EVAL_ROWS, FIRST_LAYER_FLOAT,  # noqa: F401
                                    GRAPH_TOPOLOGY, OVERLAP_BLOCKER, SEARCHES, TIMESTAMPS,
                                    UTTERANCES, check_cv,
                                    check_train, cross_validate, divergence, epoch_measures,
                                    evaluate, finish, infer_note, init_from_part, log_data,
                                    model_rows, outputs, posteriors, priors, search, share,
                                    describe_search,
                                    static_meta, training_settings, window_measures)
from hpcsgd.families.hybrid import check_chunk, check_heads

SPLITS = False   # model.parallel: not split (dnn only)
SEQUENCES = True   # a batch is chunks of data.chunk frames, each whole on one rank


def check_config(config):
    """The config rules of an LSTM classifier (config.load calls it)."""
    check_chunk(config)
    check_heads(config)


def make_loader(cfg, grid, rows):
    """Whole chunks; rows: the most frames a step takes."""
    from hpcsgd.families.hybrid import chunk_loader
    return chunk_loader(cfg, grid, rows)


def shape(cfg, loader, qat):
    """The model the config names, as hpcsgd.model.build's arguments (the checkpoint's meta)."""
    return {"type": "lstm", "input_dim": loader.input_dim, "cells": cfg["model.cells"],
            "num_labels": loader.num_labels, "bidirectional": cfg["model.bidirectional"],
            "bottleneck": cfg["model.bottleneck"], "activation": cfg["model.activation"],
            **qat}


def describe(shape):
    """40-BLSTM 320x3-40 (a bottleneck's activation after it)."""
    kind = "BLSTM" if shape["bidirectional"] else "LSTM"
    cells = shape["cells"]
    same = len(set(cells)) == 1
    body = f"{kind} {cells[0]}x{len(cells)}" if same else f"{kind} {'-'.join(map(str, cells))}"
    bottleneck = "".join(f"-{b}" for b in shape["bottleneck"])
    return (f"{shape['input_dim']}-{body}{bottleneck}-{shape['num_labels']}"
            + (f" {shape['activation']}" if shape["bottleneck"] else "")
            + describe_qat(shape.get("qat")))


def data_meta(cfg):
    """How the training sequences were cut (inference and CV use the same)."""
    return {"chunk": cfg["data.chunk"], "left_context": cfg["data.left_context"],
            "right_context": cfg["data.right_context"]}
