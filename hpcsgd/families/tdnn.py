"""The encoder frame classifier (model.type tdnn): model.encoder's layers (time convolutions,
LSTMs; model/encoder.py) at stride 1 and a softmax over the archive's labels, trained on
chunks as the LSTM classifier (families/lstm.py). What it shares with the other frame
classifiers is families/hybrid.py's."""
from hpcsgd.errors import UserError
from hpcsgd.families.common import check_encoder, describe_encoder_model
from hpcsgd.families.hybrid import (CRITERION, EVAL_ROWS, FIRST_LAYER_FLOAT,  # noqa: F401
                                    GRAPH_TOPOLOGY, OVERLAP_BLOCKER, SEARCHES, TIMESTAMPS,
                                    UTTERANCES, check_cv,
                                    check_train, cross_validate, divergence, epoch_measures,
                                    evaluate, finish, infer_note, init_from_part, log_data,
                                    model_rows, outputs, posteriors, priors, search, share,
                                    describe_search,
                                    static_meta, training_settings, window_measures)
from hpcsgd.families.hybrid import check_chunk, check_heads
from hpcsgd.families.lstm import data_meta, make_loader  # noqa: F401  (chunks, as an LSTM's)

SPLITS = False   # model.parallel: not split (dnn only)
SEQUENCES = True   # a batch is chunks of data.chunk frames (as an LSTM's), each on one rank


def check_config(config):
    """The config rules of an encoder classifier (config.load calls it)."""
    from hpcsgd.model.encoder import parse_spec, time_stride
    check_chunk(config)
    check_encoder(config)
    kinds = {parse_spec(spec)["kind"] for spec in config["model.encoder"]}
    if kinds & {"conv2d", "conformer"}:
        raise UserError(f"config key model.encoder: conv2d and conformer layers are the "
                        f"encoder of whole utterances (the self-attention spans one, the "
                        f"subsampling shortens it): model.type=ctc or rnnt, not "
                        f"{config['model.type']}")
    if time_stride(config["model.encoder"]) != 1:
        raise UserError("config key model.encoder: a tdnn frame classifier keeps every "
                        "frame's label, so its layers need stride 1 (model.type=ctc "
                        "subsamples)")
    check_heads(config)


def shape(cfg, loader, qat):
    """The model the config names, as hpcsgd.model.build's arguments (the checkpoint's meta)."""
    return {"type": "tdnn", "input_dim": loader.input_dim, "encoder": cfg["model.encoder"],
            "num_labels": loader.num_labels, "activation": cfg["model.activation"], **qat}


def describe(shape):
    """40-[conv 256 k5, blstm 320 x3]-40 relu."""
    return describe_encoder_model(shape, str(shape["num_labels"]))
