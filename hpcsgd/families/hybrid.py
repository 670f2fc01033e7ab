"""What the hybrid frame classifiers (dnn, lstm, tdnn: families/dnn.py, lstm.py, tdnn.py) share:
one label per frame from the archive's alignments, trained with cross-entropy, evaluated by
frame accuracy, recognized through an HLG with their outputs divided by the label priors. Not a
family itself; each of the three modules takes what it needs from here.

The heavy modules (loaders, outputs) are imported where used: config.py imports the families,
and `hpcsgd inspect` or `--help-config` should not pay for Numba.
"""
from hpcsgd.errors import UserError

UTTERANCES = False        # frames or chunks, not whole utterances against token sequences
FIRST_LAYER_FLOAT = False   # qat.first_layer=auto: quantized like the rest
OVERLAP_BLOCKER = None    # exchange.overlap: nothing in the model stops it
EVAL_ROWS = 0             # eval, infer, decode: no minimum rows a pass needs
CRITERION = "ce"          # the training sums: [CE, correct frames, frames]
SEARCHES = ("graph",)     # decode: through an HLG (hpcsgd mkgraph)
TIMESTAMPS = False        # decode --ctm: not from a hybrid's path (not built)
GRAPH_TOPOLOGY = "hmm"    # decode --graph: an HLG over the HMM states (mkgraph --topology hmm)


# ---- config -------------------------------------------------------------------------------

def check_heads(config):
    """model.dropout is keyed by utterance, which frames and chunks do not carry; model.frame_ce
    is the CTC model's head: a frame classifier has frame labels already."""
    if config["model.dropout"]:
        raise UserError(f"config key model.dropout: models of whole utterances only "
                        f"(model.type=ctc|rnnt): a mask is a function of "
                        f"the utterance and the position in it, which frame and chunk batches "
                        f"do not carry (model.type={config['model.type']})")
    if config["model.frame_ce"]:
        raise UserError(f"config key model.frame_ce: a head of the CTC model (model.type=ctc); "
                        f"model.type={config['model.type']} trains on frame labels already")


def check_chunk(config):
    """lstm, tdnn: a rank's share of a minibatch holds at least one chunk."""
    if config["train.minibatch"] < config["data.chunk"]:
        raise UserError(f"config key train.minibatch: {config['train.minibatch']} frames is "
                        f"less than one chunk (data.chunk={config['data.chunk']})")


# ---- the loader and the archives ------------------------------------------------------------

def frame_loader(cfg, grid, rows):
    """dnn: frames spliced with +-data.context neighbours; rows: the most frames a step takes."""
    from hpcsgd.data import cmvn as norm
    from hpcsgd.data.loader import FrameLoader, batch_split
    max_local = int(batch_split(rows, grid.data_size)[0])
    return FrameLoader(cfg["data.train"], grid.data_rank, grid.data_size,
                       context=cfg["data.context"], cmvn=norm.of_config(cfg),
                       seed=cfg["train.seed"], max_batch=max_local,
                       block_frames=cfg["data.block_frames"],
                       buffer_frames=cfg["data.buffer_frames"], prefetch=cfg["data.prefetch"])


def chunk_loader(cfg, grid, rows):
    """lstm, tdnn: whole chunks; a batch's rows = chunks x steps."""
    from hpcsgd.data import cmvn as norm
    from hpcsgd.data.loader import batch_split
    from hpcsgd.data.sequences import SequenceLoader
    chunk = cfg["data.chunk"]
    if cfg["train.minibatch"] < grid.data_size * chunk:
        raise UserError(f"config key train.minibatch: {cfg['train.minibatch']} frames is less "
                        f"than one chunk of data.chunk={chunk} frames per rank "
                        f"({grid.data_size} ranks)")
    steps = cfg["data.left_context"] + chunk + cfg["data.right_context"]
    slots = int(batch_split(rows, grid.data_size, chunk)[0])
    return SequenceLoader(cfg["data.train"], grid.data_rank, grid.data_size, chunk=chunk,
                          left_context=cfg["data.left_context"],
                          right_context=cfg["data.right_context"],
                          cmvn=norm.of_config(cfg),
                          seed=cfg["train.seed"], max_batch=slots // chunk * steps,
                          block_frames=cfg["data.block_frames"],
                          buffer_frames=cfg["data.buffer_frames"],
                          prefetch=cfg["data.prefetch"])


