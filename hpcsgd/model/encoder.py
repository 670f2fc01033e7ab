"""The encoder of the sequence models: a list of layer specs -> layers. The CTC model
(model/ctc.py), the RNN-T's encoder and the hybrid (B)LSTM/TDNN (model/lstm.py) take one.

A spec is a short string (the config key model.encoder is a list of them):

    conv F kK [sS] [dD] [ahead] [ln|in]
                          a 1-D convolution of F channels, kernel K, stride S, dilation D
                          (model/conv.py: Conv1d; S and D default to 1), with model.activation;
                          centred, or with `ahead` reading only the (K-1)D frames ahead (a
                          lookahead layer of a streaming encoder: docs/export.md, streaming);
                          `ln`: each output frame layer-normalized over its channels before the
                          activation; `in`: each channel normalized over the utterance's steps
                          (instance norm: batch norm's statistics over one utterance)
    stack K               frame stacking: K consecutive frames as one (subsampling by K; the
                          first layer only)
    blstm H               a bidirectional LSTM layer, H cells per direction (model/lstm.py)
    blstm H cC [rR] [lL]  a BLSTM over chunks of C steps, each read with the R steps after it
                          (R <= C; model/chunked_blstm.py): a streaming encoder's bounded
                          bidirectional context; lL: L BLSTM layers inside each window
    lstm H                a forward LSTM layer
    dense F               a fully connected layer of F units with model.activation
    conv2d C D            the Conformer's front end: two 3x3 stride-2 convolutions of C
                          channels over time x frequency, ReLU, a linear map to D (4x
                          subsampling; the first layer only: model/conformer.py)
    conformer D hH fF kK [ln|in]
                          a Conformer block of width D: H heads of rotary self-attention, a
                          feed-forward width F, a depthwise kernel K, the norm after it a
                          layer norm (default) or an instance norm (model/conformer.py)

    DeepSpeech2-like:  ["conv 256 k5 s2", "blstm 320", "blstm 320", "blstm 320"]
    Wav2Letter-like:   ["conv 256 k11 s2", "conv 256 k11", "conv 256 k13", "conv 512 k17 d2",
                        "conv 512 k1"]   (each with " in" or " ln": normalized)

The output layer (softmax over labels, or CTC over tokens and the blank) is the builder's:
model/ctc.py for CTC, tdnn() below for a hybrid frame classifier over chunks.
"""
import re

import numpy as np

from hpcsgd.model.chunked_blstm import ChunkedBLSTM
from hpcsgd.model.conformer import ConformerBlock, Conv2dSubsampling, check_conformer_sizes
from hpcsgd.model.conv import Conv1d, StackFrames
from hpcsgd.model.layers import Dense, SoftmaxOutput
from hpcsgd.model.lstm import LSTM
from hpcsgd.model.network import Network

KINDS = ("conv", "stack", "blstm", "lstm", "dense", "conv2d", "conformer")
_CONV = re.compile(r"conv (\d+) k(\d+)((?: [sd]\d+)*)( ahead)?(?: (ln|in))?$")
_CONV2D = re.compile(r"conv2d (\d+) (\d+)$")
_CHUNKED = re.compile(r"blstm (\d+) c(\d+)(?: r(\d+))?(?: l(\d+))?$")
_CONFORMER = re.compile(r"conformer (\d+) h(\d+) f(\d+) k(\d+)(?: (ln|in))?$")


def parse_spec(text):
    """One spec string -> {"kind", ...sizes}; ValueError naming the spec and the grammar."""
    words = " ".join(str(text).split())
    conv = _CONV.match(words)
    if conv:
        opts = dict((o[0], int(o[1:])) for o in conv.group(3).split())
        spec = {"kind": "conv", "units": int(conv.group(1)), "kernel": int(conv.group(2)),
                "stride": opts.get("s", 1), "dilation": opts.get("d", 1),
                "ahead": bool(conv.group(4)), "norm": conv.group(5)}
        if min(spec["units"], spec["kernel"], spec["stride"], spec["dilation"]) < 1:
            raise ValueError(f"encoder layer {text!r}: sizes must be >= 1")
        return spec
    conv2d = _CONV2D.match(words)
    if conv2d:
        spec = {"kind": "conv2d", "channels": int(conv2d.group(1)),
                "units": int(conv2d.group(2)), "stride": 4}
        if min(spec["channels"], spec["units"]) < 1:
            raise ValueError(f"encoder layer {text!r}: sizes must be >= 1")
        return spec
    conformer = _CONFORMER.match(words)
    if conformer:
        spec = {"kind": "conformer", "units": int(conformer.group(1)),
                "heads": int(conformer.group(2)), "ff": int(conformer.group(3)),
                "kernel": int(conformer.group(4)), "norm": conformer.group(5) or "ln"}
        if min(spec["units"], spec["heads"], spec["ff"], spec["kernel"]) < 1:
            raise ValueError(f"encoder layer {text!r}: sizes must be >= 1")
        check_conformer_sizes(spec["units"], spec["heads"], spec["kernel"])
        return spec
    chunked = _CHUNKED.match(words)
    if chunked:
        spec = {"kind": "blstm", "units": int(chunked.group(1)), "chunk": int(chunked.group(2)),
                "right": int(chunked.group(3) or 0)}
        if chunked.group(4):   # layers inside each window (default 1: the key left out)
            spec["layers"] = int(chunked.group(4))
        if min(spec["units"], spec["chunk"], spec.get("layers", 1)) < 1 \
                or spec["right"] > spec["chunk"]:
            raise ValueError(f"encoder layer {text!r}: sizes must be >= 1 and the lookahead "
                             f"at most the chunk")
        return spec
    parts = words.split(" ")
    if len(parts) == 2 and parts[0] in ("stack", "blstm", "lstm", "dense") \
            and parts[1].isdigit() and int(parts[1]) >= 1:
        return {"kind": parts[0], "units": int(parts[1])}
    raise ValueError(f"encoder layer {text!r}: expected 'conv F kK [sS] [dD] [ahead] [ln|in]', "
                     f"'stack K', 'blstm H [cC [rR] [lL]]', 'lstm H', 'dense F', 'conv2d C D' or "
                     f"'conformer D hH fF kK [ln|in]' (model/encoder.py)")


