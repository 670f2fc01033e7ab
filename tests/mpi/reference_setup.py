"""What both single-process reference loops build from a trainer config: K ranks' loaders in
one process (exactly as the K ranks build theirs), the model, initial params and optimizer.

dtype float64 (the references' --float64): the same initial weights (drawn in float32 as the
trainer draws them, then widened), the same float32 frames widened per batch, and every
operation in float64 -- the trajectory the float32 runs approximate, so a test's tolerance is
the distance of the float32 reference to it (tests/conftest.py: assert_float32_close)."""

import numpy as np

from hpcsgd import optim
from hpcsgd.data.loader import FrameLoader, batch_split
from hpcsgd.data.sequences import SequenceLoader
from hpcsgd.data.utterances import PAD_SLACK, Targets, UtteranceLoader
from hpcsgd.families import family
from hpcsgd.model import build as build_model
from hpcsgd.train import model_shape


def float64_flag(argv):
    """--float64 in argv (removed from it): the dtype of the reference."""
    if "--float64" in argv:
        argv.remove("--float64")
        return np.float64
    return np.float32


def batch(x, dtype):
    """The loader's float32 frames, as the reference computes with them."""
    return x if dtype == np.float32 else x.astype(dtype)


def build(cfg, K, dtype=np.float32, local=False):
    """(batch_of, loaders, model, params, opt) for the config `cfg` and K ranks (local: the
    caller keeps a per-rank optimizer state itself)."""
    gb = cfg["train.minibatch"]
    if family(cfg["model.type"]).UTTERANCES:   # K loaders of whole utterances; one batch of all theirs
        steps, batch_of = None, None
        loaders = [UtteranceLoader(cfg["data.train"], r, K, tokens=cfg["data.tokens"],
                                   cmvn=cfg["data.cmvn"], seed=cfg["train.seed"], minibatch=gb,
                                   max_frames=cfg["data.max_frames"],
                                   bucket_frames=cfg["data.bucket_frames"], prefetch=False,
                                   sortagrad=cfg["data.sortagrad"])
                   for r in range(K)]
        rows = int(PAD_SLACK * gb) + int(loaders[0].lengths.max())
    elif cfg["model.type"] == "lstm":   # K sequence loaders; rows = chunks x steps
        chunk = cfg["data.chunk"]
        steps = cfg["data.left_context"] + chunk + cfg["data.right_context"]
        batch_of = batch_split(gb, K, chunk)
        loaders = [SequenceLoader(cfg["data.train"], r, K, chunk=chunk,
                                  left_context=cfg["data.left_context"],
                                  right_context=cfg["data.right_context"], cmvn=cfg["data.cmvn"],
                                  seed=cfg["train.seed"],
                                  max_batch=max(int(batch_of[r]) // chunk * steps, steps),
                                  block_frames=cfg["data.block_frames"],
                                  buffer_frames=cfg["data.buffer_frames"], prefetch=False)
                   for r in range(K)]
        rows = int(batch_of.sum()) // chunk * steps
    else:
        steps = None
        batch_of = batch_split(gb, K)
        loaders = [FrameLoader(cfg["data.train"], r, K, context=cfg["data.context"],
                               cmvn=cfg["data.cmvn"], seed=cfg["train.seed"],
                               max_batch=int(batch_of[r]), block_frames=cfg["data.block_frames"],
                               buffer_frames=cfg["data.buffer_frames"], prefetch=False)
                   for r in range(K)]
        rows = gb
    describe = model_shape(cfg, loaders[0])
    # mixed precision: the float32 reference computes as the trainer does (float16 stores);
    # the float64 one is the exact trajectory both approximate
    precision = cfg["train.precision"] if dtype == np.float32 else "float32"
    model32 = build_model(describe, max_batch=max(rows, 1024), precision=precision)
    model32.steps = steps
    model32.set_dropout(cfg["model.dropout"])
    params = model32.new_params()
    model32.init(params, np.random.default_rng(cfg["train.seed"]))
    model = model32
    if dtype != np.float32:   # the float32 initial weights, widened
        model = build_model(describe, max_batch=max(rows, 1024), dtype=dtype)
        model.steps = steps
        model.set_dropout(cfg["model.dropout"])
        wide = model.new_params()
        wide.flat[:] = params.flat
        params = wide
    opt = optimizer(cfg, params.size, dtype)
    # a second moment per rank (AdaGrad "local", Adam's local variance) is not a quantity of
    # one process's gradient: exchange_reference.py --per-rank keeps one optimizer per rank
    assert not opt.local or local, "a local optimizer state needs the per-rank reference"
    return batch_of, loaders, model, params, opt


def optimizer(cfg, size, dtype=np.float32):
    """The config's optimizer over `size` parameters, its state in `dtype`."""
    opt = optim.from_config(cfg, size)
    if dtype != np.float32:
        opt = optim.Optimizer(size, momentum_time_constant=opt.momentum_time_constant,
                              adagrad=opt.adagrad, adagrad_time_constant=opt.adagrad_time_constant,
                              adagrad_eps=opt.adagrad_eps, weight_decay=opt.weight_decay,
                              dtype=dtype, kind=opt.kind, beta1=opt.beta1, beta2=opt.beta2,
                              adam_eps=opt.adam_eps, adam_variance=opt.adam_variance)
    return opt


def global_steps(cfg, loaders, batch_of):
    """The trainer's steps, in one process: (lr, take, ends_epoch) per step, take[r] being
    rank r's frames, with the epochs, the learning rate and train.stop_after_frames as the
    trainer has them (the loaders started per epoch). ends_epoch: the step finishes its epoch
    and the run goes on (where the double-buffering reference drains the half in flight)."""
    frames, stop = 0, cfg["train.stop_after_frames"]
    for epoch in range(cfg["train.epochs"]):
        rank_frames = loaders[0].epoch_frames(epoch)
        offsets = np.zeros(len(loaders), np.int64)
        for ld in loaders:
            ld.resume(epoch, offsets)
        while (rank_frames - offsets).sum() > 0 and not (stop and frames >= stop):
            # every rank's loader is told the step (whole utterances: each keeps its part)
            take = [ld.take(cfg["train.minibatch"], offsets, rank_frames) for ld in loaders][0]
            lr = optim.learning_rate(cfg["schedule.type"], cfg["optim.lr"], frames, [],
                                     cfg["schedule.step_frames"], cfg["schedule.factor"])
            offsets += take
            frames += int(take.sum())
            yield lr, take, (rank_frames - offsets).sum() == 0 and not (stop and frames >= stop)


def global_batch(loaders, part, dtype):
    """Every rank's next part[r] frames, concatenated in rank order: (x, y). Sequences
    (time-major rows): every rank's chunks side by side at each time step."""
    batches = [ld.next_batch(int(t)) for ld, t in zip(loaders, part)]
    if isinstance(batches[0][1], Targets):   # whole utterances: one batch, longest first
        return merged_utterances(batches, dtype)
    steps = getattr(loaders[0], "steps", None)
    if steps is None:
        x = batch(np.ascontiguousarray(np.concatenate([b[0] for b in batches])), dtype)
        return x, np.concatenate([b[1] for b in batches])
    x = np.concatenate([b[0].reshape(steps, -1, b[0].shape[1]) for b in batches], axis=1)
    y = np.concatenate([b[1].reshape(steps, -1) for b in batches], axis=1)
    return batch(np.ascontiguousarray(x.reshape(-1, x.shape[2])), dtype), y.reshape(-1)


def merged_utterances(batches, dtype):
    """Every rank's utterances as one batch (x, Targets), longest first (ties in rank
    order): what one process computes the summed gradient of all ranks' utterances on."""
    utts = []
    for x, t in batches:
        nb = len(t.frames)
        steps = int(t.frames[0]) if nb else 0
        x_tb = x.reshape(steps, nb, -1) if nb else x
        for b in range(nb):
            utts.append((int(t.frames[b]), x_tb[:t.frames[b], b],
                         t.ids[t.offsets[b]:t.offsets[b + 1]],
                         t.keys[b] if t.keys is not None else 0))
    utts.sort(key=lambda u: -u[0])   # stable: rank order among equal lengths
    frames = np.array([u[0] for u in utts], np.int64)
    steps, dim = (int(frames[0]), utts[0][1].shape[1]) if utts else (0, batches[0][0].shape[1])
    x = np.zeros((steps, len(utts), dim), np.float32)
    for b, (n, feats, _, _) in enumerate(utts):
        x[:n, b] = feats
    offsets = np.concatenate([[0], np.cumsum([len(u[2]) for u in utts])]).astype(np.int64)
    ids = np.concatenate([u[2] for u in utts]) if utts else np.zeros(0, np.int32)
    return (batch(np.ascontiguousarray(x.reshape(-1, dim)), dtype),
            Targets(frames, ids.astype(np.int32), offsets,
                    np.array([u[3] for u in utts], np.uint64)))
