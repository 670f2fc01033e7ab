"""The training state of one rank, in one place: what a checkpoint holds, what the minibatch
probe snapshots and restores, and how it moves to another number of data ranks.

    state = TrainState(grid, params, opt, ex, step, static)
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
               frame of the next probe; each is made identically on every rank
  RNG          nothing stateful: the init, the block and frame shuffles draw from generators
               seeded by (train.seed, epoch, rank, buffer), so seed + progress reproduce them
The static part (model shape, features, label inventory and counts, config) identifies what
the state belongs to; a checkpoint of another model or label inventory is refused.

Re-striping. A checkpoint written by another number of data ranks (or another aggregation)
resumes at an epoch end: the optimizer's stripes are re-sliced to the new owners
(hpcsgd/comm/stripes.py); the residuals restart at zero. Mid-epoch it is refused.
"""
import copy

import numpy as np

from hpcsgd import checkpoint
from hpcsgd.comm.stripes import restripe
from hpcsgd.device import assign, host_copy, to_host
from hpcsgd.errors import UserError


class TrainState:
    def __init__(self, grid, params, opt, ex, step, static):
        self.grid, self.params, self.opt, self.ex, self.step = grid, params, opt, ex, step
        self.static = static    # model, data, label_inventory_hash, label_counts, config, ...
        self.progress = {"epoch": 0, "frames": 0, "offsets": [0] * grid.data_size,
                         "cv_history": []}
        self.decisions = {"minibatch": static["config"]["train.minibatch"], "next_probe": 0}
        # optimizer state differs between ranks: owner stripes, or AdaGrad on local gradients
        self.per_rank_opt = not ex.replicated_optimizer or opt.adagrad == "local"
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

    # ---- in memory -------------------------------------------------------------------------

    def snapshot(self):
        """Host copies of everything a step changes (no exchange may be in flight)."""
        return {"params": host_copy(self.params.flat),
                "opt": {k: (host_copy(v) if hasattr(v, "shape") else v)
                        for k, v in self.opt.state_dict().items()},
                "exchange": {k: host_copy(v) for k, v in self.ex.state_dict().items()},
                "progress": copy.deepcopy(self.progress),
                "decisions": dict(self.decisions)}

    def restore(self, snap):
        assign(self.params.flat, snap["params"])
        self.opt.load_state_dict(snap["opt"])
        self.ex.load_state_dict(snap["exchange"])
        self.progress.update(copy.deepcopy(snap["progress"]))   # in place: the spine holds it
        self.decisions.update(snap["decisions"])

    # ---- checkpoints -----------------------------------------------------------------------

    def meta(self):
        return {**self.static, **self.progress, **self.decisions,
                "world": self.grid.data_size, "per_rank_state": self.per_rank_state,
                "pending": self.step.pending}

    def save(self, run_dir, keep):
        """Collective: shared state from rank 0, per-rank state (residuals, owner stripes, an
        exchange in flight) from every rank, each into its own file."""
        # GPU ranks: device -> host copies (sync points); host arrays are written as they are
        opt = {k: to_host(v) for k, v in self.opt.state_dict().items()}
        shared = {"params": to_host(self.params.flat),
                  "opt/sqr_weight": np.float64(opt["sqr_weight"])}
        own = {f"exchange/{k}": to_host(v) for k, v in self.ex.state_dict().items()}
        if self.step.pending:   # the exchange in flight, communication completed (sync point)
            own["exchange_pending"] = to_host(self.ex.pending_state()["pending"])
        (own if self.per_rank_opt else shared).update({"opt/velocity": opt["velocity"],
                                                       "opt/sqr": opt["sqr"]})
        return checkpoint.save(run_dir, self.progress["frames"], shared, self.meta(), keep,
                               comm=self.grid.world, rank_arrays=own)

    def load(self, path, log):
        """This rank's weights, optimizer state, exchange state, progress and decisions from
        checkpoint `path` (see the module docstring for another K)."""
        rank, world = self.grid.data_rank, self.grid.data_size
        arrays, saved = checkpoint.load(path, rank=rank)
        checkpoint.check_compatible(path, saved, {
            "model": self.static["model"], "data": self.static["data"],
            "label_inventory_hash": self.static["label_inventory_hash"]})
        cfg, old_cfg = self.static["config"], saved["config"]
        old_agg = saved.get("aggregation", "allreduce")
        if saved["world"] != world and any(saved["offsets"]):
            raise UserError(f"checkpoint {path}: written mid-epoch by {saved['world']} ranks; "
                            f"resume it with {saved['world']} ranks (or from an epoch-end "
                            f"checkpoint)")
        moved = (saved["world"] != world or old_agg != self.static["aggregation"]) \
            and (saved.get("per_rank_state") or self.per_rank_state)
        if moved and (any(saved["offsets"]) or "local" in (cfg["optim.adagrad"],
                                                           old_cfg["optim.adagrad"])):
            raise UserError(f"checkpoint {path}: written by {saved['world']} ranks with "
                            f"exchange.aggregation={old_agg}; its per-rank state (residuals, "
                            f"optimizer stripes) can be re-striped for another K or aggregation "
                            f"only at an epoch end and without optim.adagrad=local: resume it "
                            f"with {saved['world']} ranks and exchange.aggregation={old_agg}")
        assign(self.params.flat, arrays["params"])
        sqr_weight = float(arrays["opt/sqr_weight"])
        if moved:   # epoch end: re-slice the optimizer state, residuals start at zero
            self.opt.load_state_dict(dict(self._restriped_opt(path, saved, old_agg),
                                          sqr_weight=sqr_weight))
            log.info(f"re-striped the optimizer state of {path} from {saved['world']} ranks "
                     f"({old_agg}) to {world} ({self.static['aggregation']}); error-feedback "
                     f"residuals start at zero (CNTK resets them at every epoch start)")
        else:
            mine = checkpoint.rank_prefix(rank) if self.per_rank_opt else ""
            self.opt.load_state_dict({"velocity": arrays[mine + "opt/velocity"],
                                      "sqr": arrays[mine + "opt/sqr"], "sqr_weight": sqr_weight})
            prefix = checkpoint.rank_prefix(rank) + "exchange/"
            self.ex.load_state_dict({k[len(prefix):]: v for k, v in arrays.items()
                                     if k.startswith(prefix)})
        for key in ("epoch", "frames", "cv_history"):
            self.progress[key] = saved[key]
        self.progress["offsets"] = saved["offsets"] if saved["world"] == world else [0] * world
        if cfg["train.probe_every_frames"] and "next_probe" in saved:   # a probed size
            self.decisions.update(minibatch=saved["minibatch"], next_probe=saved["next_probe"])
        pending = saved.get("pending")   # double buffering: an exchange was in flight
        if pending:
            # into buffer 0 (the next half computes into buffer 1), with its per-step scalars
            self.ex.load_pending({"pending": arrays[checkpoint.rank_prefix(rank)
                                                    + "exchange_pending"]},
                                 self.step.grads[0].flat)
            self.opt.sqr_weight = pending["sqr_weight"]
            self.opt.begin_step(pending["n"], pending["n_local"])
            self.step.pending = pending
            if not self.step.double_buffering:   # switched off: apply it now
                self.step.drain()

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
        return restripe(arrays, old_world, old_agg == "striped", self.params.matrices,
                        self.grid.data_rank, self.grid.data_size,
                        not self.ex.replicated_optimizer)
