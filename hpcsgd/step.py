"""One training step, the only one: what `hpcsgd train`, the minibatch probe and
`hpcsgd bench train` all run.

    step = Step(model, params, grads, opt, ex, double_buffering=False, progress="test")
    sums = step.run(batch, take, data_rank, lr, where)   # -> [CE sum, correct, frames] here
    step.drain()                                          # double buffering: the last update

In data-path order, for this rank's share of the global minibatch (take[data_rank] frames):
  batch     batch(n) -> (x, y): spliced, normalised frames and their labels
  forward + backward -> the gradient SUMMED over the rank's frames, in grads
  pre_exchange  the optimizer's local part (AdaGrad "local", Adam's local second moment)
  exchange  encode + send (hpcsgd/comm/exchange.py); then, when it completes:
  update    reduce -> Optimizer.post_exchange -> reencode -> gather -> Optimizer.apply:
            W -= lr * update, identically on every data rank. Where the codec declares a
            fusion, the exchange runs it in place of the phases it covers (the owner's
            decode-sum + post-processing + re-encode; the final decode + apply).
The spine (hpcsgd/train.py) only chooses take and lr and reads the sums.

Mixed precision and loss scaling (train.precision, train.loss_scale; docs/precision.md):
the gradient comes out of forward + backward times the loss scale; model.unscale rounds it to
float16 (mixed) and divides the scale off in float32, counting non-finite values. With a
scaler, one small Allreduce (MAX of [overflow, max |g|]) over the data ranks is the overflow
vote: on an overflow anywhere every rank skips the step -- no pre_exchange, no exchange, no
update: weights, optimizer state, both residuals and codec state untouched -- and the scaler
backs off; its frames count as trained. Without a scaler a non-finite gradient reaches the
exchange, which refuses it (an error), as before.

Overlapped allreduce (exchange.overlap; float32 allreduce on CPU ranks, PyTorch DDP's
buckets): before the pass the exchange is given the gradient buffer (ex.begin), the model
calls ex.ready(i) after layer i's backward, which posts the buckets that layer finishes as
Iallreduces, and ex.test (MPI_Test) after every GEMM drives them while the layers below
compute; send() posts the rest and waits. A rank without frames posts every bucket in send().

Double buffering (exchange.double_buffering, the paper's Sec. 2.2; equations in
docs/exchange.md): each rank's share is split in two halves, (take + 1) // 2 frames then the
rest (a pure function of take, so every rank knows every rank's halves). A half's exchange is
started (nonblocking) right after its gradient and completed -- its update applied -- only
after the NEXT half's gradient has been computed, on weights that lack that update (N/2
samples stale). Meanwhile MPI is driven by MPI_Test after each GEMM (progress "test"), by a
thread (the exchange's Poller, progress "thread") or not at all ("none"). Two gradient
buffers: the next half computes into the one not in flight. `pending` is the exchange in
flight (its lr and per-step scalars), part of the training state (hpcsgd/state.py).
"""
import time

import numpy as np

from hpcsgd.device import norm2, synchronize, zero
from hpcsgd.half import scale as scale_inplace
from hpcsgd.errors import UserError
from hpcsgd.timeline import EXCHANGE_CATEGORY