def encoder_layers(input_dim, specs, activation="relu"):
    """The layers of the specs over input_dim features -> (layers, their output width).
    Layer k's parameters are named enc.k.* (enc.0.w, enc.3.u_fwd, enc.5.mhsa.qkv.w)."""
    layers, n_in = [], int(input_dim)
    for k, text in enumerate(specs):
        spec = parse_spec(text)
        name = f"enc.{k}"
        kind = spec["kind"]
        if kind == "stack":
            if k:
                raise ValueError(f"encoder layer {text!r}: frame stacking is the first layer "
                                 f"only (it stacks the input frames)")
            layers.append(StackFrames(name, n_in, spec["units"]))
        elif kind == "conv2d":
            if k:
                raise ValueError(f"encoder layer {text!r}: the Conv2d subsampling is the "
                                 f"first layer only (it reads the features as time x "
                                 f"frequency)")
            layers.append(Conv2dSubsampling(name, n_in, spec["channels"], spec["units"]))
        elif kind == "conformer":
            if n_in != spec["units"]:
                raise ValueError(f"encoder layer {text!r}: a Conformer block of width "
                                 f"{spec['units']} reads {n_in} values a frame (the layer "
                                 f"below's output); widths must match (e.g. 'conv2d C "
                                 f"{spec['units']}' in front)")
            layers.append(ConformerBlock(name, k, spec["units"], spec["heads"],
                                         spec["ff"], spec["kernel"], spec["norm"]))
        elif kind == "conv":
            layers.append(Conv1d(name, n_in, spec["units"], spec["kernel"], spec["stride"],
                                 spec["dilation"], activation, spec["norm"], spec["ahead"]))
        elif spec.get("chunk"):
            layers.append(ChunkedBLSTM(name, n_in, spec["units"], spec["chunk"], spec["right"],
                                       spec.get("layers", 1)))
        elif kind in ("blstm", "lstm"):
            layers.append(LSTM(name, n_in, spec["units"], bidirectional=kind == "blstm"))
        else:
            layers.append(Dense(name, n_in, spec["units"], activation))
        n_in = layers[-1].n_out
    return layers, n_in


def time_stride(specs):
    """The encoder's subsampling in time: the product of its strides (and stacking)."""
    total = 1
    for text in specs:
        spec = parse_spec(text)
        total *= spec.get("stride", spec["units"] if spec["kind"] == "stack" else 1)
    return total


def describe(specs):
    """One line: 'conv 256 k5 s2, blstm 320 x3'."""
    parts = []
    for text in (" ".join(str(t).split()) for t in specs):
        if parts and parts[-1][0] == text:
            parts[-1][1] += 1
        else:
            parts.append([text, 1])
    return ", ".join(t if n == 1 else f"{t} x{n}" for t, n in parts)


def tdnn(input_dim, encoder, num_labels, activation="relu", steps=40, max_batch=2560,
         dtype=np.float32, device="cpu", precision="float32", qat=None):
    """A hybrid frame classifier over chunks (model.type tdnn): the encoder's layers (time
    convolutions as Kaldi's TDNN layers, (B)LSTMs) and a softmax over the frame labels,
    trained on the chunks of hpcsgd.data.sequences like the (B)LSTM. Every stride must be 1:
    each frame keeps its label."""
    if time_stride(encoder) != 1:
        raise ValueError(f"model.type tdnn: the encoder {describe(encoder)} subsamples by "
                         f"{time_stride(encoder)}; a frame classifier needs stride 1 (subsampling "
                         f"is for CTC models)")
    layers, n_in = encoder_layers(input_dim, encoder, activation)
    describe_ = {"type": "tdnn", "input_dim": int(input_dim),
                 "encoder": [" ".join(str(e).split()) for e in encoder],
                 "num_labels": int(num_labels), "activation": activation,
                 **({"qat": dict(qat)} if qat else {})}
    return Network(layers + [SoftmaxOutput("out", n_in, num_labels)], max_batch, dtype,
                   device, describe_, precision, steps=steps, qat=qat)
