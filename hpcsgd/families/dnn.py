"""The DNN frame classifier (model.type dnn, the default; checkpoints from before there was a
choice have no type and are this): spliced frames through Dense layers to a softmax over the
archive's labels (model/dnn.py), trained on shuffled frames (data/loader.py: FrameLoader).
What it shares with the other frame classifiers is families/hybrid.py's."""
from hpcsgd.families.common import describe_qat
from hpcsgd.families.hybrid import (CRITERION, EVAL_ROWS, FIRST_LAYER_FLOAT,  # noqa: F401
                                    GRAPH_TOPOLOGY, OVERLAP_BLOCKER, SEARCHES, TIMESTAMPS,
                                    UTTERANCES, check_cv,
                                    check_train, cross_validate, divergence, epoch_measures,
                                    evaluate, finish, infer_note, init_from_part, log_data,
                                    model_rows, outputs, posteriors, priors, search, share,
                                    describe_search,
                                    static_meta, training_settings, window_measures)
from hpcsgd.families.hybrid import check_heads

SPLITS = True   # model.parallel: its layers split by output columns over a model group
SEQUENCES = False   # a batch is spliced frames, split between the ranks at any frame


def check_config(config):
    """The config rules of a DNN (config.load calls it with the resolved config)."""
    check_heads(config)


def make_loader(cfg, grid, rows):
    """Frames spliced with +-data.context neighbours; rows: the most frames a step takes."""
    from hpcsgd.families.hybrid import frame_loader
    return frame_loader(cfg, grid, rows)


def shape(cfg, loader, qat):
    """The model the config names, as hpcsgd.model.build's arguments: what the checkpoint's
    meta keeps (no "type": the default, as checkpoints written before there was a choice)."""
    return {"input_dim": loader.input_dim, "hidden": cfg["model.hidden"],
            "num_labels": loader.num_labels, "activation": cfg["model.activation"], **qat}


def describe(shape):
    """440-512-512-40 sigmoid."""
    return (f"{shape['input_dim']}-{'-'.join(map(str, shape['hidden']))}-{shape['num_labels']} "
            f"{shape['activation']}") + describe_qat(shape.get("qat"))


def data_meta(cfg):
    """How the features were presented: the splice context and CMVN every checkpoint keeps."""
    return {}
