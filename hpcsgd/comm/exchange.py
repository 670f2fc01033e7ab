"""The gradient exchange: sum the data ranks' local gradients, and hand the sum to the
optimizer and the update back to every rank. The exchange moves and codes bytes; the step
(hpcsgd/step.py) calls the optimizer between its phases.

Two aggregations, chosen by `exchange.aggregation` (docs/exchange.md has the details):

allreduce  one preallocated fused buffer (the gradient's flat buffer itself) reduced in place
           with MPI Allreduce; every rank then post-processes the whole sum (decay, AdaGrad,
           momentum) redundantly. `exchange.allreduce_dtype=float16` sends float16 (half
           the bytes): a reduce-scatter (Alltoallv of float16 pieces), a float32 sum of the K
           pieces, an Allgatherv of the float16 result (see Allreduce for the precision and
           overflow cost).

striped    Seide et al. 2014's O(1) algorithm. Rank j owns a contiguous range of codec columns
           of every matrix (hpcsgd/comm/stripes.py: CNTK's rule). Per step:
             1. encode   every rank encodes its whole local gradient with the codec and its own
                         first residual, piece by piece (matrix m, owner j), into a send buffer
                         grouped by owner: all matrices' stripe j are contiguous;
             2. send     Alltoallv of packed bytes: stripe j of every rank arrives at rank j;
             3. reduce   the owner decodes its K contributions (its own too, quantized as in
                         the paper) and sums them in float32 in a compact stripe buffer;
             4.          [the step: Optimizer.post_exchange on that stripe only: momentum and
                         the aggregate AdaGrad state are 1/K of the model (compact, per owner)]
             5. reencode the owner quantizes its updated stripe with its second residual
                         straight into its slot of the gather buffer;
             6. gather   Allgatherv brings every stripe to every rank (the send buffer's layout);
             7. update   every rank decodes all stripes into the gradient's buffer [the step:
                         Optimizer.apply, W -= lr * update].
           Every gradient is quantized twice. Every rank applies the same bytes, so replicas
           stay bit-identical.

Fusions are declared capabilities of the codec (hpcsgd/codecs/common.py: Codec), and the
exchange offers them to the step: `fuses_owner` (phases 3-5 as one pass per column while it
is in cache: codec.owner_pass, given the optimizer's element arithmetic) and `fuses_apply`
(phase 7 with the weight update in one pass over W: codec.decode_apply). The step asks; the
exchange calls the optimizer itself only for the "float" matrices beside a fused codec (a
model's learned clip values: a few floats), which take the unfused steps inside
owner_pass and decode_apply, with the same arithmetic.

Parameters are exchanged as their specs say (hpcsgd/model/flat.py): "codec" matrices through
the configured codec, "float" ones in float32 (the float32 codec in the striped exchange;
never quantized), "none" ones not at all: the exchanged part is the prefix flat[:exchanged].

Codec separate from transport: this module sizes buffers with codec.packed_nbytes and moves
bytes (MPI.BYTE); only the codec knows what the bytes mean. Buffers are allocated once in the
constructor; a step allocates nothing large. On GPU ranks (train.device=cuda) every buffer,
both residuals and the optimizer stripe live on the device, the codec runs its CUDA kernels,
and MPI gets device buffers when the library is CUDA-aware, else pinned host mirrors of them
(hpcsgd/comm/gpu.py: Staging); the float allreduce uses NCCL when CuPy's binding loads
(exchange.nccl). docs/exchange.md, "GPU ranks".

The exchange API, per step (the step, hpcsgd/step.py, runs it in this order):
    encode(grad)                 phase PHASE["encode"]
    send(blocking)               PHASE["send"]   (nonblocking: test() drives it, wait() ends it)
    wait()                       PHASE["send"]
    owner_pass(params, opt)      "owner"         where fuses_owner; else:
      total, weights = reduce(params, weight_decay)   PHASE["reduce"]
      [opt.post_exchange(total, weights)]            "post_process"
      reencode()                 PHASE["reencode"]
    gather()                     PHASE["gather"]
    decode_apply(params, lr)     PHASE["update"] where fuses_apply; else
      [opt.apply(params[:u.size], u, lr)] with u = update()
A phase named None does not exist in that exchange (no work, not timed).
"""
import os
import time

import numpy as np

from hpcsgd import half
from hpcsgd.codecs import make_codec
from hpcsgd.config import overlap_blocker
from hpcsgd.comm.gpu import (ENV_CUDA_AWARE, Nccl, Staging, mpi_cuda_aware, nccl_available,
                             shared_gpus)
from hpcsgd.comm.progress import Poller
from hpcsgd.comm.stripes import exchanged, stripe_ranges
from hpcsgd.device import assign, cupy_module, to_host, zero, zeros
from hpcsgd.errors import UserError
from hpcsgd.optim import apply_update

AGGREGATIONS = ("allreduce", "striped")


def adaptive_bits(cfg):
    """Whether a rule chooses the bit width at run time (hpcsgd/bitwidth.py); it needs the
    striped exchange with the kbit codec."""
    if isinstance(cfg["exchange.bits"], int):
        return False
    if cfg["exchange.aggregation"] != "striped" or cfg["exchange.codec"] != "kbit":
        raise UserError(f"config key exchange.bits: {cfg['exchange.bits']} chooses the kbit "
                        f"codec's width; it needs exchange.aggregation=striped and "
                        f"exchange.codec=kbit (got {cfg['exchange.aggregation']}"
                        f"{' + ' + cfg['exchange.codec'] if cfg['exchange.aggregation'] == 'striped' else ''})")
    return True


