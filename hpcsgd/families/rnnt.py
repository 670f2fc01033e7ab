"""The RNN-Transducer (model.type rnnt; docs/rnnt.md): the CTC models' encoder, loader and
held-out evaluation (families/ctc.py), a prediction network and a joint (model/transducer.py:
the whole transducer one output layer) trained with the RNN-T loss, recognized by its own
greedy or modified beam search (decode/rnnt.py) -- no graph, no per-frame posteriors.
"""
from hpcsgd.errors import UserError
from hpcsgd.families import ctc
from hpcsgd.families.common import describe_encoder_model
from hpcsgd.families.ctc import (EVAL_ROWS, SEQUENCES, SPLITS, UTTERANCES, check_cv,  # noqa: F401
                                 check_train, data_meta, infer_note, make_loader, model_rows,
                                 priors, share, static_meta, with_accuracy)

FIRST_LAYER_FLOAT = True   # qat.first_layer=auto: float (the INT4 paper's RNN-T recipe)
OVERLAP_BLOCKER = ("the transducer's backward pass does not report its layers as it "
                   "finishes them")   # exchange.overlap
CRITERION = "rnnt"         # the training sums: [loss, tokens, frames, utterances skipped]
SEARCHES = ("greedy", "beam")   # decode: its own searches; a graph weighs per-frame posteriors
TIMESTAMPS = True    # decode --ctm: each token at the frame the search emitted it
GRAPH_TOPOLOGY = None      # decode --graph: none (its searches read the encoder's frames)


# ---- config -------------------------------------------------------------------------------

def check_config(config):
    """The config rules of an RNN-T model (config.load calls it), its prediction network's
    layers among them."""
    from hpcsgd.model.transducer import predictor_layers
    ctc.check_encoder(config)
    try:
        predictor_layers(2, config["model.embed"], config["model.predictor"])
    except ValueError as err:
        raise UserError(f"config key model.predictor: {err}") from None
    if config["model.frame_ce"]:
        raise UserError(f"config key model.frame_ce: a head of the CTC model (model.type=ctc); "
                        f"model.type={config['model.type']} has no such head")
    ctc.check_utterances(config)


# ---- the model and what the checkpoint keeps beside it --------------------------------------

def shape(cfg, loader, qat):
    """The model the config names, as hpcsgd.model.build's arguments (the checkpoint's meta)."""
    return {"type": "rnnt", "input_dim": loader.input_dim, "encoder": cfg["model.encoder"],
            "num_tokens": loader.num_labels, "predictor": cfg["model.predictor"],
            "embed": cfg["model.embed"], "joint": cfg["model.joint"],
            "joint_mode": cfg["model.joint_mode"], "activation": cfg["model.activation"],
            **qat}


def describe(shape):
    """40-[stack 3, blstm 256 x3]-RNN-T[lstm 256, embed 64, joint 256 add] 41."""
    from hpcsgd.model.encoder import describe as encoder_describe
    return describe_encoder_model(
        shape, f"RNN-T[{encoder_describe(shape['predictor'])}, embed {shape['embed']}, "
               f"joint {shape['joint']} {shape['joint_mode']}] {shape['num_tokens']}")


def training_settings(model, cfg):
    """The transducer's training settings (not the model's): FastEmit and the joint's memory."""
    model.layers[-1].fastemit_lambda = cfg["rnnt.fastemit_lambda"]
    model.layers[-1].joint_budget = cfg["rnnt.joint_memory_mb"] << 20


def init_from_part(theirs, path):
    """train.init_from: an RNN-T checkpoint's every weight, or a CTC checkpoint's encoder (the
    prediction and joint networks from their init); nothing of another kind."""
    if theirs == "ctc":
        return "encoder"
    if theirs != "rnnt":
        raise UserError(f"train.init_from {path}: a {theirs} model; an RNN-T "
                        f"starts from a CTC checkpoint's encoder or from an RNN-T checkpoint")
    return "all"


# ---- the sums, their names in the log and metrics, divergence -----------------------------

def window_measures(totals):
    return ctc.window_measures(totals, CRITERION)


def epoch_measures(epoch, seconds, totals, cv):
    return ctc.epoch_measures(epoch, seconds, totals, cv, CRITERION)


def divergence(cfg, ce):
    return ctc.divergence(cfg, ce, CRITERION)


def log_data(log, cfg, loader):
    """The tokens trained and the utterances left out (every alignment a transducer scores
    needs only an output frame and a token: no CTC-style infeasibility to name)."""
    ctc.log_utterances(log, cfg, loader, infeasible=False)


def finish(log, cfg, model):
    """How much memory the joint's largest sub-batch took (rnnt.joint_memory_mb's check)."""
    joint = model.layers[-1]
    log.info(f"rnnt: the joint's largest sub-batch held {joint.high_water / 2**20:.1f} "
             f"MiB of hidden values and logits (rnnt.joint_memory_mb="
             f"{cfg['rnnt.joint_memory_mb']})")