def check_cv(cfg, cv_index, loader):
    """The CV archive's labels are the training archive's."""
    if cv_index["label_inventory_hash"] != loader.index["label_inventory_hash"]:
        raise UserError(f"{cfg['data.cv']}: labels differ from the training archive "
                        f"{cfg['data.train']}; prep both with the same labels.txt")


def check_train(cfg, loader):
    """The training archive has frame labels (it was prepped with --alignments)."""
    if not loader.index["frame_labels"]:
        raise UserError(f"{cfg['data.train']}: an archive without frame labels (prepped "
                        f"without --alignments) trains sequence models only: "
                        f"model.type=ctc or rnnt with data.tokens="
                        f"{', '.join(loader.index['tokens']) or '?'}")


def model_rows(loader):
    """(the rows of the model's buffers, the most sequences of a batch: None, any)."""
    return loader.max_batch, None


def share(minibatch, grid, loader):
    """This rank's share of a minibatch, for the start line."""
    from hpcsgd.data.loader import batch_split
    return f"{batch_split(minibatch, grid.data_size, loader.unit)[grid.data_rank]} here"


# ---- what the checkpoint keeps beside the shape -------------------------------------------

def static_meta(cfg, loader):
    """Nothing beyond the label inventory every checkpoint keeps."""
    return {}


def training_settings(model, cfg):
    """No setting of the output layer's beyond the model's description."""


def init_from_part(theirs, path):
    """train.init_from: a frame classifier takes every weight of a checkpoint of its kind (the
    shape and inventory checks in train.init_from refuse the others)."""
    return "all"


# ---- the sums, their names in the log and metrics, divergence -----------------------------

def window_measures(totals):
    """The log line's and metrics record's measures of a window's sums [CE, correct, frames]."""
    ce, acc = totals[0] / max(totals[2], 1), totals[1] / max(totals[2], 1)
    return {"ce": ce, "frame_accuracy": acc}, f"ce {ce:.4f}  acc {100 * acc:.2f}%"


def epoch_measures(epoch, seconds, totals, cv):
    """The epoch's record entries and line: training CE and accuracy, and CV's."""
    record = {"train_frame_accuracy": totals[1] / max(totals[2], 1)}
    line = (f"epoch {epoch} done in {seconds:.1f} s: train ce "
            f"{totals[0] / max(totals[2], 1):.4f} acc {100 * record['train_frame_accuracy']:.2f}%")
    if cv is not None:
        record.update(cv_ce=cv["ce"], cv_frame_accuracy=cv["frame_accuracy"],
                      cv_majority=cv["majority"])
        line += (f" | cv ce {cv['ce']:.4f} acc {100 * cv['frame_accuracy']:.2f}% "
                 f"(majority class {100 * cv['majority']:.2f}%)")
    return record, line


def divergence(cfg, ce):
    """(the training loss per unit an untrained model has about ln(labels) of, its name,
    the unit)."""
    return ce, "cross-entropy", "frame"


def log_data(log, cfg, loader):
    """Nothing beyond the start line."""


def finish(log, cfg, model):
    """Nothing at the end of training."""


# ---- evaluation: the trainer's cross-validation and `hpcsgd eval` ------------------------

def cross_validate(cfg, model, params, grid, data, heartbeat):
    """The CV archive's sums over the data ranks, and the share of its most frequent label
    (the majority-class baseline)."""
    cv = evaluate(model, params, cfg["data.cv"], data, grid.data_rank, grid.data_size,
                  grid.data, heartbeat)
    cv["majority"] = cv["confusion"].sum(axis=1).max() / max(cv["frames"], 1)
    return cv


