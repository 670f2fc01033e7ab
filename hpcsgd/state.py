"""The training state of one rank, in one place: what a checkpoint holds, what the minibatch
probe snapshots and restores, and how it moves to another number of data ranks.

    state = TrainState(grid, params, opt, ex, step, loader, static)
    state.snapshot() / state.restore(snap)     in memory (the minibatch probe)
    state.save(run_dir, keep)                  a checkpoint (collective over the job)
    state.load(path)                           resume, re-striped for another K where possible

Parts:
  parameters   params (the same on every data rank)
  optimizer    velocity and sqr (replicated, or an owner's compact stripe: per rank), and the
               scalar AdaGrad weight
  exchange     both error-feedback residuals (striped: per rank), and double buffering's
               exchange in flight (its received bytes, per rank; its lr and per-step scalars
               in `pending`)
  progress     epoch, frames trained, every data rank's offset into its epoch stream, the CV
               history (the newbob schedule is a function of it, so the learning rate is too)
  decisions    the between-step decisions (hpcsgd/decisions.py): the minibatch size and the
               frame of the next probe; each is made identically on every rank; and the
               adaptive bit width's controller (hpcsgd/bitwidth.py: width, Q weights, smoothed
               loss, RNG; shared) with this rank's steps since its last decision (per rank);
               the loss scaler (hpcsgd/loss_scale.py: scale, counters, moving averages;
               shared: every rank updates it from the same vote)
  RNG          nothing stateful: the init, the block and frame shuffles draw from generators
               seeded by (train.seed, epoch, rank, buffer), so seed + progress reproduce them
The static part (model shape, features, label inventory and counts, config) identifies what
the state belongs to; a checkpoint of another model or label inventory is refused.

Another number of data ranks or another aggregation, at an epoch end or mid-epoch: the
optimizer's owner stripes are re-sliced to the new owners, both error-feedback residuals are
folded into the new stripes so that nothing a rank has not yet sent is lost
(hpcsgd/comm/stripes.py), and mid-epoch the frames no rank has trained yet are re-dealt to
the new ranks (hpcsgd/data/loader.py: redeal; the deal is part of the progress until the
epoch ends). Adam's local second moments (optim.adam_variance=local: a whole one per rank, of
N/K frames' gradients) start every new rank from the old ranks' mean. Refused: a checkpoint
with double buffering's exchange in flight, AdaGrad "local" (a whole per-rank state of
another rule), and another optim.adam_variance. A run resumed at another K is not
bit-identical to an uninterrupted one (other partial sums), by construction.
"""
import copy

import numpy as np

from hpcsgd import checkpoint
from hpcsgd.comm.exchange import cold_start
from hpcsgd.comm.stripes import fold_residuals, folded_from, restripe
from hpcsgd.device import assign, host_copy, to_host
from hpcsgd.errors import UserError
from hpcsgd.model.parallel import from_whole, group_of, to_whole, whole_size


def adam_variance(cfg):
    """Where a config's Adam learns its second moment (optim.adam_variance); None: not Adam."""
    return cfg.get("optim.adam_variance", "owner") if cfg.get("optim.type") == "adam" else None


