"""The gradient exchange: sum the ranks' local gradients and turn the sum into the update.

Two aggregations, chosen by `exchange.aggregation` (docs/exchange.md has the details):

allreduce  one preallocated fused buffer (the gradient's flat buffer itself) reduced in place
           with MPI Allreduce; every rank then post-processes the whole sum (decay, AdaGrad,
           momentum) redundantly. `exchange.allreduce_dtype=float16` casts to a preallocated
           float16 buffer after dividing by K and sums in float16 (half the bytes; see
           Allreduce for the precision and overflow cost).

striped    Seide et al. 2014's O(1) algorithm. Rank j owns a contiguous range of codec columns
           of every matrix (stripe_ranges: CNTK's rule). Per step:
             1. encode   every rank encodes its whole local gradient with the codec and its own
                         first residual, piece by piece (matrix m, owner j), into a send buffer
                         grouped by owner: all matrices' stripe j are contiguous;
             2. Alltoallv of packed bytes: stripe j of every rank arrives at rank j;
             3. decode-sum  the owner decodes its K contributions (its own too, quantized as
                         in the paper) and sums them in float32 in a compact stripe buffer;
             4. post-process  opt.post_exchange on that stripe only: momentum and the
                         aggregate AdaGrad state are 1/K of the model (compact, per owner);
             5. re-encode the owner quantizes its updated stripe with its second residual
                         straight into its slot of the gather buffer;
                         onebit on CPU ranks does 3-5 in one pass per column, the column in
                         cache (hpcsgd/comm/owner.py; phase "owner", the same bits);
             6. Allgatherv brings every stripe to every rank (same layout as the send buffer);
             7. decode-apply  every rank decodes all stripes and applies W -= lr * update; a
                         codec with decode_apply (onebit) does both in one pass over W, the
                         others decode into the gradient's flat buffer, then Optimizer.apply.
           Every gradient is quantized twice. Every rank applies the same bytes, so replicas
           stay bit-identical.

Codec separate from transport: this module sizes buffers with codec.packed_nbytes and moves
bytes (MPI.BYTE); only the codec knows what the bytes mean.

Buffers are allocated once in the constructor; a step allocates nothing large. On GPU ranks
(train.device=cuda) every buffer, both residuals and the optimizer stripe live on the device,
the codec runs its CUDA kernels, and MPI gets device buffers when the library is CUDA-aware,
else pinned host mirrors of them (hpcsgd/comm/gpu.py: Staging); the float allreduce uses NCCL
when CuPy's binding loads (exchange.nccl). docs/exchange.md, "GPU ranks".
"""
import time

import numpy as np

from hpcsgd.codecs import make_codec
from hpcsgd.comm import owner
from hpcsgd.comm.gpu import Nccl, Staging, mpi_cuda_aware, nccl_available
from hpcsgd.comm.progress import Poller
from hpcsgd.device import assign, cupy_module, synchronize, zero, zeros
from hpcsgd.errors import UserError
from hpcsgd.model.flat import stripe_ranges
from hpcsgd.timeline import EXCHANGE_CATEGORY

AGGREGATIONS = ("allreduce", "striped")


def make_exchange(cfg, comm, mats):
    """The exchange the config asks for, over the flat layout `mats` (FlatParams.matrices), on
    the config's device. ex.transport says how its bytes move (for the log)."""
    device = cfg["train.device"]
    aware, why = False, ""
    if device == "cuda":
        aware, why = mpi_cuda_aware(cfg["exchange.mpi_cuda_aware"])
    if cfg["exchange.aggregation"] == "allreduce":
        nccl = None
        if device == "cuda" and comm.Get_size() > 1 and cfg["exchange.nccl"] != "false":
            ok, version = nccl_available()
            if ok:
                nccl = Nccl(comm)
                why = version
            elif cfg["exchange.nccl"] == "true":
                raise UserError(f"config key exchange.nccl: true, but NCCL does not load "
                                f"({version}); install the 'gpu' extra (cupy, nvidia-nccl-cu12)")
        ex = Allreduce(comm, sum(m.size for m in mats), cfg["exchange.allreduce_dtype"],
                       device=device, cuda_aware=aware, nccl=nccl)
    else:
        options = {}
        if cfg["exchange.codec"] == "kbit":
            options = {"bits": cfg["exchange.bits"], "range": cfg["exchange.kbit_range"]}
        elif cfg["exchange.codec"] == "dettmers":
            options = {"dtype": cfg["exchange.dettmers_type"]}
        codec = make_codec(cfg["exchange.codec"], device, **options)
        ex = Striped(comm, mats, codec, error_feedback=cfg["exchange.error_feedback"],
                     device=device, cuda_aware=aware, fuse_owner=cfg["exchange.fuse_owner"])
    ex.transport = ex.describe_transport(why)
    if cfg["exchange.progress"] == "thread":
        ex.poller = Poller()
    return ex


