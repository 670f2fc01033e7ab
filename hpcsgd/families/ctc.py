"""The CTC model (model.type ctc; docs/ctc.md): model.encoder's layers over whole utterances
and a softmax over data.tokens and the blank (model/ctc.py, with its optional frame CE head),
trained with the CTC loss on length-bucketed utterances (data/utterances.py: UtteranceLoader),
evaluated by its loss per token and greedy token error rate, recognized by greedy search or
through a TLG (hpcsgd mkgraph --topology ctc).

The parts every model of whole utterances against token sequences has (the loader, the token
inventory checks, the sums' names, the held-out evaluation around a batch's loss) are here
too, as functions of the criterion's name; families/rnnt.py takes them.

The heavy modules (loaders, kernels, searches) are imported where used: config.py imports the
families, and `hpcsgd inspect` or `--help-config` should not pay for Numba.
"""
from hpcsgd.errors import UserError
from hpcsgd.families.common import check_encoder, describe_encoder_model

UTTERANCES = True         # whole utterances against token sequences, not frame labels
FIRST_LAYER_FLOAT = False   # qat.first_layer=auto: quantized like the rest
OVERLAP_BLOCKER = None    # exchange.overlap: nothing in the model stops it
EVAL_ROWS = 16384         # eval, infer, decode: whole utterances (164 s at 10 ms) and batches
CRITERION = "ctc"         # the training sums: [loss, tokens, frames, utterances skipped]
SEARCHES = ("graph", "greedy")   # decode: through a TLG, or greedy search without a graph
TIMESTAMPS = True    # decode --ctm: word times from the emissions (search(runs=...), Decoder.decode)
SPLITS = False            # model.parallel: not split (dnn only)
SEQUENCES = True          # a batch is whole utterances, each whole on one rank
GRAPH_TOPOLOGY = "ctc"    # decode --graph: a TLG over its tokens (mkgraph --topology ctc)


# ---- config -------------------------------------------------------------------------------

def check_config(config):
    """The config rules of a CTC model (config.load calls it with the resolved config)."""
    check_encoder(config)
    check_utterances(config)


def check_utterances(config):
    """What no model of whole utterances trains with (yet), each refusal saying why."""
    if config["model.parallel"] > 1:
        raise UserError(f"config keys model.parallel and model.type={config['model.type']}: "
                        "model parallelism "
                        "splits the DNN's layers by output columns over a group; a CTC "
                        "encoder's LSTMs would need an all-gather of the hidden state at "
                        "every time step and its convolutions a halo exchange, so it is not "
                        "split: train data-parallel (model.parallel=1)")
    if config["train.cuda_graphs"]:
        raise UserError(f"config keys train.cuda_graphs and model.type={config['model.type']}: "
                        "a batch of whole "
                        "utterances has a new shape (utterances x longest) nearly every "
                        "step, and a CUDA Graph replays one shape; set "
                        "train.cuda_graphs=false")


# ---- the loader and the archives ------------------------------------------------------------

def make_loader(cfg, grid, rows):
    """Whole utterances with their token sequences, length-bucketed; rows: the most frames a
    step takes (the minibatch, or the probe's cap)."""
    from hpcsgd.data import cmvn as norm
    from hpcsgd.data.utterances import SpecAugment, UtteranceLoader
    from hpcsgd.model.encoder import time_stride
    spec = None
    if cfg["data.specaugment"]:
        spec = SpecAugment(cfg["data.specaug_freq_masks"], cfg["data.specaug_freq_width"],
                           cfg["data.specaug_time_masks"], cfg["data.specaug_time_width"],
                           cfg["data.specaug_time_ratio"])
    return UtteranceLoader(cfg["data.train"], grid.data_rank, grid.data_size,
                           tokens=cfg["data.tokens"], cmvn=norm.of_config(cfg),
                           seed=cfg["train.seed"], minibatch=cfg["train.minibatch"],
                           max_minibatch=rows, max_frames=cfg["data.max_frames"],
                           bucket_frames=cfg["data.bucket_frames"], spec=spec,
                           prefetch=cfg["data.prefetch"], sortagrad=cfg["data.sortagrad"],
                           label_stride=time_stride(cfg["model.encoder"])
                           if cfg["model.frame_ce"] else 0)