def evaluate(model, params, archive_dir, data, rank=0, world=1, comm=None, heartbeat=None):
    """Sums over the whole archive (reduced over ranks): ce, correct, frames, confusion (V, V).
    data: the checkpoint's data meta (context, cmvn; a sequence model's chunk and left/right
    context: evaluated on the chunks it was trained on, every labelled frame once, context
    frames outside). `heartbeat()`, when given, is called per batch (the trainer's watchdog)."""
    import numpy as np

    from hpcsgd.data import BLOCK_FRAMES, archive
    from hpcsgd.data.loader import FrameLoader
    from hpcsgd.data.sequences import SequenceLoader, sequence_steps
    V = model.num_labels
    # blocks small enough that every rank gets one: a CV set may be smaller than K blocks of
    # the default size (the frames are only summed, so block size does not change the result)
    total = archive.read_index(archive_dir)["total_frames"]
    block_frames = min(BLOCK_FRAMES, max(1, total // world))
    cmvn = data   # its cmvn, cmvn_scope and cmvn_stats (hpcsgd/data/cmvn.py)
    if "chunk" in data:
        steps = sequence_steps(data)
        chunk = data["chunk"]
        loader = SequenceLoader(archive_dir, rank, world, chunk=chunk,
                                left_context=data["left_context"],
                                right_context=data["right_context"], cmvn=cmvn, seed=0,
                                max_batch=model.max_batch, block_frames=block_frames)
        take = model.max_batch // steps * chunk    # frame slots of whole chunks
    else:
        loader = FrameLoader(archive_dir, rank, world, context=data["context"], cmvn=cmvn,
                             seed=0, max_batch=model.max_batch, block_frames=block_frames)
        take = model.max_batch
    loader.start_epoch(0)
    ce, confusion = 0.0, np.zeros(V * V, np.int64)
    while loader.remaining:
        if heartbeat is not None:
            heartbeat()
        x, y = loader.next_batch(take)
        n = len(y)
        # a GPU model copies x to its device buffer and its (n, V) log-posteriors back: CE and
        # the confusion counts are summed here on the host, one code for CPU ranks, GPU ranks
        # and the trainer's CV, with NumPy's argmax (first maximum) on both, so that a frame's
        # decision differs between them only where its outputs differ, never by a tie rule
        logp = model.forward(params, x, n)
        keep = np.flatnonzero(y >= 0)     # sequences: not the context and padding
        ce -= float(logp[keep, y[keep]].sum(dtype=np.float64))
        confusion += np.bincount(y[keep].astype(np.int64) * V + logp[keep].argmax(axis=1),
                                 minlength=V * V)
    loader.close()
    sums = np.concatenate([[ce], confusion.astype(np.float64)])
    if comm is not None and world > 1:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)   # cross-rank sync point
    confusion = sums[1:].astype(np.int64).reshape(V, V)
    frames = int(confusion.sum())
    return {"ce": sums[0] / max(frames, 1), "frame_accuracy": np.trace(confusion) / max(frames, 1),
            "frames": frames, "confusion": confusion}


# ---- inference and recognition ---------------------------------------------------------------

def priors(meta):
    """The log label priors a hybrid decoder divides the posteriors by (training frame counts)."""
    from hpcsgd.outputs import log_priors
    return log_priors(meta["label_counts"])


def outputs(model, params, archive_dir, meta, output, whole, rank=0, world=1):
    """`hpcsgd infer`'s (utt, (T, V)) per utterance: log-posteriors, posteriors or scaled
    log-likelihoods; a sequence model in its training chunks or (whole) one sequence per
    utterance."""
    from hpcsgd.outputs import sequence_outputs, utterance_outputs
    data = meta["data"]
    scaled = priors(meta) if output == "loglik" else None
    if model.recurrent:
        return sequence_outputs(model, params, archive_dir, data, output, scaled,
                                whole, rank=rank, world=world)
    return utterance_outputs(model, params, archive_dir, data["context"], data, output,
                             scaled, rank=rank, world=world)


def posteriors(model, params, meta, archive_dir, rank=0, world=1, whole=False):
    """This rank's share of the archive as [(utt, (T, V) log-posteriors)] (archive order), and
    the CPU seconds the acoustic model took (all of this process's threads)."""
    import time
    t0 = time.process_time()
    mine = [(utt, values.copy()) for utt, values in
            outputs(model, params, archive_dir, meta, "logpost", whole, rank, world)]
    return mine, time.process_time() - t0


def search(model, params, outputs, tokens, beam=None, **options):
    """No search without a graph: decode refuses --greedy before it gets here."""
    raise UserError("a hybrid model is recognized through a graph (--graph GRAPH_DIR)")


def infer_note(model, whole):
    """What `hpcsgd infer` says it ran: a sequence model's chunks or whole utterances."""
    if model.recurrent:
        return (f"infer: {'whole utterances' if whole else 'the training chunks'} "
                f"(--sequences {'whole' if whole else 'chunks'})")
    return None


def describe_search(beam, kind):
    return "a graph search"
