"""`hpcsgd train`: the training loop, read top to bottom.

    [mpiexec -n K] hpcsgd train --config run.yaml [key=value ...]

One process per rank does everything (no parameter server). Each step, in data-path order:
batch (this rank's share of the global minibatch) -> forward -> backward (gradient summed over
the rank's frames) -> local post-processing -> exchange (sum over ranks, then decay / AdaGrad /
momentum: hpcsgd/comm/exchange.py, allreduce or the paper's striped 1-bit aggregation) ->
update -> metrics / checkpoint. All ranks start from the same seed, so replicas are identical,
and stay so because every rank applies the same update bytes; a checksum proves it at every
epoch end (every train.check_every_steps steps if set).

Every rank knows every rank's frame count for the epoch from the index alone, so the loop ends
on all ranks at the same step without a vote, and the global frames of each step are known
without communication (per-sample learning rates need no count anyway).

Double buffering (exchange.double_buffering, the paper's Sec. 2.2; equations in
docs/exchange.md): each rank's share of a step is split in two halves. A half's exchange is
started (nonblocking) right after its gradient, and completed -- its update applied -- only
after the NEXT half's gradient has been computed, on weights that lack that update (N/2
samples stale). At epoch ends the last exchange is completed before CV and the checkpoint; a
mid-epoch checkpoint stores the exchange in flight (communication completed, update not
applied) and a resumed run applies it where the uninterrupted run would have.
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

import numpy as np

from hpcsgd import checkpoint, config, optim
from hpcsgd.comm import make_exchange
from hpcsgd.comm.gpu import bind_gpu
from hpcsgd.comm.exchange import restripe_state
from hpcsgd.data import archive
from hpcsgd.data.loader import FrameLoader, local_batch_size
from hpcsgd.device import assign, host_copy, to_host, zero
from hpcsgd.errors import UserError
from hpcsgd.evaluate import evaluate
from hpcsgd.metrics import RunLog, format_eta
from hpcsgd.model.dnn import DNN
from hpcsgd.shutdown import EXIT_REQUEUE, StopSignal, Watchdog
from hpcsgd.timeline import Timeline

EXIT_DIVERGED = 3
PACKAGES = ("numpy", "numba", "numba-cuda", "mpi4py", "mpich", "h5py", "pyyaml",
            "kaldi-native-fbank", "soundfile", "kaldiio", "cupy-cuda12x", "nvidia-nccl-cu12")


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
    stop = StopSignal()   # SIGUSR1/SIGTERM from here on: checkpoint at the next step, exit 75
    try:
        cfg = config.load(args.config, args.overrides)
        code = train(cfg, comm, rank, world, stop)
        if code == EXIT_REQUEUE:
            # every rank is here (they agreed): end MPI cleanly, so that under
            # `python -m mpi4py` exit 75 stays an exit, not an MPI_Abort(75) that srun
            # reports as killed tasks
            MPI.Finalize()
        return code
    except UserError as err:
        if world == 1:
            raise
        print(f"hpcsgd train: rank {rank}: error: {err}", file=sys.stderr, flush=True)
        comm.Abort(2)   # a failing rank ends the job instead of leaving the others in a collective
    except BaseException:
        if world == 1:
            raise
        print(f"hpcsgd train: rank {rank} failed:\n{traceback.format_exc()}", file=sys.stderr,
              flush=True)
        comm.Abort(1)
    finally:
        stop.restore()


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


def train(cfg, comm, rank, world, stop):
    run_dir = cfg["train.run_dir"]
    if rank == 0:
        write_run_info(run_dir, cfg)
    comm.Barrier()   # the run directory exists before any rank opens its log
    log = RunLog(run_dir, rank, world)
    # a dead or stuck peer aborts the job instead of hanging it
    watchdog = Watchdog(cfg["train.watchdog_s"], rank, world, comm,
                        os.path.join(run_dir, "logs"), log)
    # GPU ranks: one GPU per local rank, chosen before anything is allocated on one
    device = cfg["train.device"]
    if device == "cuda":
        gpu, on_node, visible = bind_gpu(comm)
        log.info(f"GPU {gpu} of {visible} visible ({on_node} rank(s) on this node)")

    # --- data: this rank's share of the global minibatch -------------------------------------
    global_batch = cfg["train.minibatch"]
    if global_batch < world:
        raise UserError(f"config key train.minibatch: {global_batch} frames cannot be split over "
                        f"{world} ranks")
    my_batch = local_batch_size(global_batch, rank, world)
    batch_of = np.array([local_batch_size(global_batch, r, world) for r in range(world)])
    # automatic minibatch size: workspaces sized for the cap, the largest size a probe tries
    probe_every, probe_cap = cfg["train.probe_every_frames"], cfg["train.probe_max_minibatch"]
    if probe_every and not world <= global_batch <= probe_cap:
        raise UserError(f"config key train.minibatch: {global_batch} is above "
                        f"train.probe_max_minibatch={probe_cap} (automatic minibatch size)")
    max_local = local_batch_size(probe_cap if probe_every else global_batch, 0, world)
    loader = FrameLoader(cfg["data.train"], rank, world, context=cfg["data.context"],
                         cmvn=cfg["data.cmvn"], seed=cfg["train.seed"], max_batch=max_local,
                         block_frames=cfg["data.block_frames"],
                         buffer_frames=cfg["data.buffer_frames"], prefetch=cfg["data.prefetch"])
    index = loader.index
    if cfg["data.cv"]:
        cv_index = archive.read_index(cfg["data.cv"])
        if cv_index["label_inventory_hash"] != index["label_inventory_hash"] \
                or cv_index["feature_dim"] != index["feature_dim"]:
            raise UserError(f"{cfg['data.cv']}: labels or feature dim differ from the training "
                            f"archive {cfg['data.train']}; prep both with the same labels.txt")

    # --- model, gradient and optimizer state: flat buffers with named views -------------------
    model = DNN(loader.input_dim, cfg["model.hidden"], loader.num_labels,
                cfg["model.activation"], max_batch=max(max_local, 1024), device=device)
    params = model.new_params()
    # double buffering: two gradient buffers, one per half in flight (allreduce reduces the
    # gradient's own buffer in place while the next half's gradient is computed)
    double_buffering = cfg["exchange.double_buffering"]
    test_between_gemms = double_buffering and cfg["exchange.progress"] == "test"
    grad_bufs = [model.new_params() for _ in range(2 if double_buffering else 1)]
    grads = grad_bufs[0]
    ex = make_exchange(cfg, comm, grads.matrices)   # preallocates every exchange buffer
    # the per-rank Chrome trace (off: a no-op), and the exchange's communication timed
    # blocking once, the reference that turns double buffering's exposed time into an overlap
    timeline = Timeline(os.path.join(run_dir, "timeline", f"rank{rank:04d}.json")
                        if cfg["train.timeline"] else None, rank, cfg["train.timeline_steps"])
    ex.timeline = timeline
    comm_blocking = (ex.blocking_seconds(grad_bufs[1].flat)
                     if double_buffering and world > 1 else None)
    # striped: momentum / aggregate AdaGrad state covers this rank's stripe only (post_size)
    opt = optim.Optimizer(params.size, momentum_time_constant=cfg["optim.momentum_tc"],
                          adagrad=cfg["optim.adagrad"],
                          adagrad_time_constant=cfg["optim.adagrad_tc"] or float("inf"),
                          adagrad_eps=cfg["optim.adagrad_eps"],
                          weight_decay=cfg["optim.weight_decay"], post_size=ex.state_size,
                          device=device)
    # optimizer state is per rank when ranks hold different state: owner stripes, local AdaGrad
    opt_per_rank = not ex.replicated_optimizer or cfg["optim.adagrad"] == "local"
    shape = {"input_dim": loader.input_dim, "hidden": cfg["model.hidden"],
             "num_labels": loader.num_labels, "activation": cfg["model.activation"]}
    meta = {"model": shape,
            "data": {"context": cfg["data.context"], "cmvn": cfg["data.cmvn"],
                     "feature_dim": loader.feature_dim},
            "label_inventory_hash": index["label_inventory_hash"],
            "label_counts": label_counts(index).tolist(),
            "epoch": 0, "offsets": [0] * world, "frames": 0, "cv_history": [], "world": world,
            "aggregation": cfg["exchange.aggregation"], "per_rank_state": opt_per_rank
            or bool(ex.state_dict()), "config": cfg,
            "minibatch": global_batch, "next_probe": 0}   # automatic minibatch size

    resume = cfg["train.resume"]
    path = checkpoint.latest(run_dir) if resume == "auto" else (None if resume == "none" else resume)
    if path:
        # weights, optimizer state, residuals and an exchange in flight, re-striped for another
        # K or aggregation where that is possible (an epoch end); the data position below
        saved, pending = restore(path, cfg, meta, params, opt, ex, grad_bufs, opt_per_rank,
                                 rank, world, log)
        for key in ("epoch", "frames", "cv_history"):
            meta[key] = saved[key]
        meta["offsets"] = saved["offsets"] if saved["world"] == world else [0] * world
        if probe_every and "next_probe" in saved:   # the probed size is part of the state
            meta["minibatch"], meta["next_probe"] = saved["minibatch"], saved["next_probe"]
            global_batch = meta["minibatch"]
            batch_of = np.array([local_batch_size(global_batch, r, world) for r in range(world)])
            my_batch = int(batch_of[rank])
        log.info(f"resumed from {path}: epoch {meta['epoch']}, {meta['frames']} frames")
    else:
        model.init(params, np.random.default_rng(cfg["train.seed"]))  # same on every rank
        pending = None

    log.info(f"{world} rank(s), minibatch {global_batch} ({my_batch} here, pid {os.getpid()} "
             f"on {socket.gethostname()}), model "
             f"{loader.input_dim}-{'-'.join(map(str, cfg['model.hidden']))}-{loader.num_labels} "
             f"{cfg['model.activation']} ({params.size:,} parameters), exchange "
             f"{cfg['exchange.aggregation']}"
             f"{' + ' + cfg['exchange.codec'] if cfg['exchange.aggregation'] == 'striped' else ''} "
             f"on {device} ({ex.transport}), train "
             f"{index['total_frames']:,} frames ({index['hours']:.2f} h)")
    log.record("start", world=world, parameters=params.size, device=device,
               transport=ex.transport, config=cfg)

    def save_checkpoint():
        """Collective: shared state from rank 0, per-rank state (residuals, owner stripes)
        from every rank, into one file."""
        # GPU ranks: device -> host copies (sync points); host arrays are written as they are
        state = {k: to_host(v) for k, v in opt.state_dict().items()}
        shared = {"params": to_host(params.flat),
                  "opt/sqr_weight": np.float64(state["sqr_weight"])}
        own = {f"exchange/{k}": to_host(v) for k, v in ex.state_dict().items()}
        meta["pending"] = pending
        if pending:   # the exchange in flight, communication completed (a sync point)
            own["exchange_pending"] = to_host(ex.pending_state()["pending"])
        (own if opt_per_rank else shared).update({"opt/velocity": state["velocity"],
                                                  "opt/sqr": state["sqr"]})
        watchdog.beat("checkpoint")
        t0 = time.perf_counter()
        saved = checkpoint.save(run_dir, meta["frames"], shared, meta,
                                cfg["train.keep_checkpoints"], comm=comm, rank_arrays=own)
        timeline.span("checkpoint", t0, time.perf_counter())
        log.info(f"checkpoint {saved}")
        return saved

    def finish(code):
        watchdog.stop()
        timeline.close()
        loader.close()
        log.close()
        return code

    # --- epochs ---------------------------------------------------------------------------
    log_every, ckpt_every = cfg["train.log_every_frames"], cfg["train.checkpoint_every_frames"]
    stop_after = cfg["train.stop_after_frames"]
    check_every = cfg["train.check_every_steps"]
    sums = np.zeros(3)   # this rank's CE, correct frames, frames since the last log line
    t_log, step, slot = time.perf_counter(), 0, 0
    while meta["epoch"] < cfg["train.epochs"]:
        epoch = meta["epoch"]
        rank_frames = loader.plan.rank_frames(epoch)
        offsets = np.array(meta["offsets"], np.int64)
        loader.start_epoch(epoch, int(offsets[rank]))
        t_epoch, epoch_sums = time.perf_counter(), np.zeros(3)
        while (rank_frames - offsets).sum() > 0:
            watchdog.beat(f"step {step} (epoch {epoch}, frame {meta['frames']})")
            lr = learning_rate(cfg, meta)
            # 0. automatic minibatch size (the paper's Sec. 4): every probe_every frames, train
            #    candidate sizes from a snapshot of the whole state, keep the largest within
            #    probe_margin of the best criterion, restore the state (no exchange in flight)
            if probe_every and meta["frames"] >= meta["next_probe"]:
                if pending:
                    ex.finish(params.flat, opt, pending["lr"])   # cross-rank sync points
                    pending = None
                t0 = time.perf_counter()
                global_batch, record = probe_minibatch(
                    cfg, global_batch, lr, model, params, grads, opt, ex, loader, epoch,
                    offsets, rank_frames, rank, world, comm, watchdog)
                timeline.span("probe", t0, time.perf_counter(), chosen=global_batch)
                batch_of = np.array([local_batch_size(global_batch, r, world)
                                     for r in range(world)])
                meta["minibatch"], meta["next_probe"] = global_batch, meta["frames"] + probe_every
                log.info(f"minibatch size probe at frame {meta['frames']:,}: "
                         f"{ {int(c): round(v, 4) for c, v in record['criteria'].items()} } "
                         f"-> {global_batch} ({record['seconds']:.1f} s)")
                log.record("probe", epoch=epoch, frames=meta["frames"], **record)
            # 1. batch: every rank's count is known here, so the loop ends everywhere together
            take = np.minimum(batch_of, rank_frames - offsets)
            # double buffering: two halves per step, (take + 1) // 2 frames then the rest on
            # every rank (all ranks know all halves); a half with no frames anywhere is skipped
            for part in (halves(take) if double_buffering else [take]):
                if not part.sum():
                    continue
                slot = (slot + 1) % len(grad_bufs)
                grads = grad_bufs[slot]   # not the buffer of the exchange in flight
                t0 = time.perf_counter()
                x, y = loader.next_batch(int(part[rank]))
                n = len(y)
                t1 = time.perf_counter()
                timeline.span("batch", t0, t1, frames=n)
                # 2-3. forward + backward: the gradient SUMMED over this rank's n frames
                #    (double buffering: on weights that lack the previous half's update)
                if n:
                    # MPI progresses the exchange in flight only inside MPI calls: an MPI_Test
                    # after each GEMM lets a link transfer run during this compute
                    progress = ex.test if pending and test_between_gemms else None
                    ce, correct = model.forward_backward(params, grads, x, y, n, progress)
                    if not np.isfinite(ce):
                        raise UserError(f"step {step} (epoch {epoch}, frame {meta['frames']}): "
                                        f"cross-entropy is {ce} on rank {rank}; lower optim.lr. "
                                        f"No checkpoint was written after the divergence.")
                else:
                    ce, correct = 0.0, 0
                    zero(grads.flat)
                # double buffering: the previous half's exchange ran during that compute;
                # complete it and apply its update now (delayed update, its own lr and
                # per-step scalars: opt.begin_step has not been called since)
                timeline.span("forward_backward", t1, time.perf_counter(), "compute", step=step)
                if pending:
                    ex.finish(params.flat, opt, pending["lr"])   # cross-rank sync points
                    pending = None
                # 4. local post-processing (AdaGrad placed on the raw local gradient)
                t2 = time.perf_counter()
                sqr_weight = opt.sqr_weight   # before this step's scalars (resume replays them)
                opt.begin_step(int(part.sum()), n)
                opt.pre_exchange(grads.flat)
                timeline.span("pre_exchange", t2, time.perf_counter(), "compute")
                # 5-6. exchange + update: sum over ranks, then weight decay, aggregate AdaGrad,
                #    momentum -> the update, and W -= lr * update identically on every rank
                #    (striped: encode, Alltoallv, decode-sum, owner post-processing, re-encode,
                #    Allgatherv, decode-apply). Cross-rank sync points inside.
                if double_buffering:   # encode + nonblocking collective; finished next half
                    ex.start(grads.flat)
                    pending = {"lr": lr, "n": int(part.sum()), "n_local": n,
                               "sqr_weight": sqr_weight}
                else:
                    ex.step(grads.flat, params.flat, opt, lr)
                sums += (ce, correct, n)
                epoch_sums += (ce, correct, n)
            # 7. bookkeeping, metrics, checkpoint
            offsets += take
            meta["offsets"] = offsets.tolist()
            meta["frames"] += int(take.sum())
            step += 1
            timeline.end_step()
            if check_every and step % check_every == 0:
                check_replicas(comm, params.flat, step, world)
            if meta["frames"] // log_every != (meta["frames"] - take.sum()) // log_every:
                totals = reduce_sum(comm, sums, world)   # the same on every rank
                check_divergence(cfg, totals, loader.num_labels,
                                 f"step {step} (epoch {epoch}, frame {meta['frames']:,})")
                now = time.perf_counter()
                fps = totals[2] / max(now - t_log, 1e-9)
                done = int(offsets.sum())
                eta = (rank_frames.sum() - done) / max(fps, 1e-9)
                log.info(f"epoch {epoch} {done:,}/{rank_frames.sum():,} frames  "
                         f"ce {totals[0] / max(totals[2], 1):.4f}  "
                         f"acc {100 * totals[1] / max(totals[2], 1):.2f}%  lr {lr:.3g}  "
                         f"{fps:,.0f} frames/s  eta {format_eta(eta)}")
                phases = ex.pop_times()   # this rank's mean seconds per exchange, per phase
                exposed = ex.communicate_seconds(phases)   # blocked in MPI, per exchange
                overlap = {}
                if comm_blocking:   # double buffering: the share of communication hidden
                    overlap = {"comm_blocking_s": comm_blocking,
                               "overlap": min(max(1 - exposed / comm_blocking, 0.0), 1.0)}
                log.record("train", epoch=epoch, frames=meta["frames"], step=step,
                           ce=totals[0] / max(totals[2], 1),
                           frame_accuracy=totals[1] / max(totals[2], 1), lr=lr, frames_per_s=fps,
                           exchange_s=phases, exchange_total_s=sum(phases.values()),
                           comm_exposed_s=exposed, **overlap)
                sums[:] = 0
                t_log = now
            log.progress(int(offsets.sum()), int(rank_frames.sum()), f"epoch {epoch}")
            saved = None
            if ckpt_every and meta["frames"] // ckpt_every != (meta["frames"] - take.sum()) // ckpt_every:
                saved = save_checkpoint()
            if stop_after and meta["frames"] >= stop_after:
                saved = saved or save_checkpoint()
                log.info(f"stopping after {meta['frames']} frames (train.stop_after_frames)")
                return finish(0)
            # a stop signal (Slurm's time-limit warning, preemption) on any rank: all ranks
            # checkpoint here, at the same step, and the batch script requeues the job
            if stop.agreed(comm, world):   # cross-rank sync point
                saved = saved or save_checkpoint()
                log.info(f"stopping on {stop.received or 'a signal to another rank'} at step "
                         f"{step}, frame {meta['frames']:,}: checkpoint {saved}; exit "
                         f"{EXIT_REQUEUE} (requeue; the run resumes from it)")
                return finish(EXIT_REQUEUE)

        # --- epoch end: replicas agree, cross-validation, schedule, checkpoint -------------
        if pending:   # double buffering: apply the last half's update before CV
            ex.finish(params.flat, opt, pending["lr"])   # cross-rank sync points
            pending = None
        check_replicas(comm, params.flat, step, world)
        totals = reduce_sum(comm, epoch_sums, world)
        check_divergence(cfg, totals, loader.num_labels, f"epoch {epoch} end (step {step})")
        record = {"epoch": epoch, "frames": meta["frames"],
                  "train_ce": totals[0] / max(totals[2], 1),
                  "train_frame_accuracy": totals[1] / max(totals[2], 1),
                  "seconds": time.perf_counter() - t_epoch, "lr": learning_rate(cfg, meta)}
        line = (f"epoch {epoch} done in {record['seconds']:.1f} s: train ce "
                f"{record['train_ce']:.4f} acc {100 * record['train_frame_accuracy']:.2f}%")
        if cfg["data.cv"]:
            t0 = time.perf_counter()
            cv = evaluate(model, params, cfg["data.cv"], cfg["data.context"], cfg["data.cmvn"],
                          rank, world, comm, heartbeat=lambda: watchdog.beat("cross-validation"))
            timeline.span("cross_validation", t0, time.perf_counter())
            majority = cv["confusion"].sum(axis=1).max() / max(cv["frames"], 1)
            record.update(cv_ce=cv["ce"], cv_frame_accuracy=cv["frame_accuracy"],
                          cv_majority=majority)
            line += (f" | cv ce {cv['ce']:.4f} acc {100 * cv['frame_accuracy']:.2f}% "
                     f"(majority class {100 * majority:.2f}%)")
            meta["cv_history"].append(cv["frame_accuracy"])
        log.info(line)
        log.record("epoch", **record)
        meta["epoch"] = epoch + 1
        meta["offsets"] = [0] * world
        save_checkpoint()
    log.info(f"training done: {meta['frames']:,} frames; checkpoints in "
             f"{checkpoint.checkpoint_dir(run_dir)}; `hpcsgd plot {run_dir}` draws the curves")
    return finish(0)


def restore(path, cfg, meta, params, opt, ex, grad_bufs, opt_per_rank, rank, world, log):
    """Load checkpoint `path` into this rank's weights, optimizer state and exchange state
    (residuals; with double buffering the exchange that was in flight, its per-step scalars
    replayed). A checkpoint of another K or aggregation is re-striped at an epoch end (the
    optimizer state re-sliced, residuals from zero) and refused mid-epoch. Returns (the
    checkpoint's meta, the pending exchange's record or None)."""
    arrays, saved = checkpoint.load(path, rank=rank)
    checkpoint.check_compatible(path, saved, {"model": meta["model"],
                                              "label_inventory_hash": meta["label_inventory_hash"],
                                              "data": meta["data"]})
    if saved["world"] != world and any(saved["offsets"]):
        raise UserError(f"checkpoint {path}: written mid-epoch by {saved['world']} ranks; "
                        f"resume it with {saved['world']} ranks (or from an epoch-end checkpoint)")
    saved_agg = saved.get("aggregation", "allreduce")
    restripe = (saved["world"] != world or saved_agg != meta["aggregation"]) \
        and (saved.get("per_rank_state") or meta["per_rank_state"])
    if restripe and (any(saved["offsets"]) or "local" in (cfg["optim.adagrad"],
                                                          saved["config"]["optim.adagrad"])):
        raise UserError(f"checkpoint {path}: written by {saved['world']} ranks with "
                        f"exchange.aggregation={saved_agg}; its per-rank state (residuals, "
                        f"optimizer stripes) can be re-striped for another K or aggregation "
                        f"only at an epoch end and without optim.adagrad=local: resume it "
                        f"with {saved['world']} ranks and exchange.aggregation={saved_agg}")
    assign(params.flat, arrays["params"])
    if restripe:   # epoch end: re-slice the optimizer state, residuals start at zero
        names = ["opt/velocity", "opt/sqr"]
        names += [checkpoint.rank_prefix(r) + n for r in range(saved["world"]) for n in names]
        old = checkpoint.load(path, names=names)[0]
        opt.load_state_dict(dict(restripe_state(old, saved["world"], saved_agg == "striped",
                                                grad_bufs[0].matrices, rank, world, ex),
                                 sqr_weight=float(arrays["opt/sqr_weight"])))
        log.info(f"re-striped the optimizer state of {path} from {saved['world']} ranks "
                 f"({saved_agg}) to {world} ({meta['aggregation']}); error-feedback "
                 f"residuals start at zero (CNTK resets them at every epoch start)")
    else:
        mine = checkpoint.rank_prefix(rank) if opt_per_rank else ""
        opt.load_state_dict({"velocity": arrays[mine + "opt/velocity"],
                             "sqr": arrays[mine + "opt/sqr"],
                             "sqr_weight": float(arrays["opt/sqr_weight"])})
        ex.load_state_dict({k[len(checkpoint.rank_prefix(rank) + "exchange/"):]: v
                            for k, v in arrays.items()
                            if k.startswith(checkpoint.rank_prefix(rank) + "exchange/")})
    pending = saved.get("pending")   # double buffering: an exchange was in flight
    if pending:
        mine = checkpoint.rank_prefix(rank)
        # into buffer 0 (the next half computes into buffer 1), with its per-step scalars
        ex.load_pending({"pending": arrays[mine + "exchange_pending"]}, grad_bufs[0].flat)
        opt.sqr_weight = pending["sqr_weight"]
        opt.begin_step(pending["n"], pending["n_local"])
        if not cfg["exchange.double_buffering"]:   # switched off: apply it now
            ex.finish(params.flat, opt, pending["lr"])
            pending = None
    return saved, pending


def probe_minibatch(cfg, current, lr, model, params, grads, opt, ex, loader, epoch, offsets,
                    rank_frames, rank, world, comm, watchdog):
    """Automatic minibatch-size selection (Seide et al. 2014, Sec. 4; CNTK's auto-adjust).
    Candidates: round64(current / 2), then x sqrt(2) (multiples of 64) up to
    min(train.probe_max_minibatch, 2 * current). Each trains on the next train.probe_frames
    frames (fewer at an epoch's end) from the same snapshot -- weights, optimizer state,
    exchange residuals, loader position -- without double buffering, at the current per-sample
    lr; its criterion is the mean training cross-entropy over those frames (all ranks). The
    largest candidate within probe_margin of the best (CE <= best * (1 + margin)) is chosen;
    the snapshot is restored, so the run continues as if started with the chosen size here.
    Collective. Returns (size, record for the metrics)."""
    t0 = time.perf_counter()
    cap = min(cfg["train.probe_max_minibatch"], 2 * current)
    sizes = [max(64, 64 * round(current / 2 / 64))]
    while True:
        nxt = max(64 * round(sizes[-1] * math.sqrt(2) / 64), sizes[-1] + 64)
        if nxt > cap:
            break
        sizes.append(nxt)
    sizes = [c for c in sizes if c <= cap] or [current]
    # snapshot (host copies of everything a step changes)
    saved_params = host_copy(params.flat)
    saved_opt = {k: (host_copy(v) if hasattr(v, "shape") else v)
                 for k, v in opt.state_dict().items()}
    saved_ex = {k: host_copy(v) for k, v in ex.state_dict().items()}
    saved_times = (dict(ex.times), ex.steps, ex.timeline)
    ex.timeline = None   # the probe is one span on the timeline, not its inner steps
    criteria = {}
    for size in sizes:
        batch_of = np.array([local_batch_size(size, r, world) for r in range(world)])
        offs = offsets.copy()
        loader.start_epoch(epoch, int(offs[rank]))
        sums, done = np.zeros(3), 0
        while done < cfg["train.probe_frames"] and (rank_frames - offs).sum() > 0:
            watchdog.beat(f"minibatch-size probe ({size})")
            take = np.minimum(batch_of, rank_frames - offs)   # the spine's step, plainly
            x, y = loader.next_batch(int(take[rank]))
            n = len(y)
            if n:
                ce, correct = model.forward_backward(params, grads, x, y, n)
            else:
                ce, correct = 0.0, 0
                zero(grads.flat)
            opt.begin_step(int(take.sum()), n)
            opt.pre_exchange(grads.flat)
            ex.step(grads.flat, params.flat, opt, lr)   # cross-rank sync points
            sums += (ce, correct, n)
            offs += take
            done += int(take.sum())
        totals = reduce_sum(comm, sums, world)
        criteria[size] = totals[0] / max(totals[2], 1)
        # restore the snapshot
        assign(params.flat, saved_params)
        opt.load_state_dict(saved_opt)
        ex.load_state_dict(saved_ex)
    loader.start_epoch(epoch, int(offsets[rank]))
    ex.times, ex.steps, ex.timeline = saved_times
    best = min(criteria.values())
    ok = [c for c in sizes
          if np.isfinite(criteria[c]) and criteria[c] <= best * (1 + cfg["train.probe_margin"])]
    chosen = max(ok) if ok else current
    return chosen, {"candidates": sizes, "criteria": {str(c): float(criteria[c]) for c in sizes},
                    "chosen": chosen, "previous": current, "seconds": time.perf_counter() - t0}


def halves(take):
    """Double buffering: a step's per-rank frame counts split in two halves, (take + 1) // 2
    then the rest (a pure function of take, so every rank knows every rank's halves)."""
    first = (take + 1) // 2
    return [first, take - first]


def learning_rate(cfg, meta):
    """Per-sample rate now: a pure function of the config, frames seen and the CV history."""
    return optim.learning_rate(cfg["schedule.type"], cfg["optim.lr"], meta["frames"],
                               meta["cv_history"], cfg["schedule.step_frames"],
                               cfg["schedule.factor"], cfg["schedule.newbob_threshold"])


def reduce_sum(comm, local, world):
    """Sum a few float64 counters over ranks (a small collective: log lines and epoch ends)."""
    if world == 1:
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
    if factor and frames and ce > limit:
        raise UserError(f"{where}: training diverged: cross-entropy is {ce:.4g} nats/frame over "
                        f"the last {frames:,} frames, above train.diverged_ce_factor {factor:g} x "
                        f"ln({num_labels} labels) = {limit:.3g}; lower optim.lr (or "
                        f"train.minibatch, or turn exchange.double_buffering off) and resume "
                        f"from a checkpoint written before the cross-entropy rose (the log "
                        f"lines show where), or set train.diverged_ce_factor=0 to go on")


def check_replicas(comm, flat, step, world):
    """All ranks must hold bit-identical weights: compare a CRC-32 of the parameter bytes."""
    if world == 1:
        return
    crc = zlib.crc32(to_host(flat).view(np.uint8))   # GPU ranks: device -> host copy
    crcs = comm.allgather(crc)   # lowercase: one small int per rank
    if len(set(crcs)) != 1:
        raise RuntimeError(f"replicas diverged at step {step}: parameter CRC-32 per rank {crcs}")