def restripe_state(old, old_world, old_striped, mats, rank, world, ex):
    """Optimizer arrays ("opt/velocity", "opt/sqr") of a checkpoint written by `old_world`
    ranks -> this rank's arrays under `ex` (another K or aggregation; epoch ends only).
    old: the shared "opt/NAME" arrays or every old rank's "rankNNNN/opt/NAME". Striped
    owners' compact stripes are laid back into a full vector (stripe_ranges of the old K),
    then sliced to this rank's stripe if `ex` is striped. A 1-element array is the
    optimizer's placeholder for a feature that is off and passes through unchanged."""
    size = sum(m.size for m in mats)
    out = {}
    for name in ("velocity", "sqr"):
        if f"opt/{name}" in old:
            full = np.asarray(old[f"opt/{name}"])
        else:
            parts = [np.asarray(old[f"rank{r:04d}/opt/{name}"]) for r in range(old_world)]
            if parts[0].size == 1 or not old_striped:
                full = parts[0]
            else:
                full = np.empty(size, parts[0].dtype)
                for r, part in enumerate(parts):
                    a = 0
                    for lo, hi in stripe_ranges(mats, r, old_world):
                        full[lo:hi] = part[a:a + hi - lo]
                        a += hi - lo
        if full.size == size and isinstance(ex, Striped):
            full = np.concatenate([full[lo:hi] for lo, hi in stripe_ranges(mats, rank, world)])
        out[name] = full
    return out


class _Timed:
    """Seconds per phase, accumulated until pop_times() (the spine logs them per log line),
    and each phase as a span on the rank's timeline when the spine sets one."""
    timeline = None   # hpcsgd.timeline.Timeline
    poller = None     # hpcsgd.comm.progress.Poller, with exchange.progress=thread

    def _poll(self, req):
        """exchange.progress=thread: a thread drives the collective just posted until wait()."""
        if self.poller is not None and req is not None and not isinstance(req, str):
            self.poller.start(req)

    def _stop_polling(self):
        if self.poller is not None:
            self.poller.stop()

    def _phase(self, name, t0, t1):
        self.times[name] += t1 - t0
        if self.timeline is not None:
            self.timeline.span(name, t0, t1, EXCHANGE_CATEGORY[name])

    def communicate_seconds(self, times):
        """The communication phases of a pop_times() result: time this rank was blocked in
        MPI (a blocking collective, posting a nonblocking one, or waiting for it)."""
        return sum(v for k, v in times.items() if EXCHANGE_CATEGORY[k] == "communicate")

    def blocking_seconds(self, scratch, repeats=3):
        """Collective: median wall time of this exchange's communication done blocking, on
        scratch buffers (state untouched; call it before load_pending). The reference that
        makes a double-buffered run's exposed communication time an achieved overlap."""
        times = []
        for _ in range(repeats + 1):   # the first one warms up connections and caches
            self.comm.Barrier()
            t0 = time.perf_counter()
            self._communicate_blocking(scratch)
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def _reset_times(self):
        self.times = dict.fromkeys(self.PHASES, 0.0)
        self.steps = 0

    def pop_times(self):
        """{phase: mean seconds per step} since the last call, then reset."""
        out = {k: v / max(self.steps, 1) for k, v in self.times.items()}
        self._reset_times()
        return out