# ---- evaluation: the trainer's cross-validation and `hpcsgd eval` ------------------------

def cross_validate(cfg, model, params, grid, data, heartbeat):
    """The CV archive's RNN-T loss and greedy token error rate over the data ranks; its
    `frame_accuracy` (what the newbob schedule compares) 1 - that rate."""
    return with_accuracy(evaluate(model, params, cfg["data.cv"],
                                  data,
                                  grid.data_rank, grid.data_size, grid.data, heartbeat))


def evaluate(model, params, archive_dir, data, rank=0, world=1, comm=None, heartbeat=None):
    """An RNN-T model on an archive: the transducer's loss and the greedy token error rate
    (ctc.evaluate_utterances)."""
    return ctc.evaluate_utterances(model, params, archive_dir, data,
                                   lambda: _rnnt_batch(model, params), rank, world, comm,
                                   heartbeat)


def _rnnt_batch(model, params):
    """An RNN-T batch's (loss sum, utterances skipped, greedy hypotheses): the transducer's
    loss on the encoder's projection (its gradients go to a scratch buffer, unread)."""
    import numpy as np

    from hpcsgd.decode.rnnt import greedy_search
    from hpcsgd.model.flat import FlatParams
    from hpcsgd.model.transducer import on_host
    layer, weights, ops = on_host(model, params)   # GPU ranks: on the host, weights copied
    scratch = FlatParams(model.specs, model.dtype)

    def batch(enc, lengths, targets):
        enc = np.array(enc)   # the loss overwrites it with its gradient
        hyps = greedy_search(layer, weights, enc, lengths)
        before = layer.skipped
        loss, _ = layer.loss(weights, scratch, enc, targets, ops, 1.0, lengths)
        skipped, layer.skipped = layer.skipped - before, before
        return loss, skipped, hyps
    return batch


# ---- inference and recognition ---------------------------------------------------------------

def outputs(model, params, archive_dir, meta, output, whole, rank=0, world=1):
    """Nothing per frame: `hpcsgd infer` refuses."""
    raise UserError(f"{meta['path']} is an RNN-T model: it has no per-frame posteriors to "
                    f"write (its joint scores a frame only with a token history); "
                    f"recognize with `hpcsgd decode --greedy`")


def posteriors(model, params, meta, archive_dir, rank=0, world=1, whole=False):
    """This rank's share of the archive as [(utt, (T', joint) encoder projections)] -- what
    the searches run the prediction network and the joint over -- and the CPU seconds."""
    from hpcsgd.outputs import ctc_posteriors
    return ctc_posteriors(model, params, meta, archive_dir, rank=rank, world=world)


def search(model, params, encs, tokens, beam=None, lm=None, lm_weight=0.0, bonus=0.0,
           nbest=None, runs=None):
    """RNN-T greedy search, or modified beam search with `beam` hypotheses (hpcsgd.decode.rnnt;
    with a token n-gram `lm`, shallow fusion at lm_weight with a token bonus) of every
    utterance's encoder projection -> ({utt: words, or phones}, search CPU seconds of this
    thread). nbest: a dict to fill with each utterance's [(score, words)] of the final beam,
    best first (beam search only); runs: with each one's emitted tokens as runs of one frame
    (hpcsgd/decode/timestamps.py)."""
    import time

    import numpy as np

    from hpcsgd.decode import ctc as ctc_search
    from hpcsgd.decode import rnnt, timestamps
    from hpcsgd.model.lengths import Lengths
    from hpcsgd.model.transducer import on_host
    symbols = np.asarray(tokens["symbols"], dtype=object)
    words = lambda ids: ctc_search.tokens_to_words(symbols[ids], tokens["kind"])  # noqa: E731
    hyps = {}
    layer, params, _ = on_host(model, params)   # fake-quantized under QAT; GPU: on the host
    t0 = time.thread_time()
    for utt, enc in encs:
        lengths = Lengths([len(enc)])
        emitted = []    # the frame of each emitted token (timestamps)
        if beam:
            ranked = rnnt.beam_search(layer, params, enc, lengths, beam, lm=lm,
                                      lm_weight=lm_weight, bonus=bonus, nbest=beam,
                                      emitted=emitted)[0]
            best = ranked[0][0]
            if nbest is not None:
                nbest[utt] = [(score, words(ys)) for ys, score in ranked]
        else:
            best = rnnt.greedy_search(layer, params, enc, lengths, emitted=emitted)[0]
        hyps[utt] = words(best)
        if runs is not None:
            runs[utt] = timestamps.emission_runs(best, emitted[0])
    return hyps, time.thread_time() - t0


def describe_search(beam, kind):
    """decode's line for its search."""
    from hpcsgd.decode.rnnt import MAX_SYMBOLS
    return ("RNN-T "
            + (f"modified beam search (beam {beam}, at most 1 symbol per frame)" if beam else
               f"greedy search (at most {MAX_SYMBOLS} symbols per frame)")
            + f" over {kind} tokens")