def halves(take, unit=1):
    """Double buffering: a step's per-rank frame counts split in two halves, (take + 1) // 2
    then the rest (a pure function of take, so every rank knows every rank's halves), in
    whole units (a sequence model's chunks: unit = the loader's unit). The loaders' own
    halves() (hpcsgd/data/loader.py, utterances.py) is what the trainer's step uses."""
    first = (take // unit + 1) // 2 * unit
    return [first, take - first]


def gradient_buffers(model, double_buffering):
    """The gradient buffers a step needs: two with double buffering (one in flight)."""
    return [model.new_params() for _ in range(2 if double_buffering else 1)]


class Phases:
    """Seconds per exchange phase, accumulated until pop() (the spine logs them per log line),
    each also a span on the rank's timeline. mark(name) ends the phase that began at the
    previous mark; a phase named None is not recorded.

    GPU ranks time phases without stopping the host: a mark records a CUDA event on the
    stream, and the times are the events' elapsed times, read when `times` is (one wait for
    the last event: at a log line, or each step under the adaptive bit width), so a phase's
    time is its kernels' time plus any wait the host made the device take (an MPI call
    between two marks). With a timeline, whose spans are host times, each mark synchronises
    the device instead. In the simulator every launch runs to completion, so there the host's
    clock is the device's."""

    def __init__(self, device="cpu", timeline=None):
        self.device, self.timeline = device, timeline
        self._times, self.exchanges, self._t = {}, 0, 0.0
        self.sent = 0   # bytes this rank sent in the exchanges completed since pop_sent()
        self._events = device == "cuda" and (timeline is None or timeline.file is None)
        self._last, self._open, self._used, self._spare = None, [], [], []   # event mode

    def start(self):
        self._t = time.perf_counter()
        if self._events:
            self._last = self._record()

    def mark(self, name):
        if self._events:
            event = self._record()
            if name is not None:
                self._open.append((name, self._last, event))
            self._last = event
            return
        synchronize(self.device)
        now = time.perf_counter()
        if name is not None:
            self._times[name] = self._times.get(name, 0.0) + now - self._t
            if self.timeline is not None:
                self.timeline.span(name, self._t, now, EXCHANGE_CATEGORY[name])
        self._t = now

    def _record(self):
        """An event (reused once its phase was read) recorded on the stream now."""
        if len(self._used) > 1024:   # phases never read (no log line for long): read them
            self.times
        event = self._spare.pop() if self._spare else _event()
        event.record()
        self._used.append(event)
        return event

    @property
    def times(self):
        """{phase: seconds} accumulated since the last pop() (GPU ranks: waits for the last
        marked phase's end)."""
        if self._open:
            self._open[-1][2].synchronize()
            for name, begin, end in self._open:
                self._times[name] = self._times.get(name, 0.0) + begin.elapsed_s(end)
            self._open = []
            # every event but the one the next phase begins at can be recorded again
            self._spare += [e for e in self._used if e is not self._last]
            self._used = [self._last]
        return self._times

    def pop(self):
        """{phase: mean seconds per exchange} since the last call, then reset."""
        out = {k: v / max(self.exchanges, 1) for k, v in self.times.items()}
        self._times, self.exchanges = {}, 0
        return out

    def pop_sent(self):
        """Bytes this rank sent since the last call (each exchange at its codec's width
        then: an adaptive bit width or the cold start's end changes it), then reset."""
        out, self.sent = self.sent, 0
        return out


class _HostEvent:
    """The simulator's stand-in for a CUDA event (its launches complete before they return;
    its own events record no time): the host clock."""

    def record(self):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_s(self, end):
        return end.t - self.t


class _CudaEvent:
    """A timing CUDA event on the default stream, where the step's kernels run."""

    def __init__(self):
        from hpcsgd.lazy_cuda import cuda
        self.event = cuda.event(timing=True)

    def record(self):
        self.event.record()

    def synchronize(self):
        self.event.synchronize()

    def elapsed_s(self, end):
        return self.event.elapsed_time(end.event) / 1000.0


def _event():
    from hpcsgd.device import simulated
    return _HostEvent() if simulated() else _CudaEvent()


def communicate_seconds(phases):
    """The communication phases of a Phases.pop() result: time this rank was blocked in MPI
    (a blocking collective, posting a nonblocking one, or waiting for it)."""
    return sum(v for k, v in phases.items() if EXCHANGE_CATEGORY[k] == "communicate")


def clip_norm(grad, limit):
    """grad *= limit / |grad| if its 2-norm exceeds limit (train.clip_gradient_norm times the
    frames: the gradient is a sum over them). Returns 1 if it clipped. On this rank's summed
    gradient, before the exchange: the 1-bit exchange never holds the global sum in one place
    before its update; with one rank it is the usual global clipping."""
    norm = norm2(grad)
    if norm <= limit or not np.isfinite(norm):   # non-finite: the divergence guard's case
        return 0
    scale_inplace(grad, limit / norm)
    return 1


def start_exchange(ex, grad, phases, blocking):
    """Encode grad and post its collective (blocking: wait for it)."""
    phases.start()
    ex.encode(grad)
    phases.mark(ex.PHASE["encode"])
    ex.send(blocking)
    phases.mark(ex.PHASE["send"])


def finish_exchange(ex, opt, params, lr, phases):
    """Complete the exchange in flight and apply its update, W -= lr * U(sum): every data rank
    the same bytes. opt's per-step scalars must still be those of the step that started it."""
    phases.start()
    ex.wait()
    phases.mark(ex.PHASE["send"])
    if ex.fuses_owner:                 # the codec's decode-sum + post-process + re-encode
        ex.owner_pass(params, opt)
        phases.mark(ex.PHASE["owner"])
    else:
        total, weights = ex.reduce(params, opt.weight_decay != 0)
        phases.mark(ex.PHASE["reduce"])
        opt.post_exchange(total, weights)
        phases.mark(ex.PHASE["post_process"])
        ex.reencode()
        phases.mark(ex.PHASE["reencode"])
    ex.gather()
    phases.mark(ex.PHASE["gather"])
    if ex.fuses_apply:                 # the codec's final decode fused with W -= lr * update
        ex.decode_apply(params, lr)
    else:
        update = ex.update()
        opt.apply(params[:update.size], update, lr)
    phases.mark(ex.PHASE["update"])
    phases.exchanges += 1
    phases.sent += ex.bytes_on_wire()


def exchange_update(ex, opt, params, grad, lr, phases):
    """One blocking exchange of grad (pre_exchange done) and its update."""
    start_exchange(ex, grad, phases, blocking=True)
    finish_exchange(ex, opt, params, lr, phases)


class Step:
    """One training step over a model, its parameters and gradient buffers, the optimizer and
    the exchange (see the module docstring). Holds the exchange in flight between steps.
    check_finite: a non-finite cross-entropy stops the run (the minibatch probe lets a
    diverging candidate finish and discards it)."""

    def __init__(self, model, params, grads, opt, ex, double_buffering=False, progress="test",
                 timeline=None, device="cpu", check_finite=True, scaler=None, clip=0.0,
                 unit=1, halve=None):
        if double_buffering and len(grads) < 2:
            raise ValueError("double buffering needs two gradient buffers")
        self.model, self.params, self.grads, self.opt, self.ex = model, params, grads, opt, ex
        self.double_buffering = bool(double_buffering)
        self.unit = int(unit)   # frames of an indivisible batch part (an LSTM's chunk)
        # double buffering's two halves of a step's per-rank frames: halves() in whole
        # units, or the loader's (whole utterances: hpcsgd/data/utterances.py)
        self.halve = halve or (lambda take: halves(take, self.unit))
        self.test_between_gemms = self.double_buffering and progress == "test"
        # exchange.overlap: each layer's gradient summed while the layers below compute,
        # where nothing changes the gradient after the pass (config.overlap_blocker; here
        # again for the steps the trainer's config does not build: bench train's)
        self.overlap = (bool(getattr(ex, "overlap", False)) and not self.double_buffering
                        and scaler is None and not getattr(model, "half", False)
                        and not getattr(model, "quant", None) and not clip
                        and not getattr(opt, "local", False)
                        and hasattr(model, "ready_offsets"))
        if self.overlap:
            ex.set_buckets(model.ready_offsets())
        self.timeline, self.check_finite = timeline, check_finite
        self.device = device
        # gradient-norm clipping per frame; gradients clipped of those seen
        self.clip, self.clipped, self.clip_seen = float(clip), 0, 0
        self.phases = Phases(device, timeline)
        self.pending = None      # the exchange in flight: {"lr", "n", "n_local", "sqr_weight",
                                 # "adam_p"}
        self.slot = 0            # the gradient buffer of the last half computed
        self.compute_s = 0.0     # forward + backward seconds since the last pop_compute()
        self.scaler = scaler     # hpcsgd/loss_scale.py, or None
        self.skips = []          # steps skipped on an overflow since the spine last looked
        self._vote = np.zeros(2)

    def run(self, batch, take, rank, lr, where=""):
        """One step: take[r] frames on data rank r (a half with no frames anywhere is
        skipped). Returns this rank's [CE sum, correct frames, frames] as float64."""
        sums = np.zeros(3)
        for part in (self.halve(take) if self.double_buffering else [take]):
            if part.sum():
                sums += self._half(batch, part, rank, lr, where)
        return sums

    def _half(self, batch, part, rank, lr, where):
        timeline = self.timeline
        self.slot = (self.slot + 1) % len(self.grads)
        grads = self.grads[self.slot]   # not the buffer of the exchange in flight
        t0 = time.perf_counter()
        x, y = batch(int(part[rank]))
        n = len(x)   # rows: frames, or a sequence batch's steps x sequences
        # frames in the loss: all rows of a frame batch; a chunk's rows labelled -1
        # (context, padding) are not, nor the padding of a batch of whole utterances
        counted = self.model.frames_in_loss(y, n)
        t1 = time.perf_counter()
        if timeline:
            timeline.span("batch", t0, t1, frames=n)
        # forward + backward: the gradient SUMMED over this rank's n frames (double
        # buffering: on weights that lack the previous half's update)
        scale = self.scaler.scale if self.scaler else 1.0
        bad, amax = 0, 0.0
        if n:
            # MPI progresses the exchange in flight only inside MPI calls: an MPI_Test after
            # each GEMM lets a link transfer run during this compute
            poke = self.ex.test if self.pending and self.test_between_gemms else None
            overlap = {}
            if self.overlap:   # buckets posted as layers finish; MPI_Test drives them
                self.ex.begin(grads.flat)
                poke, overlap = self.ex.test, {"ready": self.ex.ready}
            ce, correct = self.model.forward_backward(self.params, grads, x, y, n, poke,
                                                      loss_scale=scale, **overlap)
            if self.check_finite and not np.isfinite(ce):
                what = "cross-entropy" if self.model.frame_labels else "the CTC loss"
                raise UserError(f"{where}: {what} is {ce} on rank {rank}; lower "
                                f"optim.lr. No checkpoint was written after the divergence.")
            if self.scaler or self.model.half:   # float16 rounding, the scale off
                bad, amax = self.model.unscale(grads, scale)
        else:
            ce, correct = 0.0, 0
            zero(grads.flat)
            if self.overlap:   # every bucket posted in send(), in the others' order
                self.ex.begin(grads.flat)
        t2 = time.perf_counter()
        self.compute_s += t2 - t1
        if timeline:
            timeline.span("forward_backward", t1, t2, "compute")
        # double buffering: the previous half's exchange ran during that compute; complete it
        # and apply its update now (delayed update, its own lr and per-step scalars:
        # opt.begin_step has not been called since)
        self.drain()
        # loss scaling: every rank skips the step if any rank's gradient overflowed
        if self.scaler and self._overflowed(bad, amax, where):
            return ce, correct, counted
        # the optimizer's local part (AdaGrad or Adam's second moment on the raw local gradient)
        t2 = time.perf_counter()
        # the optimizer's running weights before this step's scalars (resume replays them)
        sqr_weight, adam_p = self.opt.sqr_weight, self.opt.adam_p
        if self.clip and counted:
            self.clipped += clip_norm(grads.flat, self.clip * counted)
            self.clip_seen += 1
        self.opt.begin_step(int(part.sum()), counted)
        self.opt.pre_exchange(grads.flat)
        if timeline:
            timeline.span("pre_exchange", t2, time.perf_counter(), "compute")
        # exchange + update: sum over the data ranks, then weight decay, aggregate AdaGrad,
        # momentum -> the update, and W -= lr * update identically on every data rank
        if self.scaler is not None and hasattr(self.ex, "loss_scale"):
            self.ex.loss_scale = scale   # the float16 allreduce sends g * scale: exact
        start_exchange(self.ex, grads.flat, self.phases, blocking=not self.double_buffering)
        if self.double_buffering:   # finished after the next half's gradient
            self.pending = {"lr": lr, "n": int(part.sum()), "n_local": counted,
                            "sqr_weight": sqr_weight, "adam_p": adam_p}
        else:
            finish_exchange(self.ex, self.opt, self.params.flat, lr, self.phases)
        return ce, correct, counted

    def _overflowed(self, bad, amax, where):
        """The overflow vote (one Allreduce of two numbers over the data ranks) and the
        scaler's update from its result; True: skip this step."""
        vote = self._vote
        vote[0], vote[1] = float(bad > 0), amax
        comm = getattr(self.ex, "comm", None)   # None: bench train's skipped exchange
        if comm is not None and comm.Get_size() > 1:
            from mpi4py import MPI
            comm.Allreduce(MPI.IN_PLACE, vote, op=MPI.MAX)   # cross-rank sync point
        overflow, before = bool(vote[0]), self.scaler.scale
        self.scaler.update(overflow, float(vote[1]))
        if overflow:
            self.skips.append({"where": where, "scale": before, "new_scale": self.scaler.scale})
        return overflow

    def drain(self):
        """Complete the exchange in flight, if any, and apply its update (epoch ends, before
        a probe or a checkpoint's end of run)."""
        if self.pending:
            finish_exchange(self.ex, self.opt, self.params.flat, self.pending["lr"],
                            self.phases)
            self.pending = None

    def pop_compute(self):
        out, self.compute_s = self.compute_s, 0.0
        return out