class Allreduce(_Timed):
    """Sum in place with MPI Allreduce over one fused buffer; post-process on every rank.

    dtype "float32": the gradient's own flat buffer is the MPI buffer (no copy, MPI.IN_PLACE).
    dtype "float16": g / K is rounded to a preallocated float16 buffer, summed in float16 by a
    user-defined MPI op (MPI has no float16 SUM), and multiplied back by K. Trade-off: half the
    bytes, but ~3 significant digits (relative error 2^-11 per value and per partial sum),
    values below 6e-8 * K flush to zero, and a sum above 65504 * K overflows to Inf, which is
    reported as an error. Gradients here are SUMMED over frames, so large minibatches push
    toward overflow; dividing by K first keeps the partial sums no larger than the largest
    rank's value. There is no error feedback on this path (use striped + float16 codec for it).

    GPU ranks: with `nccl` (hpcsgd.comm.gpu.Nccl) the sum runs on the device, float16
    natively, on NCCL's own stream (so a double-buffered exchange overlaps the next half's
    compute). Without it, MPI sums the device buffer (CUDA-aware) or its pinned host mirror;
    float16 is then always staged, because MPI runs the user op on the host.
    """
    PHASES = ("encode", "allreduce", "decode", "post_process", "apply")
    replicated_optimizer = True   # every rank holds and updates the full optimizer state

    def __init__(self, comm, size, dtype="float32", device="cpu", cuda_aware=False, nccl=None):
        if dtype not in ("float32", "float16"):
            raise UserError(f"config key exchange.allreduce_dtype: {dtype!r} is not float32 or float16")
        self.comm, self.world, self.size, self.dtype = comm, comm.Get_size(), size, dtype
        self.device, self.nccl = device, nccl
        self.state_size = size        # post_exchange sees the whole flat buffer
        # the float16 sum's buffer: on the device with NCCL, else on the host (the MPI op)
        half_on = device if nccl is not None else "cpu"
        self.half = zeros(size if dtype == "float16" else 0, np.float16, half_on)
        # GPU ranks without NCCL: what MPI reads for the gradient (float16: always the host)
        self.stage = Staging((size,), np.float32, device, cuda_aware and dtype == "float32")
        self._op = None
        self._inflight = None   # (grad, request) between start and finish
        self._reset_times()

    def describe_transport(self, why):
        if self.nccl is not None:
            return f"NCCL on the device ({why})"
        return self.stage.describe(why)

    def step(self, grad, params, opt, lr):
        """Local gradient (flat float32, pre_exchange done) -> sum -> update (in grad's
        buffer) -> params -= lr * update. Every rank does all of it."""
        self.start(grad, blocking=True)
        self.finish(params, opt, lr)

    # ---- the exchange in two halves, so that double buffering (docs/exchange.md, "Double
    # buffering") computes the next half's gradient while the sum is in flight ----

    def start(self, grad, blocking=False):
        """Begin summing grad (pre_exchange done) over ranks: Iallreduce in place (Allreduce
        if `blocking`; NCCL on its stream on GPU ranks). grad must not be touched until
        finish(); one exchange in flight at a time."""
        from mpi4py import MPI
        t0 = time.perf_counter()
        inv_k = np.float32(1.0 / self.world)
        req = None
        if self.nccl is not None:     # GPU ranks with NCCL (K > 1): all on the device
            buf = grad
            if self.dtype == "float16":
                cp = cupy_module()
                cp.multiply(cp.asarray(grad), inv_k, out=cp.asarray(self.half), casting="unsafe")
                buf = self.half
            t1 = time.perf_counter()
            self.nccl.start_sum(buf)   # queued behind the gradient's kernels
            req = "nccl"
        else:
            buf = self.stage.to_mpi(grad)   # device sync point; staged: device -> host copy
            op = MPI.SUM
            if self.dtype == "float16":
                np.multiply(buf, inv_k, out=self.half, casting="unsafe")
                buf, op = [self.half, MPI.UINT16_T], self._half_sum()
            t1 = time.perf_counter()
            if self.world > 1:
                req = (self.comm.Iallreduce(MPI.IN_PLACE, buf, op=op) if not blocking else
                       self.comm.Allreduce(MPI.IN_PLACE, buf, op=op))   # cross-rank sync point
        self._inflight = (grad, req, True)
        self._poll(req)
        self._phase("encode", t0, t1)
        self._phase("allreduce", t1, time.perf_counter())
        if blocking:
            self.wait()

    def test(self):
        """Drive MPI's progress engine once (MPICH progresses a nonblocking collective only
        inside MPI calls unless async progress is on). NCCL needs no help."""
        if self._inflight is not None and self._inflight[1] not in (None, "nccl"):
            self._inflight[1].Test()

    def wait(self):
        """Complete the communication of the exchange in flight: the sum is then in grad."""
        grad, req, undecoded = self._inflight
        t0 = time.perf_counter()
        self._stop_polling()
        if req == "nccl":
            self.nccl.wait_sum()   # host waits for the NCCL stream: sync point
        elif req is not None:
            req.Wait()   # cross-rank sync point
        t1 = time.perf_counter()
        if undecoded:    # float16 back to float32 (x K); staged sums back to the device
            if self.dtype == "float16":
                self._from_half(grad)
            elif self.nccl is None:
                self.stage.from_mpi(grad)
            synchronize(self.device)
        self._inflight = (grad, None, False)
        self._phase("allreduce", t0, t1)
        self._phase("decode", t1, time.perf_counter())

    def _from_half(self, grad):
        """grad = K * the float16 sum; an overflow (Inf) is an error, not a silent NaN."""
        k = np.float32(self.world)
        if self.nccl is not None:
            cp = cupy_module()
            g = cp.asarray(grad)
            cp.multiply(cp.asarray(self.half), k, out=g)
            finite = bool(cp.isfinite(g).all())   # device -> host: sync point
        else:
            host = self.stage.mpi(grad)
            np.multiply(self.half, k, out=host)
            finite = bool(np.isfinite(host).all())
            if not finite:
                bad = int(np.argmax(~np.isfinite(host)))
                raise ValueError(f"float16 allreduce overflowed at flat index {bad} (a summed "
                                 f"gradient above 65504 * {self.world}); use "
                                 f"exchange.allreduce_dtype=float32 or a smaller minibatch")
            self.stage.from_mpi(grad)
        if not finite:
            raise ValueError(f"float16 allreduce overflowed (a summed gradient above 65504 * "
                             f"{self.world}); use exchange.allreduce_dtype=float32 or a smaller "
                             f"minibatch")

    def finish(self, params, opt, lr):
        """Wait for the sum, post-process it and apply W -= lr * update (opt's per-step
        scalars must still be those of the step that started it)."""
        grad = self._inflight[0]
        self.wait()
        t0 = time.perf_counter()
        opt.post_exchange(grad, params)
        synchronize(self.device)
        t1 = time.perf_counter()
        opt.apply(params, grad, lr)
        synchronize(self.device)
        self._inflight = None
        self._phase("post_process", t0, t1)
        self._phase("apply", t1, time.perf_counter())
        self.steps += 1

    def pending_state(self):
        """The exchange in flight, communication completed, as arrays for a checkpoint:
        the summed gradient (its update not yet applied)."""
        self.wait()
        return {"pending": self._inflight[0]}

    def load_pending(self, state, grad):
        """Resume an exchange whose communication had completed: its sum goes into grad."""
        assign(grad, state["pending"])
        self._inflight = (grad, None, False)

    def _communicate_blocking(self, scratch):
        from mpi4py import MPI
        if self.nccl is not None:
            self.nccl.start_sum(scratch if self.dtype == "float32" else self.half)
            self.nccl.wait_sum()
        elif self.dtype == "float32":
            self.comm.Allreduce(MPI.IN_PLACE, self.stage.to_mpi(scratch), op=MPI.SUM)
            self.stage.from_mpi(scratch)
        else:
            self.comm.Allreduce(MPI.IN_PLACE, [self.half, MPI.UINT16_T], op=self._half_sum())

    def _half_sum(self):
        """A commutative user op summing float16 values (created once, on first use)."""
        if self._op is None:
            from mpi4py import MPI

            def add(inbuf, outbuf, datatype):
                out = np.frombuffer(outbuf, np.float16)
                out += np.frombuffer(inbuf, np.float16)
            self._op = MPI.Op.Create(add, commute=True)
        return self._op

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Striped(_Timed):
    """The paper's O(1) striped aggregation with any codec (see the module docstring).

    Per-rank state (differs between ranks, checkpointed per rank): residual1 (full size, this
    rank's first error feedback) and residual2 (this rank's stripe, the owner's second error
    feedback). The optimizer's post-exchange state is compact over the stripe: build it with
    Optimizer(size, post_size=ex.state_size). fuse_owner: run phases 3-5 as one pass per
    column where the codec allows (owner.fusable), timed as the phase "owner".
    """
    PHASES = ("encode", "alltoallv", "decode_sum", "post_process", "reencode", "allgatherv",
              "decode_apply")
    FUSED_PHASES = ("encode", "alltoallv", "owner", "allgatherv", "decode_apply")
    replicated_optimizer = False  # each owner keeps the optimizer state of its stripe only

    def __init__(self, comm, mats, codec, error_feedback=True, device="cpu", cuda_aware=False,
                 fuse_owner=True):
        self.comm, self.codec, self.error_feedback = comm, codec, bool(error_feedback)
        self.device = device
        self.fused_owner = bool(fuse_owner) and owner.fusable(codec)
        if self.fused_owner:
            self.PHASES = self.FUSED_PHASES
        K, me = comm.Get_size(), comm.Get_rank()
        self.world, self.rank = K, me
        self.size = sum(m.size for m in mats)
        # pieces[j]: (matrix, flat lo, flat hi, columns, byte offset in a K-layout buffer,
        # nbytes) of owner j's stripe of every matrix, back to back: the send buffer and the
        # gather buffer share this layout (sizes depend only on matrix and owner).
        self.pieces, counts, offset = [], [], 0
        for j in range(K):
            row, start = [], offset
            for m, (lo, hi) in zip(mats, stripe_ranges(mats, j, K)):
                cols = (hi - lo) // m.n_rows if m.n_rows else 0
                nbytes = codec.packed_nbytes(cols, m.n_rows) if cols else 0
                if nbytes % 4:
                    raise ValueError(f"{codec.name}: packed size {nbytes} is not 4-byte aligned")
                if nbytes:
                    row.append((m, lo, hi, cols, offset, nbytes))
                offset += nbytes
            self.pieces.append(row)
            counts.append(offset - start)
        self.counts = np.array(counts, np.int64)
        self.displs = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        mine = int(self.counts[me])
        self.send = zeros(offset, np.uint8, device)      # my whole gradient, encoded, by owner
        self.gather = zeros(offset, np.uint8, device)    # every owner's encoded update
        self.recv = zeros(K * mine, np.uint8, device)    # K contributions to my stripe
        # what MPI gets for each (GPU ranks: the device buffer or its pinned host mirror)
        self.stages = {name: Staging((getattr(self, name).size,), np.uint8, device, cuda_aware)
                       for name in ("send", "gather", "recv")}
        self.recv_counts = np.full(K, mine, np.int64)
        self.recv_displs = np.arange(K, dtype=np.int64) * mine
        # my stripe, compact: agg (float32 sum -> update; unfused only), residual2, and (for weight decay) a
        # copy of my stripe's weights; views per matrix piece
        self.state_size = sum(p[2] - p[1] for p in self.pieces[me])
        self.agg = zeros(0 if self.fused_owner else self.state_size, np.float32, device)
        self.residual2 = zeros(self.state_size, np.float32, device)
        self.residual1 = zeros(self.size, np.float32, device)
        self._wstripe = None
        self.mine, s = [], 0      # (piece, compact lo, compact hi)
        for p in self.pieces[me]:
            self.mine.append((p, s, s + p[2] - p[1]))
            s += p[2] - p[1]
        self._inflight = None   # (grad, Alltoallv request) between start and finish
        self._reset_times()

    def describe_transport(self, why):
        return self.stages["send"].describe(why)

    def _mpi(self, name, lo=0, hi=None):
        """Buffer `name` handed to MPI: its device writes complete (sync point) and, staged,
        range [lo, hi) copied to its host mirror."""
        return self.stages[name].to_mpi(getattr(self, name), lo, hi)

    def _from_mpi(self, name, lo=0, hi=None):
        self.stages[name].from_mpi(getattr(self, name), lo, hi)

    def bytes_on_wire(self):
        """Bytes this rank sends per step: Alltoallv to the K-1 others + its gathered stripe
        to the K-1 others (a lower bound for any allgather algorithm)."""
        others = self.counts.sum() - self.counts[self.rank]
        return int(others + (self.world - 1) * self.counts[self.rank])

    def step(self, grad, params, opt, lr):
        """Local gradient (flat float32, pre_exchange done) -> params -= lr * update, the
        update being the owners' post-processed sum, quantized twice. grad is clobbered."""
        self.start(grad, blocking=True)
        self.finish(params, opt, lr)

    def start(self, grad, blocking=False):
        """Phases 1-2: encode grad with residual 1, then the Alltoallv (nonblocking unless
        `blocking`: double buffering computes the next half's gradient meanwhile). grad is
        not read after this returns, but a codec without decode_apply decodes the update into
        it in finish(): the spine keeps it until then (a second gradient buffer)."""
        from mpi4py import MPI
        codec, t0 = self.codec, time.perf_counter()
        if not self.error_feedback:   # the no-feedback baseline: quantize each step afresh
            zero(self.residual1)
            zero(self.residual2)
        # 1. encode my whole local gradient, grouped by owner
        for row in self.pieces:
            for m, lo, hi, cols, off, nb in row:
                codec.encode(grad[lo:hi].reshape(cols, m.n_rows),
                             self.residual1[lo:hi].reshape(cols, m.n_rows), self.send[off:off + nb])
        send = [self._mpi("send"), (self.counts, self.displs), MPI.BYTE]   # device sync point
        t1 = time.perf_counter()
        # 2. stripe j of every rank to rank j
        recv = [self.stages["recv"].mpi(self.recv), (self.recv_counts, self.recv_displs),
                MPI.BYTE]
        if blocking:
            self.comm.Alltoallv(send, recv)   # cross-rank sync point
            req = None
            self._from_mpi("recv")
        else:
            req = self.comm.Ialltoallv(send, recv)
        self._inflight = (grad, req)
        self._poll(req)
        self._phase("encode", t0, t1)
        self._phase("alltoallv", t1, time.perf_counter())

    def test(self):
        """Drive MPI's progress engine once (see Allreduce.test)."""
        if self._inflight is not None and self._inflight[1] is not None:
            self._inflight[1].Test()

    def wait(self):
        """Complete the Alltoallv in flight: my K contributions are then in recv."""
        grad, req = self._inflight
        t0 = time.perf_counter()
        self._stop_polling()
        if req is not None:
            req.Wait()   # cross-rank sync point
            self._from_mpi("recv")
            self._inflight = (grad, None)
        self._phase("alltoallv", t0, time.perf_counter())

    def finish(self, params, opt, lr):
        """Phases 3-7 of the exchange started by start(): decode-sum, owner post-processing
        (opt's per-step scalars must be the started step's), re-encode (3-5 fused into one
        pass where fused_owner), Allgatherv, apply."""
        from mpi4py import MPI
        codec, me, grad = self.codec, self.rank, self._inflight[0]
        self.wait()
        marks = [(None, time.perf_counter())]   # (phase that just ended, when)
        mine_lo, mine = int(self.displs[me]), int(self.counts[me])
        if self.fused_owner:   # 3-5 in one pass per column (hpcsgd/comm/owner.py)
            owner.owner_pass(codec, self.recv, self.world, (mine_lo, mine_lo + mine), self.mine,
                             params, opt, self.residual2, self.gather)
            marks.append(("owner", time.perf_counter()))
        else:
            self._owner_phases(params, opt, marks)
        gather = self._mpi("gather", mine_lo, mine_lo + mine)   # device sync point
        marks[-1] = (marks[-1][0], time.perf_counter())
        # 6. every owner's stripe to every rank
        self.comm.Allgatherv(MPI.IN_PLACE, [gather, (self.counts, self.displs), MPI.BYTE])
        self._from_mpi("gather")
        marks.append(("allgatherv", time.perf_counter()))   # cross-rank sync point above
        # 7. decode every stripe and apply W -= lr * update: fused in one pass over W where
        #    the codec can (same arithmetic as Optimizer.apply, so the same bits), else decode
        #    into grad's buffer (the local gradient is spent) and apply
        fused = getattr(codec, "decode_apply", None)
        for row in self.pieces:
            for m, lo, hi, cols, off, nb in row:
                if fused:
                    fused(self.gather[off:off + nb], params[lo:hi].reshape(cols, m.n_rows), lr)
                else:
                    codec.decode(self.gather[off:off + nb], grad[lo:hi].reshape(cols, m.n_rows))
        if not fused:
            opt.apply(params, grad, lr)
        synchronize(self.device)
        marks.append(("decode_apply", time.perf_counter()))
        self._inflight = None
        for (_, a), (name, b) in zip(marks[:-1], marks[1:]):
            self._phase(name, a, b)
        self.steps += 1

    def _owner_phases(self, params, opt, marks):
        """Phases 3-5 unfused, each a pass over my stripe (marks: their end times)."""
        codec, me = self.codec, self.rank
        # 3. decode and sum the K contributions to my stripe (the first overwrites, so no
        #    zeroing pass), in source order 0..K-1 so every run adds in the same order
        mine = int(self.counts[me])
        for (m, lo, hi, cols, off, nb), a, b in self.mine:
            out = self.agg[a:b].reshape(cols, m.n_rows)
            at = off - self.displs[me]
            for src in range(self.world):
                packed = self.recv[src * mine + at:src * mine + at + nb]
                if src == 0:
                    codec.decode(packed, out)
                else:
                    codec.decode_accumulate(packed, out)
        synchronize(self.device)   # GPU ranks: phase times are the kernels' times
        marks.append(("decode_sum", time.perf_counter()))
        # 4. post-process my stripe only (weight decay reads my weights: copy them compact)
        weights = self.agg
        if opt.weight_decay:
            if self._wstripe is None:
                self._wstripe = zeros(self.state_size, np.float32, self.device)
            for (m, lo, hi, *_), a, b in self.mine:
                assign(self._wstripe[a:b], params[lo:hi])
            weights = self._wstripe
        opt.post_exchange(self.agg, weights, 0, self.state_size)
        synchronize(self.device)
        marks.append(("post_process", time.perf_counter()))
        # 5. re-encode my updated stripe with my second residual, into my gather slot
        for (m, lo, hi, cols, off, nb), a, b in self.mine:
            codec.encode(self.agg[a:b].reshape(cols, m.n_rows),
                         self.residual2[a:b].reshape(cols, m.n_rows), self.gather[off:off + nb])
        marks.append(("reencode", time.perf_counter()))

    def _communicate_blocking(self, scratch):
        from mpi4py import MPI
        self.comm.Alltoallv([self._mpi("send"), (self.counts, self.displs), MPI.BYTE],
                            [self.stages["recv"].mpi(self.recv),
                             (self.recv_counts, self.recv_displs), MPI.BYTE])
        self._from_mpi("recv")
        gather = self._mpi("gather")
        self.comm.Allgatherv(MPI.IN_PLACE, [gather, (self.counts, self.displs), MPI.BYTE])
        self._from_mpi("gather")

    def pending_state(self):
        """The exchange in flight, Alltoallv completed, for a checkpoint: my K received
        contributions (phases 3-7 not yet done)."""
        self.wait()
        return {"pending": self.recv}

    def load_pending(self, state, grad):
        """Resume an exchange whose Alltoallv had completed (grad: the buffer a non-fused
        codec decodes into)."""
        assign(self.recv, state["pending"])
        self._inflight = (grad, None)

    def state_dict(self):
        """This rank's error feedback (by reference): both residuals."""
        return {"residual1": self.residual1, "residual2": self.residual2}

    def load_state_dict(self, state):
        for name in ("residual1", "residual2"):
            src = state[name]
            if tuple(src.shape) != tuple(getattr(self, name).shape):
                raise UserError(f"checkpoint: exchange {name} has shape {src.shape}, this rank "
                                f"needs {getattr(self, name).shape} (another K or model?)")
            assign(getattr(self, name), src)
