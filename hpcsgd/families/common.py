"""What several model families share: the encoder's config rules (tdnn, ctc, rnnt), the
one-line description of a model over an encoder, and the description of its quantization-aware
training. Not a family itself (hpcsgd/families/__init__.py lists those)."""
from hpcsgd.errors import UserError


def check_encoder(config):
    """model.encoder is given, and frame stacking or the Conv2d subsampling comes first."""
    from hpcsgd.model.encoder import parse_spec
    if not config["model.encoder"]:
        raise UserError(f"config key model.encoder: model.type={config['model.type']} needs "
                        f"its encoder's layers, e.g. ['conv 256 k5 s2', 'blstm 320'] "
                        f"(jobs/configs/so762_ctc.yaml)")
    try:
        for k, spec in enumerate(config["model.encoder"]):
            parsed = parse_spec(spec)
            if parsed["kind"] in ("stack", "conv2d") and k:
                raise ValueError(f"encoder layer {spec!r}: frame stacking and the Conv2d "
                                 f"subsampling read the features: the first layer only")
            if parsed.get("chunk") and config["train.device"] != "cpu":
                raise UserError(f"config keys model.encoder and train.device="
                                f"{config['train.device']}: the chunked BLSTM {spec!r} gathers "
                                f"its windows with host indexing, CPU ranks only (yet)")
            if parsed.get("layers", 1) > 1 and (config["qat.weights"] != "none"
                                                 or config["qat.activations"] != "none"):
                raise UserError(f"config keys model.encoder and qat.*: the chunked "
                                f"BLSTM {spec!r} runs {parsed['layers']} BLSTMs inside each "
                                f"window, whose inputs quantization-aware training does not "
                                f"quantize (yet); one layer a window (leave out l"
                                f"{parsed['layers']}) trains with QAT")
    except ValueError as err:
        raise UserError(f"config key model.encoder: {err}") from None


def describe_encoder_model(shape, out):
    """'40-[conv 256 k5 s2, blstm 320 x3]-OUT relu': the activation only where a convolution
    or a dense layer has one."""
    from hpcsgd.model.encoder import describe
    act = any(spec.split()[0] in ("conv", "dense") for spec in shape["encoder"])
    return (f"{shape['input_dim']}-[{describe(shape['encoder'])}]-{out}"
            + (f" {shape['activation']}" if act else "") + describe_qat(shape.get("qat")))


def describe_qat(qat):
    """', QAT weights sawb/4 activations bac/4' (nothing for a float model)."""
    if not qat:
        return ""
    return (f", QAT weights {qat['weights']}/{qat['weight_bits']} activations "
            f"{qat['activations']}/{qat['activation_bits']}")
