"""Acoustic models: parameter specs and flat buffers (flat), layers (layers) over the
element-wise ops of a device (ops, kernels, kernels_cuda), a model as a stack of layers
(network), and the builders of the models the trainer knows (dnn, lstm, tdnn: encoder, ctc,
rnnt: transducer).

    net = build({"type": "dnn", "input_dim": 440, "hidden": [512] * 3, "num_labels": 40,
                 "activation": "sigmoid"}, max_batch=1024)
"""
import numpy as np

from hpcsgd.families import FAMILIES, family


def build(describe, max_batch=1024, device="cpu", precision="float32", dtype=np.float32,
          group=None, max_sequences=None):
    """The Network a checkpoint's or a run's model description names ("type" defaults to
    "dnn": checkpoints written before there was a choice); group: a model-parallel group
    (model.parallel.ModelGroup) to split it over; max_sequences: the most utterances of a
    batch (models of whole utterances: fewer rows in every buffer past a time stride)."""
    from hpcsgd.model.ctc import ctc
    from hpcsgd.model.dnn import dnn
    from hpcsgd.model.encoder import tdnn
    from hpcsgd.model.lstm import lstm
    from hpcsgd.model.transducer import rnnt
    builders = {"dnn": dnn, "lstm": lstm, "tdnn": tdnn, "ctc": ctc, "rnnt": rnnt}
    args = {k: v for k, v in describe.items() if k != "type"}
    kind = describe.get("type", "dnn")
    if kind not in builders:
        raise ValueError(f"model type {kind!r}: expected one of {sorted(builders)}")
    fam, extra = family(kind), {}
    if group is not None and group.size > 1:
        if not fam.SPLITS:
            splits = ", ".join(name for name, f in FAMILIES.items() if f.SPLITS)
            raise ValueError(f"model parallelism: model type {kind!r} is not split yet "
                             f"({splits} only)")
        extra["group"] = group
    if max_sequences and fam.UTTERANCES:
        extra["max_sequences"] = max_sequences
    return builders[kind](**args, max_batch=max_batch, device=device, precision=precision,
                          dtype=dtype, **extra)