def check_cv(cfg, cv_index, loader):
    """The CV archive has data.tokens over the training archive's inventory."""
    from hpcsgd.data import archive
    kind = cfg["data.tokens"]
    archive.read_tokens(cfg["data.cv"], kind, cv_index)   # there, and consistent
    if cv_index["tokens"][kind]["inventory_hash"] != \
            loader.index["tokens"][kind]["inventory_hash"]:
        raise UserError(f"{cfg['data.cv']}: its {kind} token inventory differs from the "
                        f"training archive {cfg['data.train']}'s; prep both in one "
                        f"`hpcsgd prep --cv-speakers`, or the held-out set with "
                        f"--token-inventory {cfg['data.train']}")


def check_train(cfg, loader):
    """Nothing beyond the loader's own checks (the archive has data.tokens)."""


def model_rows(loader):
    """(the rows of the model's buffers: the padded rows of the largest batch, the most
    utterances of a batch)."""
    return loader.max_rows, loader.max_sequences


def share(minibatch, grid, loader):
    """This rank's share of a minibatch, for the start line."""
    return "whole utterances, balanced over the ranks"


# ---- the model and what the checkpoint keeps beside it --------------------------------------

def shape(cfg, loader, qat):
    """The model the config names, as hpcsgd.model.build's arguments (the checkpoint's meta)."""
    head = {"frame_labels": int(loader.index["num_labels"])} if cfg["model.frame_ce"] else {}
    return {"type": "ctc", "input_dim": loader.input_dim, "encoder": cfg["model.encoder"],
            "num_tokens": loader.num_labels, "activation": cfg["model.activation"], **qat,
            **head}


def describe(shape):
    """40-[conv 256 k5 s2, blstm 320 x3]-CTC 41 relu (+ frame CE 40: the head)."""
    head = f" + frame CE {shape['frame_labels']}" if shape.get("frame_labels") else ""
    return describe_encoder_model(shape, f"CTC {shape['num_tokens']}{head}")


def static_meta(cfg, loader):
    """The tokens the model outputs: what decode and eval check an archive or graph against."""
    kind = cfg["data.tokens"]
    return {"tokens": {"kind": kind, "symbols": loader.symbols,
                       "inventory_hash": loader.index["tokens"][kind]["inventory_hash"]}}


def data_meta(cfg):
    """Whole utterances of which token kind."""
    return {"tokens": cfg["data.tokens"]}


def training_settings(model, cfg):
    """The frame CE head's weight: a training setting (its size is the model's)."""
    if cfg["model.frame_ce"]:
        model.layers[-1].frame_ce = cfg["model.frame_ce"]


def init_from_part(theirs, path):
    """train.init_from: every weight of a checkpoint of its kind (train.init_from's shape and
    inventory checks refuse the others)."""
    return "all"


# ---- the sums, their names in the log and metrics, divergence -----------------------------

def window_measures(totals, name=CRITERION):
    """The log line's and metrics record's measures of a window's sums [loss, tokens, frames,
    skipped utterances, frame CE, its frames, its hits]: the loss per token, and per frame
    (the divergence check's); the frame CE head's where it trained (model.frame_ce)."""
    ce = totals[0] / max(totals[2], 1)
    measures = {"ce": ce, f"{name}_per_token": totals[0] / max(totals[1], 1),
                "skipped_utterances": int(totals[3])}
    shown = (f"{name} {measures[f'{name}_per_token']:.4f}/token ({ce:.4f}/frame)"
             + (f"  {int(totals[3])} skipped" if totals[3] else ""))
    if totals[5]:   # the frame CE head (model.frame_ce): per output step
        measures.update(frame_ce=totals[4] / totals[5], frame_accuracy=totals[6] / totals[5])
        shown += (f"  frame ce {measures['frame_ce']:.4f} acc "
                  f"{100 * measures['frame_accuracy']:.2f}%")
    return measures, shown