class TrainState:
    def __init__(self, grid, params, opt, ex, step, loader, static):
        self.grid, self.params, self.opt, self.ex, self.step = grid, params, opt, ex, step
        self.loader = loader    # its block plans: where every rank is in the epoch
        self.static = static    # model, data, label_inventory_hash, label_counts, config, ...
        # deal: None, or the epoch re-dealt over these ranks (data/loader.py: redeal)
        # epoch_sums: the epoch's training sums over every data rank up to the last
        # checkpoint (the spine fills it in before saving; a resumed epoch adds its own)
        self.progress = {"epoch": 0, "frames": 0, "offsets": [0] * grid.data_size,
                         "cv_history": [], "deal": None, "epoch_sums": [0.0, 0.0, 0.0]}
        self.decisions = {"minibatch": static["config"]["train.minibatch"], "next_probe": 0}
        self.bitwidth = None    # the adaptive bit width's decision (bitwidth.BitWidth), if on
        self.scaler = step.scaler   # the loss scaler (loss_scale.py), if on
        # optimizer state differs between ranks: owner stripes, or AdaGrad or Adam's second
        # moment on local gradients
        self.per_rank_opt = not ex.replicated_optimizer or opt.local
        self.per_rank_state = self.per_rank_opt or bool(ex.state_dict())

    # ---- progress ----------------------------------------------------------------------------

    def advance(self, take):
        """A step trained take[r] frames on data rank r."""
        self.progress["offsets"] = (np.array(self.progress["offsets"]) + take).tolist()
        self.progress["frames"] += int(take.sum())

    def end_epoch(self, cv_accuracy=None):
        if cv_accuracy is not None:
            self.progress["cv_history"].append(cv_accuracy)
        self.progress["epoch"] += 1
        self.progress["offsets"] = [0] * self.grid.data_size
        self.progress["deal"] = None
        self.progress["epoch_sums"] = [0.0, 0.0, 0.0]

    # ---- in memory -------------------------------------------------------------------------

    def snapshot(self):
        """Host copies of everything a step changes (no exchange may be in flight)."""
        return {"params": host_copy(self.params.flat),
                "opt": {k: (host_copy(v) if hasattr(v, "shape") else v)
                        for k, v in self.opt.state_dict().items()},
                "exchange": {k: host_copy(v) for k, v in self.ex.state_dict().items()},
                "progress": copy.deepcopy(self.progress),
                "decisions": dict(self.decisions),
                "scaler": self.scaler.state_dict() if self.scaler else None}

    def restore(self, snap):
        assign(self.params.flat, snap["params"])
        self.opt.load_state_dict(snap["opt"])
        self.ex.load_state_dict(snap["exchange"])
        self.progress.update(copy.deepcopy(snap["progress"]))   # in place: the spine holds it
        self.decisions.update(snap["decisions"])
        if self.scaler:
            self.scaler.load_state_dict(snap["scaler"])

    # ---- checkpoints -----------------------------------------------------------------------

    def meta(self):
        bits = {"bitwidth": self.bitwidth.state_dict()["controller"]} if self.bitwidth else {}
        if self.scaler:
            bits["loss_scaler"] = self.scaler.state_dict()
        return {**self.static, **self.progress, **self.decisions, **bits,
                "world": self.grid.data_size, "model_parallel": self.grid.model_size,
                "per_rank_state": self.per_rank_state,
                "pending": self.step.pending}

    def _whole(self, local):
        """A per-parameter array as the whole model's (model parallelism: gathered over the
        model group to world rank 0, where the shared file is written; None elsewhere)."""
        layers = self.step.model.layers
        group = group_of(layers)
        if group is None or local.size != self.params.size:   # unsplit, or an unused state
            return local
        if self.grid.data_rank != 0:   # only world rank 0's shared arrays are written
            return None
        return to_whole(layers, local, group)

    def _mine(self, whole):
        """My slice of a whole per-parameter array (an unsplit model: all of it)."""
        layers = self.step.model.layers
        if group_of(layers) is None or whole.size != whole_size(layers):   # or unused state
            return whole
        return from_whole(layers, whole, np.empty(self.params.size, whole.dtype))

    def save(self, run_dir, keep):
        """Collective: shared state from rank 0 (whole matrices: a model split over a model
        group is gathered first), per-rank state (residuals, owner stripes, an exchange in
        flight) from every rank, each into its own file."""
        # GPU ranks: device -> host copies (sync points); host arrays are written as they are
        opt = {k: to_host(v) for k, v in self.opt.state_dict().items()}
        shared = {"params": self._whole(to_host(self.params.flat)),
                  "opt/sqr_weight": np.float64(opt["sqr_weight"]),
                  "opt/adam_p": np.float64(opt["adam_p"])}
        own = {f"exchange/{k}": to_host(v) for k, v in self.ex.state_dict().items()}
        if self.bitwidth:   # this rank's steps since the last width decision
            own["bitwidth/rows"] = np.array(self.bitwidth.state_dict()["rows"],
                                            np.float64).reshape(-1, 4)
        if self.step.pending:   # the exchange in flight, communication completed (sync point)
            own.update({f"exchange_{k}": to_host(v) for k, v in self.ex.pending_state().items()})
        if self.per_rank_opt:
            own.update({"opt/velocity": opt["velocity"], "opt/sqr": opt["sqr"]})
        else:
            shared.update({"opt/velocity": self._whole(opt["velocity"]),
                           "opt/sqr": self._whole(opt["sqr"])})
        return checkpoint.save(run_dir, self.progress["frames"], shared, self.meta(), keep,
                               comm=self.grid.world, rank_arrays=own)

    def load(self, path, log):
        """This rank's weights, optimizer state, exchange state, progress and decisions from
        checkpoint `path`; one of another number of data ranks or aggregation is re-striped
        (see the module docstring)."""
        world = self.grid.data_size
        # per-rank arrays are keyed by world rank (= the data rank without model parallelism)
        arrays, saved = checkpoint.load(path, rank=self.grid.rank)
        if saved.get("averaged"):
            raise UserError(f"train.resume {path}: an averaged model (hpcsgd average), weights "
                            f"without an optimizer or a position to resume; start from it "
                            f"with train.init_from")
        checkpoint.check_compatible(path, saved, {
            "model": self.static["model"], "data": self.static["data"],
            "label_inventory_hash": self.static["label_inventory_hash"]})
        cfg, old_cfg = self.static["config"], saved["config"]
        old_world, old_agg = saved["world"], saved.get("aggregation", "allreduce")
        agg = self.static["aggregation"]
        moved = (old_world != world or old_agg != agg) \
            and (saved.get("per_rank_state") or self.per_rank_state)
        # model parallelism: another M (or another D beside M > 1) re-slices whole matrices;
        # per-rank state (owner stripes, residuals) of a split model does not move
        old_M, M = saved.get("model_parallel", 1), self.grid.model_size
        regrid = old_M != M or (max(old_M, M) > 1 and old_world != world)
        if regrid and saved.get("pending"):
            raise UserError(f"checkpoint {path}: written by {old_world} x {old_M} (data x "
                            f"model) ranks with an exchange in flight "
                            f"(exchange.double_buffering); resume it with {old_world} x "
                            f"{old_M} ranks, or from another checkpoint")
        variance = adam_variance(cfg)
        if variance and adam_variance(old_cfg) not in (None, variance):
            raise UserError(f"checkpoint {path}: trained with optim.adam_variance="
                            f"{adam_variance(old_cfg)}; its Adam moments are not this run's "
                            f"(optim.adam_variance={variance}): resume with "
                            f"optim.adam_variance={adam_variance(old_cfg)}, or start a new run "
                            f"from its weights (train.init_from)")
        if moved and (saved.get("pending") or "local" in (cfg["optim.adagrad"],
                                                          old_cfg["optim.adagrad"])):
            why = ("an exchange was in flight (exchange.double_buffering)" if saved.get("pending")
                   else "optim.adagrad=local keeps a whole AdaGrad state per rank")
            raise UserError(f"checkpoint {path}: written by {old_world} ranks with "
                            f"exchange.aggregation={old_agg}; its per-rank state cannot move to "
                            f"{world} ranks with exchange.aggregation={agg}: {why}. Resume it "
                            f"with {old_world} ranks and exchange.aggregation={old_agg}, or from "
                            f"another checkpoint")
        assign(self.params.flat, self._mine(arrays["params"]))
        sqr_weight = float(arrays["opt/sqr_weight"])
        adam_p = float(arrays.get("opt/adam_p", 0.0))   # checkpoints before Adam have none
        if regrid:
            self._regrid_opt(path, arrays, old_world, old_M, sqr_weight, adam_p, log)
        elif moved:   # the optimizer state re-sliced, the residuals folded into the new stripes
            self.opt.load_state_dict(dict(self._restriped_opt(path, saved, old_agg),
                                          sqr_weight=sqr_weight, adam_p=adam_p))
            folded = self._fold_residuals(path, old_world, old_agg)
            log.info(f"re-striped the optimizer state of {path} from {old_world} ranks "
                     f"({old_agg}) to {world} ({agg}); the error-feedback residuals "
                     + ("folded into the new stripes (nothing lost)" if folded else
                        "start at zero (the old or the new exchange keeps none)")
                     + ("; every rank's local second moment starts from the old ranks' "
                        "mean" if self.opt.local else ""))
        else:
            if self.per_rank_opt:
                mine = checkpoint.rank_prefix(self.grid.rank)
                velocity, sqr = arrays[mine + "opt/velocity"], arrays[mine + "opt/sqr"]
            else:
                velocity, sqr = (self._mine(arrays[k]) for k in ("opt/velocity", "opt/sqr"))
            self.opt.load_state_dict({"velocity": velocity, "sqr": sqr,
                                      "sqr_weight": sqr_weight, "adam_p": adam_p})
            prefix = checkpoint.rank_prefix(self.grid.rank) + "exchange/"
            self.ex.load_state_dict({k[len(prefix):]: v for k, v in arrays.items()
                                     if k.startswith(prefix)})
        for key in ("epoch", "frames", "cv_history"):
            self.progress[key] = saved[key]
        # checkpoints before 2026-11-27 kept no epoch sums: the resumed epoch reports its own
        self.progress["epoch_sums"] = saved.get("epoch_sums") or [0.0, 0.0, 0.0]
        self.progress["offsets"], self.progress["deal"] = saved["offsets"], saved.get("deal")
        if old_world != world:   # the rest of the epoch dealt to the new ranks
            self.progress["deal"], self.progress["offsets"] = self.loader.redeal(
                saved.get("deal"), saved["offsets"], world, saved["epoch"])
            if any(saved["offsets"]):
                log.info(f"epoch {saved['epoch']} re-dealt from {old_world} to {world} ranks at "
                         f"frame {saved['frames']:,}: every frame not yet trained, once")
        if self.bitwidth and saved.get("bitwidth"):   # the width and its controller
            rows = arrays.get(checkpoint.rank_prefix(self.grid.rank) + "bitwidth/rows")
            if old_world != world and rows is not None and len(rows):
                # another K: those steps were other ranks'; the period restarts
                log.info(f"bit width: the {len(rows)} step(s) since the last decision restart "
                         f"at {world} ranks")
                rows = None
            self.bitwidth.load_state_dict({
                "controller": saved["bitwidth"],
                "rows": rows.tolist() if rows is not None else []})
        if self.scaler:   # the scale and the scaler's state, if the run had this scaler
            old_scaler = saved.get("loss_scaler") or {}
            if old_scaler.get("name") == self.scaler.name:
                self.scaler.load_state_dict(old_scaler)
            else:
                log.info(f"loss scaler {self.scaler.name} starts afresh (the checkpoint has "
                         f"{old_scaler.get('name', 'none')})")
        if cfg["train.probe_every_frames"] and "next_probe" in saved:   # a probed size
            self.decisions.update(minibatch=saved["minibatch"], next_probe=saved["next_probe"])
        # Adam's second moment frozen at the cold start's end (the crossing step drains its
        # exchange, so a step in flight here began on the same side of it as the progress)
        if cfg.get("optim.adam_freeze_variance") and \
                0 < cold_start(cfg) <= self.progress["frames"]:
            self.opt.freeze_variance()
        pending = saved.get("pending")   # double buffering: an exchange was in flight
        if pending:
            # into buffer 0 (the next half computes into buffer 1), with its per-step scalars
            mine = checkpoint.rank_prefix(self.grid.rank) + "exchange_"
            self.ex.load_pending({k[len(mine):]: v for k, v in arrays.items()
                                  if k.startswith(mine + "pending")}, self.step.grads[0].flat)
            self.opt.sqr_weight = pending["sqr_weight"]
            self.opt.adam_p = pending.get("adam_p", 0.0)
            self.opt.begin_step(pending["n"], pending["n_local"])
            self.step.pending = pending
            if not self.step.double_buffering:   # switched off: apply it now
                self.step.drain()

    def _regrid_opt(self, path, arrays, old_world, old_M, sqr_weight, adam_p, log):
        """Another data x model grid: a replicated optimizer state is re-sliced from the whole
        matrices; per-rank state (owner stripes, both residuals) starts at zero, said."""
        grid = f"{old_world} x {old_M} to {self.grid.data_size} x {self.grid.model_size}"
        state = self.opt.state_dict()
        if not self.per_rank_opt and "opt/velocity" in arrays:
            velocity, sqr = (self._mine(arrays[k]) for k in ("opt/velocity", "opt/sqr"))
            log.info(f"model parallelism: {path} re-sliced from {grid} (data x model) ranks")
        else:
            velocity, sqr = (np.zeros_like(to_host(state[k])) for k in ("velocity", "sqr"))
            log.info(f"model parallelism: {path} moved from {grid} (data x model) ranks; the "
                     f"weights are re-sliced, the optimizer's per-rank stripes and the "
                     f"error-feedback residuals start at zero (they are not whole matrices)")
        self.opt.load_state_dict({"velocity": velocity, "sqr": sqr, "sqr_weight": sqr_weight,
                                  "adam_p": adam_p})

    def _fold_residuals(self, path, old_world, old_agg):
        """Both residuals of a striped checkpoint of another K, folded into this rank's new
        stripes (comm/stripes.py: fold_residuals). False when either exchange keeps none."""
        if old_agg != "striped" or not self.ex.state_dict():
            return False
        rank, world = self.grid.data_rank, self.grid.data_size
        mine = folded_from(rank, old_world, world)
        names = [checkpoint.rank_prefix(r) + "exchange/residual1" for r in mine]
        names += [checkpoint.rank_prefix(r) + "exchange/residual2" for r in range(old_world)]
        old = checkpoint.load(path, names=names)[0]
        r1, r2 = fold_residuals([old[checkpoint.rank_prefix(r) + "exchange/residual1"]
                                 for r in mine],
                                [old[checkpoint.rank_prefix(r) + "exchange/residual2"]
                                 for r in range(old_world)],
                                self.params.matrices, old_world, rank, world)
        self.ex.load_state_dict({"residual1": r1, "residual2": r2})
        return True

    def _restriped_opt(self, path, saved, old_agg):
        """The optimizer arrays of a checkpoint of another K or aggregation, for this rank."""
        old_world = saved["world"]
        names = ["opt/velocity", "opt/sqr"]
        names += [checkpoint.rank_prefix(r) + n for r in range(old_world) for n in names]
        old = checkpoint.load(path, names=names)[0]
        arrays = {}
        for name in ("velocity", "sqr"):
            if f"opt/{name}" in old:
                arrays[name] = old[f"opt/{name}"]
            else:
                arrays[name] = [old[f"rank{r:04d}/opt/{name}"] for r in range(old_world)]
        local = None
        if self.opt.local:   # Adam's local second moments: whole, one per old rank
            local = np.mean(arrays.pop("sqr"), axis=0, dtype=np.float64).astype(np.float32)
            arrays["sqr"] = np.zeros(1, np.float32)   # passes through restripe
        out = restripe(arrays, old_world, old_agg == "striped", self.params.matrices,
                       self.grid.data_rank, self.grid.data_size,
                       not self.ex.replicated_optimizer)
        if local is not None:
            out["sqr"] = local
        return out
