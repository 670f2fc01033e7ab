"""`hpcsgd train`: the training loop, read top to bottom.

    [mpiexec -n K] hpcsgd train --config run.yaml [key=value ...]

One process per rank does everything (no parameter server). train() below reads: set up,
resume or start, the epochs of steps, finish; the helpers it calls follow it in that order.
The spine, in data-path order: the process grid (hpcsgd/comm/grid.py) -> this rank's data
(the loader shards over the data ranks) -> the model and its parameters -> the exchange, the
optimizer and the step (hpcsgd/step.py: batch -> forward -> backward -> exchange -> update,
double buffering an option of it) -> the training state (hpcsgd/state.py: start, or resume
from a checkpoint) -> epochs of steps, with the between-step decisions (hpcsgd/decisions.py),
metrics, checkpoints and stop signals -> at each epoch end: replica check, cross-validation,
schedule, checkpoint.

All ranks start from the same seed, so replicas are identical, and stay so because every rank
applies the same update bytes; a checksum proves it at every epoch end (every
train.check_every_steps steps if set). Every rank knows every rank's frame count for the epoch
from the index alone, so the loop ends on all ranks at the same step without a vote, and the
global frames of each step are known without communication.
"""
import importlib.metadata
import json
import math
import os
import socket
import subprocess
import sys
import time
import traceback
import zlib
from typing import NamedTuple

import numpy as np

from hpcsgd import checkpoint, config, jit, loss_scale, optim, tensorboard, threads
from hpcsgd.bitwidth import BitWidth
from hpcsgd.comm.exchange import adaptive_bits, cold_start, make_exchange, set_bits, set_cold_start
from hpcsgd.comm.gpu import bind_gpu
from hpcsgd.comm.grid import Grid
from hpcsgd.data import archive
from hpcsgd.data import cmvn as norm
from hpcsgd.decisions import probe_due, probe_minibatch
from hpcsgd.device import assign, to_host
from hpcsgd.errors import UserError
from hpcsgd.families import DEFAULT, family, of_model
from hpcsgd.metrics import RunLog, format_eta, make_run_dir, prepare_run_dir
from hpcsgd.model import build
from hpcsgd.model.encoder import describe as encoder_describe
from hpcsgd.model.flat import FlatParams
from hpcsgd.model.network import ROUNDING
from hpcsgd.model.parallel import ModelGroup, from_whole, group_of, whole_size, whole_specs
from hpcsgd.model_io import load_model
from hpcsgd.shutdown import ABORT_FORWARD_S, StopSignal, Watchdog, agree, gone_peers
from hpcsgd.state import TrainState
from hpcsgd.step import Step, communicate_seconds, gradient_buffers
from hpcsgd.timeline import Timeline

USAGE = """Train an acoustic model: one process per rank under mpiexec or srun (one process
without). Options come from a YAML --config and key=value overrides; --help-config lists every
option with its default and allowed values."""
EXAMPLES = """examples:
  hpcsgd train --config jobs/configs/demo.yaml                       one process
  mpiexec -n 2 python -m mpi4py -m hpcsgd.cli train --config jobs/configs/so762.yaml \\
      exchange.aggregation=striped exchange.codec=onebit             2 ranks, 1-bit exchange
  hpcsgd train --config jobs/configs/demo.yaml train.run_dir=runs/other optim.lr=0.002
  hpcsgd train --help-config
Ctrl-C, SIGTERM or SIGUSR1 write a checkpoint and stop; the same command resumes from it.
Logs, metrics and checkpoints go to train.run_dir; `hpcsgd plot RUN_DIR` draws the curves."""
ADAGRAD_LR_WARN = 1e-4   # a per-sample rate this large is plain SGD's, not AdaGrad's
PACKAGES = ("numpy", "numba", "numba-cuda", "mpi4py", "mpich", "h5py", "pyyaml",
            "kaldi-native-fbank", "soundfile", "kaldiio", "tensorboardX", "cupy-cuda12x",
            "nvidia-nccl-cu12")