def configured_codec(cfg, bits=None):
    """The striped exchange's codec as the config sets it (the kbit codec at `bits`, or at
    exchange.bits_start when a rule chooses the width)."""
    device, name, options = cfg["train.device"], cfg["exchange.codec"], {}
    if name == "kbit":
        width = bits or (cfg["exchange.bits_start"] if adaptive_bits(cfg) else cfg["exchange.bits"])
        options = {"bits": width, "range": cfg["exchange.kbit_range"]}
    elif name == "dettmers":
        options = {"dtype": cfg["exchange.dettmers_type"], "block": cfg["exchange.dettmers_block"],
                   "refresh": cfg["exchange.dettmers_refresh"]}
    return make_codec(name, device, **options)


def cold_start(cfg):
    """exchange.cold_start_frames when it applies (striped with a lossy codec), else 0."""
    frames = cfg["exchange.cold_start_frames"]
    if not frames or cfg["exchange.aggregation"] != "striped" \
            or cfg["exchange.codec"] == "float32":
        return 0
    if not isinstance(cfg["exchange.bits"], int) and cfg["exchange.codec"] == "kbit":
        raise UserError(f"config key exchange.cold_start_frames: not supported with "
                        f"exchange.bits={cfg['exchange.bits']} (the width controller would "
                        f"start during the float32 phase); set one of them")
    return frames


def set_cold_start(ex, cfg, on):
    """The cold start's codec (no exchange in flight): float32 while on, then the configured
    codec with both residuals zeroed (the float32 codec leaves none; explicit all the same)."""
    ex.set_codec(make_codec("float32", cfg["train.device"]) if on else configured_codec(cfg),
                 cfg["exchange.fuse_owner"])
    if not on:
        zero(ex.residual1)
        zero(ex.residual2)


def set_bits(ex, cfg, bits):
    """Switch a striped kbit exchange to `bits` from the next encode (nothing in flight)."""
    ex.set_codec(configured_codec(cfg, bits), cfg["exchange.fuse_owner"])


def make_exchange(cfg, comm, mats, group=None):
    """The exchange the config asks for, over the flat layout `mats` (FlatParams.matrices),
    among the data ranks of `comm`, on the config's device; `group`: the model group's
    communicator of a split model (model.parallel > 1). ex.transport says how its bytes
    move (for the log)."""
    device = cfg["train.device"]
    aware, why = False, ""
    if device == "cuda":
        aware, why = mpi_cuda_aware(cfg["exchange.mpi_cuda_aware"],
                                    os.environ.get(ENV_CUDA_AWARE, ""))
    if cfg["exchange.aggregation"] == "allreduce":
        nccl = None
        if device == "cuda" and comm.Get_size() > 1 and cfg["exchange.nccl"] != "false":
            # NCCL refuses two ranks on one device (NCCL_ERROR_INVALID_USAGE): never ask it
            shared = shared_gpus(comm)
            ok, version = (False, "") if shared else nccl_available()
            if ok:
                nccl = Nccl(comm)
                why = version
            elif shared and cfg["exchange.nccl"] == "true":
                raise UserError(f"config key exchange.nccl: true, but {shared}, and NCCL "
                                f"refuses two ranks on one device: one rank per GPU, or "
                                f"exchange.nccl=auto (MPI then)")
            elif shared:
                why = (f"not NCCL: {shared}, and NCCL refuses two ranks on one device"
                       + (f"; {why}" if why else ""))
            elif cfg["exchange.nccl"] == "true":
                raise UserError(f"config key exchange.nccl: true, but NCCL does not load "
                                f"({version}); install the 'gpu' extra (cupy, nvidia-nccl-cu12)")
        ex = Allreduce(comm, sum(m.size for m in exchanged(mats)),
                       cfg["exchange.allreduce_dtype"], device=device, cuda_aware=aware,
                       nccl=nccl)
        # exchange.overlap (config.overlap_blocker says where it cannot run): the step
        # hands it the model's buckets (Allreduce.set_buckets)
        ex.overlap = (cfg["exchange.overlap"] != "false" and comm.Get_size() > 1
                      and overlap_blocker(cfg) is None)
        ex.bucket_bytes = int(cfg["exchange.bucket_mb"] * (1 << 20))
    else:
        widest = None
        codec = configured_codec(cfg)
        if adaptive_bits(cfg):   # starts narrow; buffers for the widest (8 bits)
            widest = make_codec("kbit", device, bits=8, range=cfg["exchange.kbit_range"])
        if cold_start(cfg):      # starts with float32: buffers for it
            widest = make_codec("float32", device)
        ex = Striped(comm, mats, codec, error_feedback=cfg["exchange.error_feedback"],
                     device=device, cuda_aware=aware, fuse_owner=cfg["exchange.fuse_owner"],
                     widest=widest,
                     group=group if cfg["model.codec_columns"] == "whole" else None)
    ex.transport = ex.describe_transport(why)
    if cfg["exchange.progress"] == "thread":
        ex.poller = Poller()
    return ex


class _Collective:
    """What both exchanges share: progress-thread hooks and the blocking reference time."""
    poller = None     # hpcsgd.comm.progress.Poller, with exchange.progress=thread
    fuses_owner = fuses_apply = False

    def _poll(self, req):
        """exchange.progress=thread: a thread drives the collective just posted until wait()."""
        if self.poller is not None and req is not None and not isinstance(req, str):
            self.poller.start(req)

    def _stop_polling(self):
        if self.poller is not None:
            self.poller.stop()

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