def epoch_measures(epoch, seconds, totals, cv, name=CRITERION):
    """The epoch's record entries and line: the training loss per token, CV's loss and greedy
    token error rate."""
    record = {f"train_{name}_per_token": totals[0] / max(totals[1], 1)}
    line = (f"epoch {epoch} done in {seconds:.1f} s: train {name} "
            f"{record[f'train_{name}_per_token']:.4f}/token")
    if cv is not None:
        record.update({f"cv_{name}_per_token": cv["per_token"]}, cv_ce=cv["per_frame"],
                      cv_token_error_rate=cv["token_error_rate"],
                      cv_skipped_utterances=cv["skipped"])
        line += (f" | cv {name} {cv['per_token']:.4f}/token, greedy token error rate "
                 f"{100 * cv['token_error_rate']:.2f}% [{cv['ins']} ins, {cv['del']} del, "
                 f"{cv['sub']} sub / {cv['tokens']}]")
    return record, line


def divergence(cfg, ce, name=CRITERION):
    """(the training loss per unit an untrained model has about ln(tokens) of -- per OUTPUT
    frame, after the encoder's subsampling --, its name, the unit)."""
    from hpcsgd.model.encoder import time_stride
    return ce * time_stride(cfg["model.encoder"]), f"the {name.upper()} loss", "output frame"


def log_data(log, cfg, loader):
    """The tokens trained, the utterances left out, and those no CTC alignment fits."""
    log_utterances(log, cfg, loader, infeasible=True)


def log_utterances(log, cfg, loader, infeasible):
    """The tokens trained, the utterances left out (data.max_frames) and, with `infeasible`,
    those no CTC alignment fits after the encoder's subsampling (they train with zero loss),
    by name."""
    from hpcsgd.model.encoder import time_stride
    kind, stride = cfg["data.tokens"], time_stride(cfg["model.encoder"])
    tokens = loader.token_lengths()
    frames = loader.lengths[loader.kept]
    log.info(f"{cfg['model.type']}: {len(loader.kept):,} utterances of {kind} tokens "
             f"({loader.num_labels - 1} "
             f"and the blank), {tokens.sum():,} tokens, {frames.sum() / max(tokens.sum(), 1):.1f} "
             f"frames per token before the encoder's {stride}x subsampling; length buckets "
             f"of {loader.bucket_frames:,} frames, at most {loader.max_rows:,} padded rows a "
             f"rank" + (", SpecAugment on" if loader.spec else ""))
    if loader.dropped:
        names = ", ".join(f"{u} ({n})" for u, n in loader.dropped[:5])
        log.info(f"left out {len(loader.dropped)} utterances longer than data.max_frames="
                 f"{cfg['data.max_frames']} frames: {names}"
                 + (" ..." if len(loader.dropped) > 5 else ""))
    check_kernels(cfg, log, loader, stride)
    short = loader.too_short(stride) if infeasible else []
    if short:
        log.info(f"warning: {len(short)} utterances have fewer frames after the {stride}x "
                 f"subsampling than their {kind} tokens need (tokens + repeated neighbours): "
                 f"CTC has no alignment for them, they train with zero loss: "
                 f"{', '.join(short[:5])}{' ...' if len(short) > 5 else ''}")