def add_arguments(parser):
    parser.add_argument("--config", help="YAML file of options (see --help-config)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="override config keys")
    parser.add_argument("--help-config", action="store_true", help="list every option and exit")


def run(args):
    if args.help_config:
        print(config.describe())
        return 0
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    # SIGUSR1/SIGTERM/SIGINT from here on: every rank checkpoints at the next step and exits
    stop = StopSignal(say=lambda message: report(None, rank, message))
    cfg = None
    try:
        cfg = config.load(args.config, args.overrides)
        code = train(cfg, comm, stop)
        if code:
            # every rank is here (they agreed): end MPI cleanly, so that under
            # `python -m mpi4py` exit 75 stays an exit, not an MPI_Abort(75) that srun
            # reports as killed tasks
            MPI.Finalize()
        return code
    except UserError as err:
        report(cfg, rank, f"error: {err}")
        if world > 1:   # a failing rank ends the job instead of leaving the others waiting,
            time.sleep(ABORT_FORWARD_S)   # once the launcher has had its words to forward
            comm.Abort(2)
        return 2
    except BaseException:
        report(cfg, rank, f"failed:\n{traceback.format_exc()}")
        gone = []
        if cfg is not None and world > 1 and isinstance(sys.exc_info()[1], MPI.Exception):
            # a killed peer's sockets close before its process ends: give it a moment
            deadline = time.monotonic() + 1.0
            while not gone and time.monotonic() < deadline:
                gone = gone_peers(os.path.join(cfg["train.run_dir"], "logs"), rank, world)
                time.sleep(0.05)
        if gone:   # an MPI call fails when a peer dies: say which one
            report(cfg, rank, f"{', '.join(gone)} no longer running: it died or was killed, "
                              f"which is why this rank's MPI call failed")
        if world > 1:
            time.sleep(ABORT_FORWARD_S)
            comm.Abort(1)
        return 1
    finally:
        stop.restore()


def report(cfg, rank, message):
    """A rank's error on stderr, one write per line with the rank in front (lines of ranks
    printing at once stay whole), and in its log file when the run directory is known."""
    lines = [f"hpcsgd train: rank {rank}: {line}" for line in message.rstrip().splitlines()]
    for line in lines:
        os.write(2, (line + "\n").encode())
    if cfg is not None:
        try:
            logs = os.path.join(cfg["train.run_dir"], "logs")
            os.makedirs(logs, exist_ok=True)
            with open(os.path.join(logs, f"rank{rank:04d}.log"), "a") as f:
                f.write("".join(f"[{time.strftime('%H:%M:%S')}] {line}\n" for line in lines))
        except OSError:
            pass


def train(cfg, comm, stop):
    """The spine: set up, resume (or start), the epochs of steps, finish. Returns the exit
    code: 0, or a stop signal's (every rank checkpointed at the same step)."""
    # --- set up: the grid, the run directory and logs, this data rank's share of every
    # global minibatch, the model and its exchange, optimizer and step in the training state
    grid = process_grid(cfg, comm)
    run = open_run(cfg, grid)
    log, watchdog, timeline = run.log, run.watchdog, run.timeline
    loader = open_loader(cfg, grid)
    state, comm_blocking = build_state(cfg, grid, loader, timeline)
    step, progress = state.step, state.progress

    # --- resume from the latest checkpoint, or start fresh ----------------------------------
    resume_or_start(cfg, run, state)
    log_start(log, cfg, grid, loader, state, step.ex)
    # every epoch trains each labelled frame once: the run's frames (the linear schedule's end)
    run_frames = cfg["train.epochs"] * loader.frames_per_epoch
    cold = cold_start(cfg)   # float32 exchange until this frame (0: none)

    # --- epochs of steps, each ending in a replica check, CV and a checkpoint ----------------
    window = Window(log, time.perf_counter(), comm_blocking, state.bitwidth, step.scaler,
                    family(cfg["model.type"]))
    while progress["epoch"] < cfg["train.epochs"]:
        epoch = progress["epoch"]
        rank_frames = loader.epoch_frames(epoch, progress["deal"])
        loader.resume(epoch, progress["offsets"], progress["deal"])
        t_epoch, epoch_sums = time.perf_counter(), np.zeros(3)
        # the epoch's training sums (CE or loss, correct or tokens, frames) over every data
        # rank: those of the steps before a resume come from the checkpoint
        carried = np.array(progress["epoch_sums"], np.float64)

        def epoch_totals():   # collective
            return carried + reduce_sum(grid.data, epoch_sums)
        while (rank_frames - progress["offsets"]).sum() > 0:
            where = f"step {window.steps} (epoch {epoch}, frame {progress['frames']})"
            watchdog.beat(where)
            lr = learning_rate(cfg, progress, run_frames)
            if probe_due(cfg, state):   # a between-step decision (no exchange in flight)
                probe(cfg, run, state, rank_frames, lr)
            # one step: every rank's count is known here, so the loop ends everywhere together
            take = loader.take(state.decisions["minibatch"], progress["offsets"], rank_frames)
            # the exchange's seconds so far: only the adaptive bit width reads them per step
            # (on GPU ranks a read waits for the last phase's event)
            t_step = time.perf_counter()
            t_exchange = sum(step.phases.times.values()) if state.bitwidth else 0.0
            sums = step.run(loader.next_batch, take, grid.data_rank, lr, where)
            state.advance(take)
            frames, before = progress["frames"], progress["frames"] - int(take.sum())
            if cold and before < cold <= frames:
                end_cold_start(cfg, log, state)
            if step.skips:   # loss scaling: a step every rank skipped on an overflow
                log_skips(log, step, progress)
            if state.bitwidth:   # between-step decision: the width of the next T steps
                decide_bits(cfg, state, log, sums, time.perf_counter() - t_step,
                            sum(step.phases.times.values()) - t_exchange)
            window.add(sums, step.model.pop_skipped(), step.model.pop_frame_ce())
            run.compiles.summary()   # once, after the first step compiled most kernels
            epoch_sums += sums
            timeline.end_step()
            # bookkeeping: replica check, log line, checkpoint, stop
            if cfg["train.check_every_steps"] and window.steps % cfg["train.check_every_steps"] == 0:
                check_replicas(grid.data, step.params.flat, window.steps)
            # one small collective: any rank's stop signal, rank 0's clock for the log line
            stop_code, log_due = agree(comm, stop.code, window.due(cfg["train.log_every_seconds"]))
            if log_due or crossed(before, frames, cfg["train.log_every_frames"]):
                log_window(cfg, state, window, rank_frames, lr)
            log.progress(int(sum(progress["offsets"])), int(rank_frames.sum()), f"epoch {epoch}")
            code = checkpoint_or_stop(cfg, run, state, window.steps, stop, stop_code, before,
                                      epoch_totals)
            if code is not None:
                return run.close(code, loader)
        end_of_epoch(cfg, run, state, window.steps, epoch_totals, t_epoch, run_frames)
    return finish(cfg, run, state, window.steps)


def process_grid(cfg, comm):
    """The D x M process grid (hpcsgd/comm/grid.py): M = model.parallel ranks share a model."""
    try:
        return Grid(comm, cfg["model.parallel"])
    except ValueError as err:
        raise UserError(f"config key model.parallel: {err}") from None


class Run(NamedTuple):
    """What every rank opens once for a run: its log, watchdog, timeline, compile notices,
    and the checkpoint it resumes from (None: a fresh start)."""
    log: RunLog
    watchdog: Watchdog
    timeline: Timeline
    compiles: object
    resume: str

    def close(self, code, loader):
        self.compiles.close()
        self.watchdog.stop()
        self.timeline.close()
        loader.close()
        self.log.close()
        return code


def open_run(cfg, grid):
    """The run directory (rank 0 writes the resolved config and versions, and tidies what an
    earlier attempt left: metrics.prepare_run_dir), every rank's log with the threads it
    runs, its watchdog, its timeline, and on GPU ranks the GPU bound to it."""
    run_dir = cfg["train.run_dir"]
    # rank 0 makes it; every rank refuses one that cannot be written, with rank 0's reason
    problem = grid.world.bcast(make_run_dir(run_dir) if grid.rank == 0 else None, root=0)
    if problem:
        raise UserError(problem)
    skipped = []   # auto: newer checkpoints that do not read back whole (collective)
    if cfg["train.resume"] == "auto":
        resume, skipped = checkpoint.newest_intact(run_dir, grid.world)
        if resume is None and skipped:   # every checkpoint: not another run's, but broken
            raise UserError(f"{run_dir}: none of its {len(skipped)} checkpoint(s) reads back "
                            f"whole, so train.resume=auto has nothing to resume:\n"
                            + "".join(f"  skipped {path}: {reason}\n" for path, reason in skipped)
                            + f"copy them back whole, or start afresh: a new train.run_dir, or "
                              f"move {checkpoint.checkpoint_dir(run_dir)} away")
    else:
        resume = None if cfg["train.resume"] == "none" else cfg["train.resume"]
    resume_frames = checkpoint.read_meta(resume)["frames"] if resume else None
    tidied = prepare_run_dir(run_dir, resume_frames, bool(checkpoint.all_checkpoints(run_dir)),
                             modify=grid.rank == 0)
    if grid.rank == 0:
        write_run_info(run_dir, cfg)
    grid.world.Barrier()   # the run directory exists before any rank opens its log
    log = RunLog(run_dir, grid.rank, grid.size)
    if tidied:
        log.info(tidied)
    for path, reason in skipped:
        log.info(f"warning: checkpoint {path} skipped: it does not read back whole ({reason}); "
                 f"resuming from {resume or 'the start'}")
    if grid.rank == 0 and cfg["train.tensorboard"]:   # no other rank imports its library
        log.board = tensorboard.open_board(run_dir, resume_frames, log.info)
    # threads per rank: decided by the CLI before numpy/numba started (hpcsgd/threads.py)
    chosen, message = threads.CHOSEN or threads.choose(cfg["train.threads"], grid.world)
    pools = threads.enforce(chosen)
    log.info(f"threads: {message}; Numba {pools['numba']}, OpenBLAS {pools['blas']}")
    # a dead or stuck peer aborts the job instead of hanging it
    watchdog = Watchdog(cfg["train.watchdog_s"], grid.rank, grid.size, grid.world,
                        os.path.join(run_dir, "logs"), log)
    timeline = Timeline(os.path.join(run_dir, "timeline", f"rank{grid.rank:04d}.json")
                        if cfg["train.timeline"] else None, grid.rank, cfg["train.timeline_steps"])
    if cfg["train.device"] == "cuda":   # one GPU per local rank, before any allocation on one
        gpu, visible = bind_gpu(grid.node_rank)
        log.info(f"GPU {gpu} of {visible} visible ({grid.node_size} rank(s) on this node)")
    return Run(log, watchdog, timeline, jit.announce(log.info), resume)


def open_loader(cfg, grid):
    """This data rank's loader, its batch workspace sized for the largest minibatch the run
    may use (the probe's cap when probing); the CV archive must match its labels."""
    global_batch, cap = cfg["train.minibatch"], cfg["train.probe_max_minibatch"]
    if global_batch < grid.data_size:
        raise UserError(f"config key train.minibatch: {global_batch} frames cannot be split over "
                        f"{grid.data_size} ranks")
    probing = bool(cfg["train.probe_every_frames"])
    if probing and global_batch > cap:
        raise UserError(f"config key train.minibatch: {global_batch} is above "
                        f"train.probe_max_minibatch={cap} (automatic minibatch size)")
    # frames, chunks or whole utterances: the family's loader
    fam = family(cfg["model.type"])
    loader = fam.make_loader(cfg, grid, cap if probing else global_batch)
    if cfg["data.cv"]:
        cv_index = archive.read_index(cfg["data.cv"])
        fam.check_cv(cfg, cv_index, loader)   # its labels or tokens are the training archive's
        if cv_index["feature_dim"] != loader.index["feature_dim"]:
            raise UserError(f"{cfg['data.cv']}: feature dim {cv_index['feature_dim']} differs "
                            f"from the training archive's {loader.index['feature_dim']}")
    fam.check_train(cfg, loader)   # it has what the family trains on (frame labels)
    return loader


def build_state(cfg, grid, loader, timeline):
    """The model and its flat parameter and gradient buffers (named views), the exchange (its
    buffers preallocated), the optimizer, the loss scaler and the step, held by the training
    state with the adaptive bit width's controller; and double buffering's communication
    timed blocking once (the reference that turns the exposed time into an overlap; None
    without)."""
    device, db = cfg["train.device"], cfg["exchange.double_buffering"]
    fam = family(cfg["model.type"])
    shape = model_shape(cfg, loader)
    try:
        # model parallelism: every layer split over this rank's model group
        group = ModelGroup(grid.model, cfg["model.activation_codec"],
                           cfg["model.activation_block"]) if grid.model_size > 1 else None
        rows, sequences = fam.model_rows(loader)   # the largest batch the loader deals
        model = build(shape, max_batch=max(rows, 1024), device=device,
                      precision=cfg["train.precision"], group=group, max_sequences=sequences)
    except ValueError as err:   # a combination the config's per-key checks cannot see
        raise UserError(f"model {describe_model(shape)}: {err}") from None
    model.steps = getattr(loader, "steps", None)   # lstm: the sequence length of a chunk
    if cfg["model.dropout"]:   # a training setting, not the model's: not in its description
        model.set_dropout(cfg["model.dropout"])
    fam.training_settings(model, cfg)   # the output layer's (CTC's frame CE head, RNN-T's)
    if cfg["train.cuda_graphs"]:   # before the first pass: its buffers' stream is set here
        model.use_cuda_graphs()
    params = model.new_params()
    grads = gradient_buffers(model, db)   # double buffering: one in flight, one computing
    ex = make_exchange(cfg, grid.data, params.matrices,   # preallocates every exchange buffer
                       grid.model if grid.model_size > 1 else None)
    comm_blocking = ex.blocking_seconds(grads[1].flat) if db and grid.data_size > 1 else None
    opt = optim.from_config(cfg, params.size, ex.state_size, device)
    scaler = loss_scale.from_config(cfg)   # train.loss_scale: None, or the scale's decision
    step = Step(model, params, grads, opt, ex, db, cfg["exchange.progress"], timeline, device,
                scaler=scaler, clip=cfg["train.clip_gradient_norm"], unit=loader.unit,
                halve=loader.halves)
    state = TrainState(grid, params, opt, ex, step, loader, {
        "model": shape, "label_inventory_hash": loader.index["label_inventory_hash"],
        "data": {"context": loader.context, **norm.of_config(cfg),
                 "feature_dim": loader.feature_dim, **fam.data_meta(cfg)},
        "label_counts": label_counts(loader.index).tolist(), "config": cfg,
        "aggregation": cfg["exchange.aggregation"],
        **fam.static_meta(cfg, loader)})   # tokens: what decode and eval check against
    # the adaptive bit width (exchange.bits = oland_raj | mqgrad): a decision every T steps
    state.bitwidth = BitWidth(cfg, grid.data) if adaptive_bits(cfg) else None
    if state.bitwidth and cfg["exchange.bits"] == "oland_raj":
        ex.norm_sq = 0.0   # the owners sum their stripe's squared gradient norm per step
    return state, comm_blocking


def model_shape(cfg, loader):
    """The model the config names, as the builder's arguments (hpcsgd.model.build): what the
    checkpoint's meta keeps."""
    qat = config.qat_of(cfg)
    return family(cfg["model.type"]).shape(cfg, loader, {"qat": qat} if qat else {})


def resume_or_start(cfg, run, state):
    """The state of the checkpoint run.resume names, or a fresh start: the seed's weights
    (the same on every rank), or train.init_from's; then the cold start's phase
    (exchange.cold_start_frames), a function of the progress, so a resumed run is in the same
    phase."""
    ex, log, model, params = state.ex, run.log, state.step.model, state.params
    if run.resume:
        state.load(run.resume, log)
        log.info(f"resumed from {run.resume}: epoch {state.progress['epoch']}, "
                 f"{state.progress['frames']} frames")
        if state.bitwidth:
            set_bits(ex, cfg, state.bitwidth.bits)
    else:
        model.init(params, np.random.default_rng(cfg["train.seed"]))  # the same on every rank
        if cfg["train.init_from"]:
            source = init_from(model, params, cfg["train.init_from"], state.static,
                               cfg["train.init_from_part"])
            log.info(f"weights from {source} (train.init_from): a fresh optimizer and schedule")
    cold = cold_start(cfg)
    if cold and state.progress["frames"] < cold:
        set_cold_start(ex, cfg, True)
        log.info(f"cold start: the float32 exchange until frame {cold:,}, then "
                 f"{cfg['exchange.codec']} (exchange.cold_start_frames)"
                 + (", Adam's second moment frozen there (optim.adam_freeze_variance)"
                    if cfg["optim.adam_freeze_variance"] else ""))


def init_from(model, params, path, static, part="auto"):
    """Fine-tuning's start: every weight and bias from the checkpoint (or run directory) at
    `path`, by name; the parameters it does not have (learned clip values) start from their
    init on the loaded weights. Its outputs must be this run's: the same label inventory (a
    CTC model: token inventory). An RNN-T model may start from a CTC checkpoint instead: its
    encoder's layers only (the same encoder on the same features; any token inventory), the
    prediction and joint networks from their init; part "encoder" (train.init_from_part) takes
    a CTC or RNN-T checkpoint's encoder likewise for either. Returns the checkpoint's path
    (and what was taken from it, when not everything)."""
    _, source, meta = load_model(path)
    tokens = static.get("tokens")
    # all of it, or (an RNN-T from a CTC checkpoint) its encoder: the family's rule
    theirs_type = meta["model"].get("type", DEFAULT)
    if part == "encoder" and ("encoder" not in model.describe
                              or theirs_type not in ("ctc", "rnnt")):
        raise UserError(f"train.init_from_part encoder: the encoder of a CTC or RNN-T checkpoint "
                        f"for a CTC or RNN-T model; {meta['path']} is a {theirs_type} model, "
                        f"this run a {model.describe.get('type', DEFAULT)} one")
    encoder_only = part == "encoder" or \
        of_model(model.describe).init_from_part(theirs_type, meta["path"]) == "encoder"
    if not encoder_only and "encoder" in model.describe and \
            meta["model"].get("encoder") != model.describe["encoder"]:
        theirs = meta["model"].get("encoder") or []
        raise UserError(f"train.init_from {meta['path']}: its encoder "
                        f"[{encoder_describe(theirs) or meta['model'].get('type', 'dnn')}] is "
                        f"not this model's [{encoder_describe(model.describe['encoder'])}]: "
                        f"its weights have other shapes and names")
    if encoder_only:
        mine = {k: model.describe[k] for k in ("input_dim", "encoder")}
        there = {k: meta["model"].get(k) for k in ("input_dim", "encoder")}
        if mine != there:
            raise UserError(f"train.init_from {meta['path']}: its encoder {there} is not "
                            f"this model's {mine}")
        encoder = {s.name for layer in model.layers[:-1] for s in layer.specs()}
    elif tokens and (meta.get("tokens") or {}).get("inventory_hash") != tokens["inventory_hash"]:
        theirs = meta.get("tokens") or {"kind": "frame labels", "inventory_hash": "-"}
        raise UserError(f"train.init_from {meta['path']}: its outputs are {theirs['kind']} "
                        f"({theirs['inventory_hash']}), this run's {tokens['kind']} tokens "
                        f"({tokens['inventory_hash']}): train.init_from_part=encoder takes "
                        f"its encoder only")
    if not tokens and not encoder_only and (meta.get("tokens") or meta.get(
            "label_inventory_hash") != static["label_inventory_hash"]):
        raise UserError(f"train.init_from {meta['path']}: trained on another label inventory "
                        f"than data.train's")
    # a split model (model.parallel) takes its columns of the whole matrices
    split = group_of(model.layers) is not None
    host = FlatParams(whole_specs(model.layers) if split else model.specs, model.dtype)
    if not split:
        host.flat[:] = to_host(params.flat)
    for spec in (whole_specs(model.layers) if split else model.specs):
        if spec.role == "clip" or (encoder_only and spec.name not in encoder):
            continue
        if spec.name not in source.views or source[spec.name].shape != spec.shape:
            found = source[spec.name].shape if spec.name in source.views else "none"
            raise UserError(f"train.init_from {meta['path']}: parameter {spec.name} "
                            f"{spec.shape} not in the checkpoint (there: {found}); it holds "
                            f"the model {meta['model']}")
        host[spec.name][...] = source[spec.name]
    if model.quant:
        model.quant.init(host.views)
    assign(params.flat, from_whole(model.layers, host.flat, np.empty(params.size, model.dtype))
           if split else host.flat)
    return meta["path"] + (f" (its encoder's layers; {type(model.layers[-1]).__name__}'s "
                           f"weights from their init)" if encoder_only else "")


def probe(cfg, run, state, rank_frames, lr):
    """The automatic minibatch size (hpcsgd/decisions.py): from a snapshot of the state, try
    sizes on the next frames, keep one, restore; logged and recorded. Double buffering's
    exchange in flight completes first."""
    progress = state.progress
    state.step.drain()
    t0 = time.perf_counter()
    record = probe_minibatch(cfg, state, state.step, state.loader, rank_frames, lr,
                             lambda local: reduce_sum(state.grid.data, local), run.watchdog.beat)
    run.timeline.span("probe", t0, time.perf_counter(), chosen=record["chosen"])
    run.log.info(f"minibatch size probe at frame {progress['frames']:,}: "
                 f"{ {int(c): round(v, 4) for c, v in record['criteria'].items()} } "
                 f"-> {record['chosen']} ({record['seconds']:.1f} s)")
    run.log.record("probe", epoch=progress["epoch"], frames=progress["frames"], **record)


def end_cold_start(cfg, log, state):
    """The step crossed exchange.cold_start_frames: the codec from here on, residuals zeroed."""
    progress = state.progress
    state.step.drain()   # the float32 exchange in flight completes first
    set_cold_start(state.ex, cfg, False)
    if cfg["optim.adam_freeze_variance"]:
        state.opt.freeze_variance()
    log.info(f"cold start over at frame {progress['frames']:,}: "
             f"{cfg['exchange.codec']} from here on, residuals zeroed"
             + ("; Adam's second moment frozen" if cfg["optim.adam_freeze_variance"] else ""))
    log.record("cold_start_end", epoch=progress["epoch"], frames=progress["frames"],
               codec=cfg["exchange.codec"])


SKIPS_IN_A_ROW = 100   # overflows no scale cures: a diverged run, or a forward overflow


def log_skips(log, step, progress):
    """Log and record the steps skipped on an overflow; stop a run that does nothing else."""
    for skip in step.skips:
        log.info(f"{skip['where']}: a gradient overflowed float16 on some rank; the step is "
                 f"skipped on every rank, loss scale {skip['scale']:g} -> "
                 f"{skip['new_scale']:g}")
        log.record("skip", epoch=progress["epoch"], frames=progress["frames"],
                   scale=skip["scale"], new_scale=skip["new_scale"])
    step.skips.clear()
    scaler = step.scaler
    if scaler.in_a_row >= SKIPS_IN_A_ROW:
        why = (f"the static scale {scaler.scale:g} is too large for these gradients (they are "
               f"sums over the minibatch's frames); lower train.loss_scale_init, or use "
               f"train.loss_scale=backoff or logmax" if scaler.name == "static" else
               "no scale down to train.loss_scale_min made the gradient finite; lower optim.lr")
        raise UserError(f"the last {scaler.in_a_row} steps all overflowed float16 (loss scale "
                        f"now {scaler.scale:g}, train.loss_scale={scaler.name}): {why}")


def decide_bits(cfg, state, log, sums, seconds, exchange_seconds):
    """Record the step; every T steps the controller's width (the same on every rank). A
    change waits for no exchange in flight: with double buffering that step's exchange is
    completed first (one step without overlap), so encode and decode use one width."""
    bitwidth, ex, step, progress = state.bitwidth, state.ex, state.step, state.progress
    bitwidth.record(sums, ex.norm_sq or 0.0, seconds, exchange_seconds)
    if ex.norm_sq is not None:
        ex.norm_sq = 0.0
    if not bitwidth.due():
        return
    old, new = ex.codec.bits, bitwidth.decide()
    if new != old:
        step.drain()
        set_bits(ex, cfg, new)
        log.info(f"bit width {old} -> {new} at epoch {progress['epoch']}, frame "
                 f"{progress['frames']:,} ({cfg['exchange.bits']})")
        log.record("bits", epoch=progress["epoch"], frames=progress["frames"], bits=new,
                   previous=old)


def log_window(cfg, state, window, rank_frames, lr):
    """The log line and metrics record of the steps since the last line, from their sums over
    the data ranks (the same on every rank, so a diverged run stops on all of them)."""
    progress, step = state.progress, state.step
    totals = reduce_sum(state.grid.data, window.sums)
    check_divergence(cfg, totals, state.loader.num_labels,
                     f"step {window.steps} (epoch {progress['epoch']}, "
                     f"frame {progress['frames']:,})")
    window.line(progress["epoch"], progress, rank_frames, lr, totals, step.phases.pop(),
                step.phases.pop_sent())


def checkpoint_or_stop(cfg, run, state, steps, stop, stop_code, before, epoch_totals):
    """After a step of `before` -> progress frames: a checkpoint every
    train.checkpoint_every_frames; the exit code if the run stops here (train.stop_after_frames,
    or a stop signal on any rank: Slurm's time-limit warning, preemption, Ctrl-C; all ranks
    checkpoint at this same step and the batch script requeues the job), else None.
    epoch_totals(): the epoch's training sums so far (collective), kept in the checkpoint so
    that a resumed epoch reports all of its steps."""
    frames = state.progress["frames"]

    def save():
        state.progress["epoch_sums"] = epoch_totals().tolist()
        return save_checkpoint(cfg, run, state)
    saved = save() if crossed(before, frames, cfg["train.checkpoint_every_frames"]) else None
    if cfg["train.stop_after_frames"] and frames >= cfg["train.stop_after_frames"]:
        saved = saved or save()
        log_clipped(run.log, state.step)
        run.log.info(f"stopping after {frames} frames (train.stop_after_frames)")
        return 0
    if stop_code:
        saved = saved or save()
        code = stop.exit_code(stop_code)
        run.log.info(f"stopping on {stop.received or 'a signal to another rank'} at step "
                     f"{steps}, frame {frames:,}: checkpoint {saved}; exit {code} "
                     f"(run the same command again, or requeue: it resumes from there)")
        return code
    return None


def save_checkpoint(cfg, run, state):
    """A checkpoint of the whole state (collective), timed and logged; returns its path."""
    run.watchdog.beat("checkpoint")
    t0 = time.perf_counter()
    saved = state.save(cfg["train.run_dir"], cfg["train.keep_checkpoints"])
    run.timeline.span("checkpoint", t0, time.perf_counter())
    run.log.info(f"checkpoint {saved}")
    return saved


def end_of_epoch(cfg, run, state, steps, epoch_totals, t_epoch, run_frames):
    """Replicas agree, the epoch's training criterion, cross-validation, the schedule's
    history, a checkpoint."""
    progress, step, grid = state.progress, state.step, state.grid
    epoch = progress["epoch"]
    step.drain()   # double buffering: apply the last half's update before CV
    check_replicas(grid.data, state.params.flat, steps)
    totals = epoch_totals()
    check_divergence(cfg, totals, state.loader.num_labels, f"epoch {epoch} end (step {steps})")
    t0 = time.perf_counter()
    cv = (cross_validate(cfg, step.model, state.params, grid, run.watchdog) if cfg["data.cv"]
          else None)
    run.timeline.span("cross_validation", t0, time.perf_counter())
    log_epoch(run.log, epoch, progress, totals, time.perf_counter() - t_epoch,
              learning_rate(cfg, progress, run_frames), cv, family(cfg["model.type"]))
    log_clipped(run.log, step)
    state.end_epoch(cv["frame_accuracy"] if cv else None)
    save_checkpoint(cfg, run, state)


def finish(cfg, run, state, steps):
    """The last log lines; closes the run (exit code 0)."""
    run_dir = cfg["train.run_dir"]
    if state.bitwidth:
        run.log.info(f"bit width: {state.bitwidth.bits} at the end; the controller took "
                     f"{state.bitwidth.seconds:.4f} s over {steps} steps")
    family(cfg["model.type"]).finish(run.log, cfg, state.step.model)
    run.log.info(f"training done: {state.progress['frames']:,} frames; checkpoints in "
                 f"{checkpoint.checkpoint_dir(run_dir)}; `hpcsgd plot {run_dir}` draws the "
                 f"curves")
    return run.close(0, state.loader)


def describe_model(shape):
    """One line: 440-512-512-40 sigmoid, 40-BLSTM 320x3-40, or
    40-[conv 256 k5 s2, blstm 320 x3]-CTC 41 relu (the family's describe)."""
    return of_model(shape).describe(shape)


def log_start(log, cfg, grid, loader, state, ex):
    minibatch = state.decisions["minibatch"]
    aggregation = cfg["exchange.aggregation"]
    parameters = state.params.size
    if grid.model_size > 1:
        hosts = sorted(set(grid.model.allgather(socket.gethostname())))   # a few names
        if len(hosts) > 1:
            log.info(f"warning: this rank's model group spans {len(hosts)} nodes "
                     f"({', '.join(hosts)}): its activation traffic crosses the network; "
                     f"place the M = {grid.model_size} consecutive ranks of a group on one node "
                     f"(srun --distribution=block, --ntasks-per-node a multiple of M)")
        parameters = whole_size(state.step.model.layers)
        log.info(f"model parallelism: {grid.describe()}; this rank is model rank "
                 f"{grid.model_rank} of data rank {grid.data_rank}, its layers hold "
                 f"{state.params.size:,} of the model's {parameters:,} parameters "
                 f"(model.parallel), activations {cfg['model.activation_codec']} between them")
    fam = family(cfg["model.type"])
    share = fam.share(minibatch, grid, loader)
    log.info(f"{grid.size} rank(s), minibatch {minibatch} ({share}, "
             f"pid {os.getpid()} on {socket.gethostname()}), model "
             f"{describe_model(model_shape(cfg, loader))} ({parameters:,} parameters), "
             f"exchange "
             f"{aggregation}{' + ' + cfg['exchange.codec'] if aggregation == 'striped' else ''} "
             f"on {cfg['train.device']} ({ex.transport}), train "
             f"{loader.index['total_frames']:,} frames ({loader.index['hours']:.2f} h)")
    fam.log_data(log, cfg, loader)   # the utterances and tokens of a model of utterances
    if getattr(ex, "overlap", False):
        mb = ", ".join(f"{(hi - lo) * 4 / 2**20:.3g}" for lo, hi in ex.buckets)
        log.info(f"overlapped allreduce: {len(ex.buckets)} bucket(s) of {mb} MiB, top layer "
                 f"first, each summed as soon as the backward pass finishes it "
                 f"(exchange.overlap, exchange.bucket_mb)")
    if cfg["train.precision"] != "float32" or cfg["train.loss_scale"] != "none":
        scale = state.scaler.scale if state.scaler else None
        fmt = ROUNDING[cfg["train.precision"]]   # None, float16 or bfloat16
        log.info(f"precision {cfg['train.precision']}, loss scaling {cfg['train.loss_scale']}"
                 + (f" (scale {scale:g} now)" if scale is not None else "")
                 + (" (bfloat16 has float32's exponent range: no gradient needs a scale)"
                    if fmt == "bfloat16" else "")
                 + (f"; the float32 master weights and optimizer state are updated, a {fmt} "
                    f"copy computes" if fmt else ""))
    if cfg["train.cuda_graphs"]:
        log.info("CUDA Graphs: each forward+backward shape runs once, is captured, then "
                 "replays as one launch (the minibatch copy, the loss read, the exchange and "
                 "the update stay outside it: hpcsgd/graphs.py)")
    if state.opt.kind == "adam" and state.opt.local:
        log.info("Adam's second moment: each rank's own, of its float32 gradient before the "
                 "exchange, which carries the normalised gradients; the first moment where "
                 "the sum is (optim.adam_variance=local)")
    if cfg["optim.adagrad"] != "off" and cfg["optim.lr"] > ADAGRAD_LR_WARN:
        log.info(f"warning: optim.adagrad={cfg['optim.adagrad']} with optim.lr={cfg['optim.lr']:g}: "
                 f"AdaGrad divides each gradient by its RMS, so its per-sample rate is about 500x "
                 f"smaller than plain SGD's (2e-6 on speechocean762, "
                 f"jobs/configs/so762_adagrad.yaml); this rate will likely diverge")
    log.record("start", world=grid.size, parameters=state.params.size,
               device=cfg["train.device"], transport=ex.transport, config=cfg)


def crossed(before, after, every):
    """Whether a step from `before` to `after` frames crossed a multiple of `every` (0: never)."""
    return bool(every) and after // every != before // every


def cross_validate(cfg, model, params, grid, watchdog):
    """The CV archive's sums over the data ranks (the family's: frame CE and accuracy with the
    majority-class baseline, or a model of utterances' loss and greedy token error rate with
    1 - that rate as its `frame_accuracy`, what the newbob schedule compares)."""
    beat = lambda: watchdog.beat("cross-validation")   # noqa: E731
    fam = family(cfg["model.type"])
    data = {"context": cfg["data.context"], **norm.of_config(cfg), **fam.data_meta(cfg)}
    return fam.cross_validate(cfg, model, params, grid, data, beat)


def log_clipped(log, step):
    """train.clip_gradient_norm: how many of this rank's gradients were clipped since the
    last report (a rate near 1 means the limit, not the data, sets the step size)."""
    if step.clip:
        log.info(f"clipped {step.clipped} of {step.clip_seen} gradients on this rank "
                 f"(train.clip_gradient_norm={step.clip:g} per frame)")
        step.clipped = step.clip_seen = 0


def log_epoch(log, epoch, progress, totals, seconds, lr, cv, fam):
    """The epoch's line and metrics record: the family names its sums (fam.epoch_measures)."""
    record = {"epoch": epoch, "frames": progress["frames"],
              "train_ce": totals[0] / max(totals[2], 1), "seconds": seconds, "lr": lr}
    measures, line = fam.epoch_measures(epoch, seconds, totals, cv)
    record.update(measures)
    log.info(line)
    log.record("epoch", **record)


class Window:
    """The steps between two log lines: this rank's [CE, correct, frames, skipped] sums (a
    CTC model: [CTC loss, tokens, frames, utterances without an alignment], then its frame CE
    head's [CE, frames, hits]: model.frame_ce), the steps of the run so far, and when the
    window began; line() writes the log line and the metrics record and starts the next
    window."""

    def __init__(self, log, t0, comm_blocking, bitwidth, scaler, fam):
        self.log, self.t0, self.sums, self.steps = log, t0, np.zeros(7), 0
        self.family = fam   # the model's family: it names the sums (fam.window_measures)
        self.first = 0   # the run's steps when this window began
        # reported beside the sums: double buffering's blocking communication time, the
        # adaptive bit width, the loss scaler (each None when off)
        self.comm_blocking, self.bitwidth, self.scaler = comm_blocking, bitwidth, scaler

    def due(self, seconds):
        """Whether `seconds` have passed since the last line (0: never by time)."""
        return bool(seconds) and time.perf_counter() - self.t0 >= seconds

    def add(self, sums, skipped=0, frame_ce=(0, 0, 0)):
        self.sums[:3] += sums
        self.sums[3] += skipped
        self.sums[4:] += frame_ce
        self.steps += 1

    def line(self, epoch, progress, rank_frames, lr, totals, phases, sent):
        now = time.perf_counter()
        comm_blocking, bitwidth, scaler = self.comm_blocking, self.bitwidth, self.scaler
        done, total = int(sum(progress["offsets"])), int(rank_frames.sum())
        fps = totals[2] / max(now - self.t0, 1e-9)
        bits = {}
        if bitwidth:   # the width now, and the controller's share of the time so far
            bits = {"bits": bitwidth.bits, "bits_controller_s": bitwidth.seconds}
        if scaler:     # the loss scale now, and the steps skipped on an overflow so far
            bits.update(loss_scale=scaler.scale, skipped_steps=scaler.skipped)
        measures, shown = self.family.window_measures(totals)
        self.log.info(f"epoch {epoch} {done:,}/{total:,} frames  {shown}  "
                      f"lr {lr:.3g}  {fps:,.0f} frames/s  "
                      + (f"bits {bits['bits']}  " if bitwidth else "")
                      + (f"scale {scaler.scale:g} ({scaler.skipped} skipped)  " if scaler
                         else "")
                      + f"eta {format_eta((total - done) / max(fps, 1e-9))}")
        exposed = communicate_seconds(phases)   # blocked in MPI, per exchange
        overlap = {}
        if comm_blocking:   # double buffering: the share of communication hidden
            overlap = {"comm_blocking_s": comm_blocking,
                       "overlap": min(max(1 - exposed / comm_blocking, 0.0), 1.0)}
        # bytes this rank sent per step of the window (double buffering: two exchanges a
        # step; a step skipped on an overflow: none)
        per_step = sent / max(self.steps - self.first, 1)
        self.log.record("train", epoch=epoch, frames=progress["frames"], step=self.steps,
                        **measures, lr=lr, frames_per_s=fps, exchange_s=phases,
                        exchange_total_s=sum(phases.values()), comm_exposed_s=exposed,
                        comm_bytes_per_step=per_step, **overlap, **bits)
        self.sums[:] = 0
        self.t0, self.first = now, self.steps


def write_run_info(run_dir, cfg):
    """The resolved config, git revision and package versions, for reproducing the run."""
    os.makedirs(run_dir, exist_ok=True)
    archive.atomic_write_text(os.path.join(run_dir, "config.yaml"), config.dump(cfg))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "-C", repo, "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        rev = ""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    info = {"git_revision": rev or "unknown", "python": sys.version.split()[0], "packages": versions}
    archive.atomic_write_text(os.path.join(run_dir, "versions.json"), json.dumps(info, indent=1) + "\n")


def label_counts(index):
    """Training frames per label, summed over shards (the priors of a hybrid decoder)."""
    total = np.zeros(index["num_labels"], np.int64)
    for shard in index["shards"]:
        total += archive.read_shard_meta(os.path.join(index["dir"], shard["file"]))["label_counts"]
    return total


def learning_rate(cfg, progress, run_frames):
    """Per-sample rate now: a pure function of the config, frames seen and the CV history."""
    return optim.learning_rate(cfg["schedule.type"], cfg["optim.lr"], progress["frames"],
                               progress["cv_history"], cfg["schedule.step_frames"],
                               cfg["schedule.factor"], cfg["schedule.newbob_threshold"],
                               run_frames, cfg["schedule.warmup_frames"])


def reduce_sum(comm, local):
    """Sum a few float64 counters over ranks (a small collective: log lines and epoch ends)."""
    if comm.Get_size() == 1:
        return local.copy()
    from mpi4py import MPI
    total = np.empty_like(local)
    comm.Allreduce(local, total, op=MPI.SUM)   # cross-rank sync point
    return total


def check_divergence(cfg, totals, num_labels, where):
    """Stop a run whose training criterion has blown up (a diverged run can go on for hours at
    a fraction of its speed, never producing a non-finite loss). totals: (CE sum, correct,
    frames) over all ranks, so every rank decides the same. An untrained model's CE is about
    ln(num_labels); train.diverged_ce_factor times that is far above anything a training run
    that can still recover reaches."""
    factor = cfg["train.diverged_ce_factor"]
    ce, frames = totals[0] / max(totals[2], 1), int(totals[2])
    limit = factor * math.log(max(num_labels, 2))
    # untrained: about ln(V) per frame, or per OUTPUT frame of a subsampling encoder
    ce, what, unit = family(cfg["model.type"]).divergence(cfg, ce)
    if factor and frames and ce > limit:
        raise UserError(f"{where}: training diverged: {what} is {ce:.4g} nats/{unit} over "
                        f"the last {frames:,} frames, above train.diverged_ce_factor {factor:g} x "
                        f"ln({num_labels} labels) = {limit:.3g}; lower optim.lr (or "
                        f"train.minibatch, or turn exchange.double_buffering off) and resume "
                        f"from a checkpoint written before the cross-entropy rose (the log "
                        f"lines show where), or set train.diverged_ce_factor=0 to go on")


def check_replicas(comm, flat, step):
    """All data ranks must hold bit-identical weights: compare a CRC-32 of the parameter bytes."""
    if comm.Get_size() == 1:
        return
    crc = zlib.crc32(to_host(flat).view(np.uint8))   # GPU ranks: device -> host copy
    crcs = comm.allgather(crc)   # lowercase: one small int per rank
    if len(set(crcs)) != 1:
        raise RuntimeError(f"replicas diverged at step {step}: parameter CRC-32 per rank {crcs}")