class Allreduce(_Collective):
    """Sum in place with MPI Allreduce over one fused buffer; every rank post-processes the
    whole sum (the optimizer state is replicated).

    dtype "float32": the gradient's own flat buffer is the MPI buffer (no copy, MPI.IN_PLACE).
    dtype "float16" (half the bytes of float32; MPI has no float16 SUM): every rank rounds
    g * a to float16 (F16C, hpcsgd/half.py), sends piece j of it to rank j (Alltoallv: a
    reduce-scatter), sums the K pieces of its own piece in float32 in rank order and rounds the
    sum times c to float16 once, then an Allgatherv brings every piece to every rank, which
    decodes it times 1 / (a c). The bytes are a ring Allreduce's, 2 (K - 1) / K of the float16
    buffer per rank. Scales: without a loss scale a = c = 1 / K (the division by K keeps the
    float16 sum in range; values below 6e-8 * K flush to zero); with a loss scale S
    (train.loss_scale; the step sets `loss_scale`) a = S, so a mixed-precision gradient, a
    float16 value divided by S, is sent exactly as the backward pass computed it, and c = 1 / K
    (the mean of values the overflow vote kept in range). Precision: ~3 significant digits
    (relative error 2^-11 per value and once for the sum). A value or a sum beyond float16's
    range is reported as an error. There is no error feedback on this path (use striped +
    float16 codec for it). The float32 sum and the Allgatherv run in wait().

    GPU ranks: with `nccl` (hpcsgd.comm.gpu.Nccl) the sum runs on the device, float16
    natively, on NCCL's own stream (so a double-buffered exchange overlaps the next half's
    compute). Without it, MPI sums the device buffer (CUDA-aware) or its pinned host mirror;
    float16 is then always staged: its conversions and float32 sum run on the host.

    `size` is the exchanged prefix of the flat gradient (parameters with exchange "none"
    follow it and are left alone).

    Overlapped (`overlap`, exchange.overlap; float32 on CPU ranks, the gradient finished by
    nothing after the backward pass: config.overlap_blocker): the buffer is summed in buckets,
    a layer's gradient (with the layers above it, at least `bucket_bytes`: exchange.bucket_mb)
    posted as an Iallreduce as soon as the backward pass has finished it (ready(i) after
    layer i), while the layers below compute; the step calls test() (MPI_Test) after every
    GEMM, since MPI progresses a nonblocking collective only inside MPI calls. send() posts what is left and
    waits for all. The buckets are a function of the model's layout alone, and a rank posts
    every one in the same order (one without frames posts them all in send()), so the
    collectives match on every rank. Every element is summed once, by the same Allreduce
    arithmetic as one buffer (up to MPI's choice of algorithm per message size).
    """
    PHASE = {"encode": "encode", "send": "allreduce", "owner": None, "reduce": "decode",
             "post_process": "post_process", "reencode": None, "gather": None,
             "update": "apply"}
    replicated_optimizer = True   # every rank holds and updates the full optimizer state
    loss_scale = None             # float16: the loss scale of the gradient being sent

    def __init__(self, comm, size, dtype="float32", device="cpu", cuda_aware=False, nccl=None):
        if dtype not in ("float32", "float16"):
            raise UserError(f"config key exchange.allreduce_dtype: {dtype!r} is not float32 or float16")
        self.comm, self.world, self.size, self.dtype = comm, comm.Get_size(), size, dtype
        self.device, self.nccl = device, nccl
        self.state_size = size        # post_exchange sees the whole exchanged sum
        # the float16 sum's buffer on the device with NCCL; else the MPI path's host buffers:
        # the rank's float16 gradient, the K pieces of its own piece, and the gathered sum
        half16 = dtype == "float16"
        self.half = zeros(size if half16 and nccl is not None else 0, np.float16, device)
        k, rank = self.world, comm.Get_rank()
        self.counts = np.array([size // k + (j < size % k) for j in range(k)], np.int64)
        self.displs = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        mpi16 = half16 and nccl is None
        self.h_send = np.empty(size if mpi16 else 0, np.uint16)
        self.h_gather = np.empty(size if mpi16 else 0, np.uint16)
        self.h_parts = np.empty((k, int(self.counts[rank]) if mpi16 else 0), np.uint16)
        # float32 with the sum in grad itself (one rank: nothing to sum; CPU ranks: MPI sums
        # in place): the update is the optimizer's one fused pass over the gradient
        # (Optimizer.fused_update: the same bits as post_exchange + apply, one pass over
        # memory instead of two)
        self.solo = k == 1 and dtype == "float32"
        self.fuses_owner = self.fuses_apply = dtype == "float32" and (k == 1 or device == "cpu")
        self._opt = None
        self._scales = (1.0, 1.0)   # the float16 path's (a, c) of the exchange in flight
        self._gathered = False      # ... and whether its sum has been gathered
        # GPU ranks without NCCL: what MPI reads for the gradient (float16: always the host)
        self.stage = Staging((size,), np.float32, device, cuda_aware and dtype == "float32")
        # the exchange in flight: gradient, MPI buffer, request, and whether the sum is back
        # in the gradient's buffer
        self._grad, self._buf, self._req, self._reduced = None, None, None, False
        # overlap: the buckets [lo, hi) in posting order, how many may be posted once layer
        # i's backward is done, and this step's gradient, buckets posted and their requests
        self.overlap, self.bucket_bytes = False, 1 << 20
        self.buckets, self._postable = [(0, size)], {}   # one bucket until set_buckets
        self._flat, self._posted, self._reqs = None, 0, []

    def describe_transport(self, why):
        if self.nccl is not None:
            return f"NCCL on the device ({why})"
        return self.stage.describe(why)

    def bytes_on_wire(self):
        """Bytes this rank sends per exchange: a ring Allreduce's 2 (K - 1) / K of the
        buffer (MPI's and NCCL's large-message algorithm; the float16 path's reduce-scatter
        + allgather is the same), none on one rank."""
        item = 2 if self.dtype == "float16" else 4
        return int(2 * (self.world - 1) * self.size * item / self.world)

    def encode(self, grad):
        """The buffer the collective sums: grad itself (float32), g / K in float16, or its
        pinned host mirror (GPU ranks without CUDA-aware MPI; a device sync point). grad must
        not be touched until the update is applied; one exchange in flight at a time."""
        grad = grad[:self.size]
        self._grad, self._req, self._reduced = grad, None, False
        if self.solo:                 # one rank: the sum is grad itself, where it lies
            self._buf, self._reduced = None, True
            return
        if self.nccl is not None:     # GPU ranks with NCCL (K > 1): all on the device
            self._buf = grad
            if self.dtype == "float16":
                cp = cupy_module()
                cp.multiply(cp.asarray(grad), np.float32(1.0 / self.world),
                            out=cp.asarray(self.half), casting="unsafe")
                self._buf = self.half
            return
        self._buf = self.stage.to_mpi(grad)   # device sync point; staged: device -> host copy
        if self.dtype == "float16":
            k = self.world
            a = self.loss_scale if self.loss_scale else 1.0 / k
            self._scales, self._gathered = (a, 1.0 / k), False
            bad = half.to_half_cpu(self._buf, np.float32(a), self.h_send)
            if bad:
                raise ValueError(f"float16 allreduce: {bad} gradient value(s) beyond float16's "
                                 f"range after the scale {a:g}; use exchange.allreduce_dtype="
                                 f"float32, a smaller minibatch, or train.loss_scale")
            self._buf = self.h_send

    def set_buckets(self, ready_offsets):
        """Overlap: the buckets from the model's ready_offsets() (offsets[i]: where the
        finished gradient begins once layer i's backward is done), top layer first; a bucket
        smaller than bucket_bytes waits for the next layer's gradient (each collective costs
        a latency)."""
        self.buckets, self._postable, hi = [], {}, self.size
        for i in reversed(range(len(ready_offsets))):
            lo = min(int(ready_offsets[i]), hi)
            if hi > lo and (hi - lo) * 4 >= self.bucket_bytes:
                self.buckets.append((lo, hi))
                hi = lo
            self._postable[i] = len(self.buckets)
        if hi > 0:
            self.buckets.append((0, hi))

    def begin(self, grad):
        """Overlap: the gradient buffer this step's backward pass writes (before it); the
        next send() posts the buckets ready() has not."""
        self._flat, self._posted, self._reqs = grad[:self.size], 0, []

    def ready(self, layer):
        """Overlap: layer `layer`'s backward is done: post the buckets it completes."""
        self._post(self._postable.get(layer, 0))

    def _post(self, upto):
        from mpi4py import MPI
        while self._posted < upto:
            lo, hi = self.buckets[self._posted]
            self._reqs.append(self.comm.Iallreduce(MPI.IN_PLACE, self._flat[lo:hi], op=MPI.SUM))
            self._posted += 1

    def send(self, blocking=False):
        """Allreduce in place (Iallreduce unless `blocking`; NCCL on its stream on GPU
        ranks; overlapped: the buckets not yet posted). A cross-rank sync point when
        blocking."""
        from mpi4py import MPI
        if self._flat is not None:    # overlapped: begin() was called for this gradient
            self._post(len(self.buckets))
            self._flat = None
            if blocking:
                MPI.Request.Waitall(self._reqs)
                self._reqs = []
            return
        if self.nccl is not None:
            self.nccl.start_sum(self._buf)   # queued behind the gradient's kernels
            self._req = "nccl"
        elif self.world > 1 and self.dtype == "float16":   # the reduce-scatter leg
            send, recv = self._pieces()
            if blocking:
                self.comm.Alltoallv(send, recv)
            else:
                self._req = self.comm.Ialltoallv(send, recv)
        elif self.world > 1:
            if blocking:
                self.comm.Allreduce(MPI.IN_PLACE, self._buf, op=MPI.SUM)
            else:
                self._req = self.comm.Iallreduce(MPI.IN_PLACE, self._buf, op=MPI.SUM)
        self._poll(self._req)

    def test(self):
        """Drive MPI's progress engine once (MPICH progresses a nonblocking collective only
        inside MPI calls unless async progress is on). NCCL needs no help."""
        if self._req is not None and self._req != "nccl":
            self._req.Test()
        elif self._reqs:
            from mpi4py import MPI
            MPI.Request.Testall(self._reqs)

    def wait(self):
        """Complete the communication of the exchange in flight."""
        self._stop_polling()
        if self._reqs:
            from mpi4py import MPI
            MPI.Request.Waitall(self._reqs)
            self._reqs = []
        if self._req == "nccl":
            self.nccl.wait_sum()   # host waits for the NCCL stream: sync point
        elif self._req is not None:
            self._req.Wait()       # cross-rank sync point
        self._req = None
        if self.dtype == "float16" and self.nccl is None and self._grad is not None \
                and not (self._reduced or self._gathered):
            self._sum_and_gather()
            self._gathered = True

    def _pieces(self):
        """The reduce-scatter's MPI buffer specs: piece j of the float16 gradient to rank j;
        the K pieces of this rank's piece, in rank order."""
        from mpi4py import MPI
        m = self.h_parts.shape[1]
        k = self.world
        return ([self.h_send, (self.counts, self.displs), MPI.UINT16_T],
                [self.h_parts, ([m] * k, [j * m for j in range(k)]), MPI.UINT16_T])

    def _sum_and_gather(self):
        """This rank's piece summed in float32 over the K ranks into its slot of the gathered
        buffer (float16), then the Allgatherv of every slot (blocking: a sync point)."""
        from mpi4py import MPI
        rank = self.comm.Get_rank()
        lo, n = int(self.displs[rank]), int(self.counts[rank])
        parts = self.h_parts if self.world > 1 else self.h_send.reshape(1, -1)
        bad = half.sum_halves_cpu(parts, np.float32(self._scales[1]),
                                  self.h_gather[lo:lo + n])
        if bad:
            raise ValueError(f"float16 allreduce overflowed: {bad} summed value(s) beyond "
                             f"float16's range on rank {rank}; use exchange.allreduce_dtype="
                             f"float32, a smaller minibatch, or train.loss_scale")
        if self.world > 1:
            self.comm.Allgatherv(MPI.IN_PLACE, [self.h_gather, (self.counts, self.displs),
                                                MPI.UINT16_T])

    def reduce(self, params, weight_decay=False):
        """The sum into the gradient's buffer (float16 back to float32 times K; staged sums
        back to the device). Returns (the sum to post-process, the weights it decays)."""
        grad = self._grad
        if not self._reduced:
            if self.dtype == "float16":
                self._from_half(grad)
            elif self.nccl is None:
                self.stage.from_mpi(grad)
            self._reduced = True
        return grad, (params[:self.size] if params is not None else None)

    def reencode(self):
        pass

    def gather(self):
        pass

    def owner_pass(self, params, opt):
        """float32 in place (fuses_owner): post-processing waits for decode_apply's fused
        pass."""
        self._opt = opt

    def decode_apply(self, params, lr):
        """float32 in place (fuses_apply): W -= lr * update in the optimizer's fused pass on
        the sum, where MPI left it."""
        self._opt.fused_update(params[:self.size], self._grad, lr)
        self._grad = None

    def update(self):
        """The update every rank applies: the post-processed sum, in place in grad."""
        grad, self._grad = self._grad, None
        return grad

    def _from_half(self, grad):
        """grad = the float16 sum, unscaled. An overflow (Inf) is an error, not a silent NaN:
        the MPI path checked its sums before the Allgatherv, NCCL's is checked here."""
        if self.nccl is None:
            a, c = self._scales
            host = self.stage.mpi(grad)
            half.from_half_cpu(self.h_gather, np.float32(1.0 / (a * c)), host)
            self.stage.from_mpi(grad)
            return
        cp = cupy_module()
        g = cp.asarray(grad)
        cp.multiply(cp.asarray(self.half), np.float32(self.world), out=g)
        if not bool(cp.isfinite(g).all()):   # device -> host: sync point
            raise ValueError(f"float16 allreduce overflowed (a summed gradient above 65504 * "
                             f"{self.world}); use exchange.allreduce_dtype=float32 or a smaller "
                             f"minibatch")

    def pending_state(self):
        """The exchange in flight, communication completed, as arrays for a checkpoint:
        the summed gradient (its update not yet applied)."""
        self.wait()
        self.reduce(None)
        return {"pending": self._grad}

    def load_pending(self, state, grad):
        """Resume an exchange whose communication had completed: its sum goes into grad."""
        self._grad = grad[:self.size]
        assign(self._grad, state["pending"])
        self._req, self._reduced = None, True

    def _communicate_blocking(self, scratch):
        from mpi4py import MPI
        if self.nccl is not None:
            self.nccl.start_sum(scratch[:self.size] if self.dtype == "float32" else self.half)
            self.nccl.wait_sum()
        elif self.dtype == "float32":
            self.comm.Allreduce(MPI.IN_PLACE, self.stage.to_mpi(scratch[:self.size]),
                                op=MPI.SUM)
            self.stage.from_mpi(scratch[:self.size])
        else:   # the float16 legs on the host buffers (whatever they hold)
            self.comm.Alltoallv(*self._pieces())
            self.comm.Allgatherv(MPI.IN_PLACE, [self.h_gather, (self.counts, self.displs),
                                                MPI.UINT16_T])

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class Striped(_Collective):
    """The paper's O(1) striped aggregation with any codec (see the module docstring).

    Per-rank state (differs between ranks, checkpointed per rank): residual1 (the exchanged
    size, this rank's first error feedback) and residual2 (this rank's stripe, the owner's
    second error feedback). The optimizer's post-exchange state is compact over the stripe:
    build it with Optimizer(size, post_size=ex.state_size). fuse_owner: offer the codec's
    fused owner pass (phases 3-5 in one pass per column) where it has one.
    """
    PHASE = {"encode": "encode", "send": "alltoallv", "owner": "owner", "reduce": "decode_sum",
             "post_process": "post_process", "reencode": "reencode", "gather": "allgatherv",
             "update": "decode_apply"}
    replicated_optimizer = False  # each owner keeps the optimizer state of its stripe only
    # mixed precision (the step sets it): the float16 codec sends v * loss_scale, so that the
    # scaled gradient's small values stay float16 normals (hpcsgd/codecs/floats.py)
    loss_scale = None

    def __init__(self, comm, mats, codec, error_feedback=True, device="cpu", cuda_aware=False,
                 fuse_owner=True, widest=None, group=None):
        """widest: the codec whose packed sizes the buffers are allocated for, when set_codec
        may switch codecs between steps (exchange.bits = oland_raj | mqgrad); default codec.
        group: the model group's communicator when this rank holds a slice of each
        "rows"-split matrix (model.parallel > 1, model.codec_columns = whole): a codec with
        column statistics (codec.column_sums) adds them over the group, so each slice is
        quantized with its whole columns' statistics, as the unsplit model would be."""
        self.comm, self.error_feedback = comm, bool(error_feedback)
        self.group = group.Dup() if group is not None else None   # its own calls, in step order
        self.device = device
        self.mats = mats = exchanged(mats)
        K, me = comm.Get_size(), comm.Get_rank()
        self.world, self.rank = K, me
        self.size = sum(m.size for m in mats)
        self.set_codec(widest or codec, fuse_owner)
        total, mine = int(self.counts.sum()), int(self.counts[me])
        self.send_buf = zeros(total, np.uint8, device)  # my whole gradient, encoded, by owner
        self.gather_buf = zeros(total, np.uint8, device)  # every owner's encoded update
        self.recv_buf = zeros(K * mine, np.uint8, device)  # K contributions to my stripe
        # what MPI gets for each (GPU ranks: the device buffer or its pinned host mirror)
        self.stages = {name: Staging((getattr(self, name + "_buf").size,), np.uint8, device,
                                     cuda_aware)
                       for name in ("send", "gather", "recv")}
        # my stripe, compact: agg (float32 sum -> update; unfused only), residual2, and (for
        # weight decay) a copy of my stripe's weights; views per matrix piece
        self.state_size = sum(p[2] - p[1] for p in self.pieces[me])
        self.residual2 = zeros(self.state_size, np.float32, device)
        self.residual1 = zeros(self.size, np.float32, device)
        self._wstripe = None
        self.set_codec(codec, fuse_owner)
        # the unfused owner's sum buffer: also when another codec may take over (widest)
        self.agg = zeros(self.state_size if not self.fuses_owner or widest is not None
                         or self.float_size else 0, np.float32, device)
        # the column sums of the split matrices' pieces, added over the model group: one row
        # per column of my whole gradient (encode) or of my stripe (reencode)
        n_split = sum(p[3] for row in self.pieces for p in row if self._split(p[0]))
        self._sums = np.zeros((n_split if self.group is not None else 0, 4), np.float64)
        self._grad, self._req = None, None   # the exchange in flight
        self.norm_sq = None   # set to 0.0 to sum the squared norm of my stripe's gradient sums

    def set_codec(self, codec, fuse_owner=True):
        """Use `codec` from the next encode on (no exchange may be in flight): the stripes
        stay, the byte layout follows the codec's packed sizes within the buffers allocated
        for the widest codec. Both residuals carry over (they are float32)."""
        mats, K, me = self.mats, self.world, self.rank
        self.codec = codec
        # "float" matrices go through the float32 codec: summed exactly, never quantized
        floats = make_codec("float32", codec.backend)
        self.codec_of = {m.name: codec if m.exchange == "codec" else floats for m in mats}
        for c in (codec, floats):   # GPU encodes' fault flags: read at send and gather
            c.defer_checks = True
        # "float" matrices (learned clips, after the codec ones) take the unfused steps
        # beside a fused codec: float_pieces
        self.sums_over_group = getattr(self, "group", None) is not None and hasattr(
            codec, "column_sums")
        # the group's sums come between an owner's sum and its re-encode: unfused
        self.fuses_owner = bool(fuse_owner) and codec.fused_owner and not self.sums_over_group
        self.fuses_apply = codec.fused_apply
        # pieces[j]: (matrix, flat lo, flat hi, columns, byte offset in a K-layout buffer,
        # nbytes) of owner j's stripe of every matrix, back to back: the send buffer and the
        # gather buffer share this layout (sizes depend only on matrix and owner).
        self.pieces, counts, offset = [], [], 0
        for j in range(K):
            row, start = [], offset
            for m, (lo, hi) in zip(mats, stripe_ranges(mats, j, K)):
                cols = (hi - lo) // m.n_rows if m.n_rows else 0
                nbytes = self.codec_of[m.name].packed_nbytes(cols, m.n_rows) if cols else 0
                if nbytes % 4:
                    raise ValueError(f"{codec.name}: packed size {nbytes} is not 4-byte aligned")
                if nbytes:
                    row.append((m, lo, hi, cols, offset, nbytes))
                offset += nbytes
            self.pieces.append(row)
            counts.append(offset - start)
        self.counts = np.array(counts, np.int64)
        self.displs = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)
        # every piece of my whole gradient, as _encode takes them: (piece, flat lo, flat hi)
        self.send_pieces = [(p, p[1], p[2]) for row in self.pieces for p in row]
        self._grouped = {}   # _by_codec's memo for this layout
        if hasattr(self, "agg") and (offset > self.send_buf.size
                                     or K * self.counts[me] > self.recv_buf.size
                                     or (not self.fuses_owner and self.agg.size < self.state_size)):
            raise ValueError(f"exchange: codec {codec.name} does not fit the buffers allocated "
                             f"for the widest codec")
        mine = int(self.counts[me])
        self.recv_counts = np.full(K, mine, np.int64)
        self.recv_displs = np.arange(K, dtype=np.int64) * mine
        self.mine, s = [], 0      # (piece, compact lo, compact hi)
        for p in self.pieces[me]:
            self.mine.append((p, s, s + p[2] - p[1]))
            s += p[2] - p[1]
        self.codec_mine = [q for q in self.mine if q[0][0].exchange == "codec"]
        self.float_mine = [q for q in self.mine if q[0][0].exchange != "codec"]
        self.float_size = sum(b - a for _, a, b in self.float_mine)

    def describe_transport(self, why):
        return self.stages["send"].describe(why)

    def _mpi(self, name, lo=0, hi=None):
        """Buffer `name` handed to MPI: its device writes complete (sync point) and, staged,
        range [lo, hi) copied to its host mirror."""
        return self.stages[name].to_mpi(getattr(self, name + "_buf"), lo, hi)

    def _from_mpi(self, name, lo=0, hi=None):
        self.stages[name].from_mpi(getattr(self, name + "_buf"), lo, hi)

    def bytes_on_wire(self):
        """Bytes this rank sends per step: Alltoallv to the K-1 others + its gathered stripe
        to the K-1 others (a lower bound for any allgather algorithm)."""
        others = self.counts.sum() - self.counts[self.rank]
        return int(others + (self.world - 1) * self.counts[self.rank])

    def encode(self, grad):
        """Phase 1: encode my whole local gradient with residual 1, grouped by owner. grad is
        not read after this, but an update() decodes into it: the step keeps it until then."""
        self._grad = grad
        self.codec.set_loss_scale(self.loss_scale or 1.0)   # for all of this exchange's phases
        if not self.error_feedback:   # the no-feedback baseline: quantize each step afresh
            zero(self.residual1)
            zero(self.residual2)
        self._encode(self.send_pieces, grad, self.residual1, self.send_buf)

    def _split(self, m):
        """Whether matrix m's columns are cut over the model group (their sums are added)."""
        return self.group is not None and m.shard == "rows" and m.exchange == "codec"

    def _encode(self, pieces, src, residual, out):
        """Encode each (piece, a, b) -- piece = (matrix, lo, hi, cols, off, nbytes) -- from
        src[a:b] with residual[a:b] into out[off:off + nbytes]; the split matrices' pieces
        with their column sums added over the model group first (one Allreduce)."""
        sums = None
        if self.sums_over_group:
            from mpi4py import MPI
            k = 0
            for (m, _, _, cols, _, _), a, b in pieces:
                if self._split(m):
                    self.codec.column_sums(src[a:b].reshape(cols, m.n_rows),
                                           residual[a:b].reshape(cols, m.n_rows),
                                           self._sums[k:k + cols])
                    k += cols
            sums = self._sums[:k]
            self.group.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)   # model-group sync point
        if sums is None:   # each codec's matrices at once (one launch on GPU ranks)
            for codec, items in self._by_codec(pieces):
                codec.encode_many(items, src, residual, out)
            return
        k = 0
        for (m, _, _, cols, off, nb), a, b in pieces:
            args = (src[a:b].reshape(cols, m.n_rows), residual[a:b].reshape(cols, m.n_rows),
                    out[off:off + nb])
            if self._split(m):
                self.codec.encode(*args, sums=sums[k:k + cols])
                k += cols
            else:
                self.codec_of[m.name].encode(*args)

    def _by_codec(self, pieces, shift=0):
        """[(codec, items)]: pieces ((matrix, lo, hi, cols, byte offset, nbytes), a, b) as each
        codec's items for its *_many methods: (element offset a, columns, rows, byte offset -
        shift); made once per pieces list and codec (set_codec starts afresh)."""
        key = (id(pieces), shift)
        held = self._grouped.get(key)   # (the list itself: its id stays its own, grouped)
        if held is None or held[0] is not pieces:
            out = {}
            for (m, _, _, cols, off, _), a, _ in pieces:
                codec = self.codec_of[m.name]
                out.setdefault(id(codec), (codec, []))[1].append(
                    (int(a), int(cols), int(m.n_rows), int(off - shift)))
            held = self._grouped[key] = (pieces, [(c, tuple(i)) for c, i in out.values()])
        return held[1]

    def _check_encodes(self):
        """The GPU encodes' fault flags since the last check, read at once (after a sync)."""
        for c in {id(c): c for c in self.codec_of.values()}.values():
            c.check_flags()

    def send(self, blocking=False):
        """Phase 2: stripe j of every rank to rank j (Ialltoallv unless `blocking`: double
        buffering computes the next half's gradient meanwhile)."""
        from mpi4py import MPI
        send = [self._mpi("send"), (self.counts, self.displs), MPI.BYTE]   # device sync point
        self._check_encodes()
        recv = [self.stages["recv"].mpi(self.recv_buf), (self.recv_counts, self.recv_displs),
                MPI.BYTE]
        if blocking:
            self.comm.Alltoallv(send, recv)   # cross-rank sync point
            self._from_mpi("recv")
        else:
            self._req = self.comm.Ialltoallv(send, recv)
            self._poll(self._req)

    def test(self):
        """Drive MPI's progress engine once (see Allreduce.test)."""
        if self._req is not None:
            self._req.Test()

    def wait(self):
        """Complete the Alltoallv in flight: my K contributions are then in recv."""
        self._stop_polling()
        if self._req is not None:
            self._req.Wait()   # cross-rank sync point
            self._from_mpi("recv")
            self._req = None

    def owner_pass(self, params, opt):
        """Phases 3-5 in one pass per column (the codec's fused owner pass, with the
        optimizer's element arithmetic; its per-step scalars must be the started step's)."""
        lo = int(self.displs[self.rank])
        mine = int(self.counts[self.rank])   # the buffer may be sized for a wider codec
        self.codec.owner_pass(self.recv_buf[:self.world * mine], self.world, (lo, lo + mine),
                              self.codec_mine, params, opt, self.residual2, self.gather_buf)
        if self.float_mine:   # the float matrices' pieces: the three steps, unfused
            total, weights = self.reduce(params, opt.weight_decay != 0, self.float_mine)
            for _, a, b in self.float_mine:
                opt.post_exchange(total, weights, a, b)
            self.reencode(self.float_mine)

    def reduce(self, params, weight_decay=False, pieces=None):
        """Phase 3: decode and sum the K contributions to my stripe (the first overwrites, so
        no zeroing pass), in source order 0..K-1 so every run adds in the same order. Returns
        (the compact sum to post-process, the weights it decays: a compact copy of my
        stripe's weights if weight_decay, else the sum itself, which the optimizer then does
        not read). pieces: a part of my stripe's (default all of it)."""
        me, mine = self.rank, int(self.counts[self.rank])
        pieces = self.mine if pieces is None else pieces
        for codec, items in self._by_codec(pieces, shift=int(self.displs[me])):
            codec.decode_sum_many(items, self.recv_buf, mine, self.world, self.agg)
        if self.norm_sq is not None:   # the adaptive bit width's gradient norm (bitwidth.py)
            total = to_host(self.agg)
            self.norm_sq += float(np.dot(total, total))
        weights = self.agg
        if weight_decay:
            if self._wstripe is None:
                self._wstripe = zeros(self.state_size, np.float32, self.device)
            for (m, lo, hi, *_), a, b in pieces:
                assign(self._wstripe[a:b], params[lo:hi])
            weights = self._wstripe
        return self.agg, weights

    def reencode(self, pieces=None):
        """Phase 5: my updated stripe (or these pieces of it), quantized with my second
        residual, into my gather slot."""
        self._encode(self.mine if pieces is None else pieces, self.agg, self.residual2,
                     self.gather_buf)

    def gather(self):
        """Phase 6: every owner's stripe to every rank (a cross-rank sync point)."""
        from mpi4py import MPI
        lo = int(self.displs[self.rank])
        gather = self._mpi("gather", lo, lo + int(self.counts[self.rank]))   # device sync
        self._check_encodes()
        self.comm.Allgatherv(MPI.IN_PLACE, [gather, (self.counts, self.displs), MPI.BYTE])
        self._from_mpi("gather")

    def decode_apply(self, params, lr):
        """Phase 7 fused with the weight update: W -= lr * decoded, one pass over W (the
        codec's decode_apply: the same arithmetic as Optimizer.apply, so the same bits)."""
        for codec, items in self._by_codec(self.send_pieces):   # every piece: flat lo
            if codec is self.codec:   # every matrix of the codec in one pass (one launch)
                codec.decode_many(items, self.gather_buf, params, lr)
                continue
            codec.decode_many(items, self.gather_buf, self._grad)   # float matrices: decode
            for lo, cols, rows, _ in items:                          # into the spent gradient,
                apply_update(params[lo:lo + cols * rows], self._grad[lo:lo + cols * rows],
                             lr, self.device)                        # then apply
        self._grad = None

    def update(self):
        """Phase 7: every stripe decoded into the gradient's buffer (the local gradient is
        spent); returns the update over the exchanged prefix."""
        grad, self._grad = self._grad, None
        for codec, items in self._by_codec(self.send_pieces):   # every piece: flat lo
            codec.decode_many(items, self.gather_buf, grad)
        return grad[:self.size]

    def _communicate_blocking(self, scratch):
        from mpi4py import MPI
        self.comm.Alltoallv([self._mpi("send"), (self.counts, self.displs), MPI.BYTE],
                            [self.stages["recv"].mpi(self.recv_buf),
                             (self.recv_counts, self.recv_displs), MPI.BYTE])
        self._from_mpi("recv")
        gather = self._mpi("gather")
        self.comm.Allgatherv(MPI.IN_PLACE, [gather, (self.counts, self.displs), MPI.BYTE])
        self._from_mpi("gather")

    def pending_state(self):
        """The exchange in flight, Alltoallv completed, for a checkpoint: my K received
        contributions (phases 3-7 not yet done)."""
        self.wait()
        return {"pending": self.recv_buf,
                "pending_scale": np.array([getattr(self.codec, "scale", 1.0)], np.float64)}

    def load_pending(self, state, grad):
        """Resume an exchange whose Alltoallv had completed (grad: the buffer a non-fused
        codec decodes into)."""
        assign(self.recv_buf, state["pending"])
        if "pending_scale" in state and hasattr(self.codec, "scale"):
            self.codec.scale = float(np.asarray(state["pending_scale"])[0])
        self._grad, self._req = grad, None

    def state_dict(self):
        """This rank's error feedback (by reference): both residuals; and the packed buffers
        when the codec reads state from them (Dettmers' reused scales)."""
        state = {"residual1": self.residual1, "residual2": self.residual2}
        if self.codec.buffer_state:
            state.update(send_buf=self.send_buf, gather_buf=self.gather_buf)
        return state

    def load_state_dict(self, state):
        # the buffers are absent from a checkpoint re-striped to another K, or of a codec that
        # keeps nothing in them, or of another layout (dettmers_block): the codec then starts
        # afresh (Dettmers: new scales at the first encode)
        names = ("residual1", "residual2") + tuple(
            n for n in ("send_buf", "gather_buf") if n in state and self.codec.buffer_state
            and tuple(state[n].shape) == tuple(getattr(self, n).shape))
        for name in names:
            src = state[name]
            if tuple(src.shape) != tuple(getattr(self, name).shape):
                raise UserError(f"checkpoint: exchange {name} has shape {src.shape}, this rank "
                                f"needs {getattr(self, name).shape} (another K or model?)")
            assign(getattr(self, name), src)