def check_kernels(cfg, log, loader, stride):
    """A Conformer block's depthwise kernel against the utterances after the subsampling: longer
    than the longest, a configuration mistake (every output reads mostly zeros past the
    utterance: refused, named); longer than some, a warning naming them."""
    import numpy as np

    from hpcsgd.model.encoder import parse_spec
    kernels = [parse_spec(s)["kernel"] for s in cfg["model.encoder"]
               if parse_spec(s)["kind"] == "conformer"]
    if not kernels or not len(loader.kept):
        return
    kernel = max(kernels)
    steps = -(-loader.lengths[loader.kept] // stride)
    if kernel > steps.max():
        raise UserError(f"config key model.encoder: a depthwise kernel of {kernel} steps is "
                        f"longer than the longest utterance of {cfg['data.train']} after the "
                        f"{stride}x subsampling ({int(steps.max())} steps: "
                        f"{loader.utt_ids[loader.kept[int(np.argmax(steps))]]}); use a kernel "
                        f"of at most {int(steps.max()) - 1 + int(steps.max()) % 2} (odd)")
    short = [loader.utt_ids[u] for u, n in zip(loader.kept, steps) if n < kernel]
    if short:
        log.info(f"warning: {len(short)} utterances are shorter than the depthwise kernel "
                 f"({kernel}) after the {stride}x subsampling (the convolution reads zeros past "
                 f"their ends, as for every utterance's edges): {', '.join(short[:5])}"
                 f"{' ...' if len(short) > 5 else ''}")


def finish(log, cfg, model):
    """Nothing at the end of training."""


# ---- evaluation: the trainer's cross-validation and `hpcsgd eval` ------------------------

def cross_validate(cfg, model, params, grid, data, heartbeat):
    """The CV archive's loss and greedy token error rate over the data ranks; its
    `frame_accuracy` (what the newbob schedule compares) 1 - that rate."""
    return with_accuracy(evaluate(model, params, cfg["data.cv"],
                                  data,
                                  grid.data_rank, grid.data_size, grid.data, heartbeat))


def with_accuracy(cv):
    cv["frame_accuracy"] = 1.0 - cv["token_error_rate"]
    return cv


def evaluate(model, params, archive_dir, data, rank=0, world=1, comm=None, heartbeat=None):
    """A CTC model on an archive: its loss from the log-posteriors (model.kernels_ctc) and
    the greedy token error rate (evaluate_utterances), with the names CTC's records and
    scripts have always read ("ctc_per_token", "ctc_per_frame") beside the common ones."""
    result = evaluate_utterances(model, params, archive_dir, data, lambda: _ctc_batch, rank,
                                 world, comm, heartbeat)
    result.update(ctc_per_token=result["per_token"], ctc_per_frame=result["per_frame"])
    return result


def evaluate_utterances(model, params, archive_dir, data, batch_loss, rank=0, world=1,
                        comm=None, heartbeat=None):
    """A model of whole utterances on an archive: its loss and greedy token error rate (edit
    distance to the archive's tokens), summed over the ranks' disjoint utterances.
    batch_loss() -> f(out, lengths, targets) -> (loss sum, utterances skipped, greedy
    hypotheses) of a batch's forward output. data: the checkpoint's data meta (tokens, cmvn).
    -> {"per_token", "per_frame", "token_error_rate", "tokens", "frames", "utterances", "ins",
    "del", "sub", "skipped"}."""
    import numpy as np

    from hpcsgd.data.utterances import UtteranceLoader
    from hpcsgd.decode.score import counts
    loader = UtteranceLoader(archive_dir, rank, world, tokens=data["tokens"],
                             cmvn=data, minibatch=model.max_batch, prefetch=False)
    batch = batch_loss()
    sums = np.zeros(9)   # loss, tokens, frames, utterances, ins, del, sub, skipped, ref
    for utts, x, targets in loader.eval_batches(model.max_batch, model.max_sequences):
        if heartbeat is not None:
            heartbeat()
        lengths = model.out_lengths(len(x), targets.frames)
        out = model.forward(params, x, len(x), lengths=targets.frames)
        loss, skipped, hyps = batch(out, lengths, targets)
        sums[0] += loss
        sums[1] += len(targets.ids)
        sums[2] += targets.frames.sum()
        sums[3] += lengths.nb
        sums[7] += skipped
        for b, hyp in enumerate(hyps):
            ref = targets.ids[targets.offsets[b]:targets.offsets[b + 1]].tolist()
            sums[4:7] += counts(ref, hyp.tolist())[:3]
    loader.close()
    if comm is not None and world > 1:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)   # cross-rank sync point
    tokens = max(sums[1], 1)
    return {"per_token": sums[0] / tokens, "per_frame": sums[0] / max(sums[2], 1),
            "token_error_rate": sums[4:7].sum() / tokens, "tokens": int(sums[1]),
            "frames": int(sums[2]), "utterances": int(sums[3]), "ins": int(sums[4]),
            "del": int(sums[5]), "sub": int(sums[6]), "skipped": int(sums[7])}


def _ctc_batch(logp, lengths, targets):
    """A CTC batch's (loss sum, utterances without an alignment, greedy hypotheses)."""
    import numpy as np

    from hpcsgd.decode.ctc import greedy_search
    from hpcsgd.model import kernels_ctc as KCTC
    nb, frames = lengths.nb, lengths.lengths
    ws = KCTC.workspace_offsets(frames, targets.offsets)
    alpha = np.empty(int(ws[-1]), np.float32)
    loss, feasible = np.empty(nb), np.empty(nb, np.uint8)
    KCTC.ctc_loss_logprobs(logp, nb, frames, targets.ids, targets.offsets, ws, alpha, loss,
                           feasible)
    hyps = [greedy_search(logp[np.arange(frames[b]) * nb + b]) for b in range(nb)]
    return float(loss.sum()), nb - int(feasible.sum()), hyps


# ---- inference and recognition ---------------------------------------------------------------

def priors(meta):
    """None: a CTC model's log-posteriors are searched as they are."""
    return None


def outputs(model, params, archive_dir, meta, output, whole, rank=0, world=1):
    """`hpcsgd infer`'s (utt, (T', V)) log-posteriors or posteriors over the tokens, the blank
    first, at the subsampled frame rate: whole utterances (`whole` changes nothing)."""
    from hpcsgd.outputs import ctc_outputs
    return ctc_outputs(model, params, archive_dir, meta["data"], output, rank, world)


def infer_note(model, whole):
    return None


def posteriors(model, params, meta, archive_dir, rank=0, world=1, whole=False):
    """This rank's share of the archive as [(utt, (T', V) token log-posteriors)], and the CPU
    seconds the acoustic model took (hpcsgd.outputs.ctc_posteriors)."""
    from hpcsgd.outputs import ctc_posteriors
    return ctc_posteriors(model, params, meta, archive_dir, rank=rank, world=world)


def search(model, params, logposts, tokens, beam=None, runs=None, **fusion):
    """CTC greedy search of every utterance -> ({utt: words, or phones for phone tokens},
    search CPU seconds of this thread). runs: a dict to fill with each utterance's emitted
    token runs (hpcsgd/decode/timestamps.py). An LM (`fusion`) is a graph's business here."""
    import time

    import numpy as np

    from hpcsgd.decode import ctc, timestamps
    symbols = np.asarray(tokens["symbols"], dtype=object)
    hyps = {}
    t0 = time.thread_time()
    for utt, logpost in logposts:
        hyps[utt] = ctc.tokens_to_words(symbols[ctc.greedy_search(logpost)], tokens["kind"])
        if runs is not None:
            runs[utt] = timestamps.token_runs(np.asarray(logpost).argmax(axis=1))
    return hyps, time.thread_time() - t0


def describe_search(beam, kind):
    """decode's line for a search without a graph."""
    return (f"CTC greedy search over {kind} tokens (the best token per frame, repeats merged, "
            f"blanks dropped)")
