"""Model parallelism: every linear layer's weight matrix split by output columns over the M
ranks of a model group (grid.model), the softmax computed without gathering the logits.

    group = ModelGroup(grid.model)                       # M ranks, consecutive in the world
    net = dnn(440, [2048] * 7, 9304, group=group)        # hpcsgd.model.dnn: split layers

The split (Seide et al. 2014 run 2-way model parallelism inside a node, Table 5; Megatron's
column-parallel linear layer is the same map). A layer W (n_in, n_out), y = f(x @ W + b):
model rank j holds the columns [lo_j, hi_j) of W and b, split as evenly as the width allows
(the first n_out % M ranks one more: 40 labels over M = 3 are 14, 13, 13).
    forward   y_j = f(x @ W_j + b_j) on every rank's full input x, then an Allgatherv of the
              y_j: every rank holds the whole y, the next layer's input
    backward  dz_j = dy_j * f'(y_j); dW_j = x^T dz_j (the full x is here: no communication);
              dx = sum over j of dz_j W_j^T: each rank computes its term, one GEMM per
              destination block, straight into a Reduce_scatter's send buffer; rank j receives
              the sum for the columns it owns of the layer below -- its dy
    softmax   logits z_j = x @ W_j + b_j stay split: per frame each rank sends 4 numbers (its
              max, its sum of exp(z - max), the target logit if it owns the label, its first
              argmax) in one Allgather (float32 holds each exactly as computed); every rank then has the same log-sum-exp, CE and argmax
The other arrangement, Megatron's column/row pairs with one Allreduce each way, moves the
same bytes in fewer calls but needs layers in pairs; this one splits any stack, an odd
number of layers and the softmax included, and keeps every layer alike.

A split layer's gradient comes down as its own slice: the layer above writes it into the first
n * c_j values of the Network's dx buffer, (n, c_j) contiguous. The input layer computes no dx
(nothing below it). Every buffer is a preallocated workspace (Network.workspaces); every MPI
call an uppercase buffer call; activations travel as float32 (model.activation_codec: the
8-bit and float16 forms are not built yet).

Traffic per step on n frames, counted by ModelGroup (tests/test_parallel.py checks the counts
against this formula): the Allgatherv of every hidden layer's output (n x n_out values, a rank
receives n (n_out - c_j) of them), the Reduce_scatter of every layer's input gradient but the
first's (n x n_in, a rank sends n (n_in - c'_j)), and the softmax's 4 values per frame from each rank to every other.

Checkpoints hold whole matrices (to_whole / from_whole): a run resumes at another M, and
`hpcsgd eval`, `infer` and `export` read it as the unsplit model.
"""
import time

import numpy as np

from hpcsgd.device import matmul
from hpcsgd.model import kernels as K
from hpcsgd.model.kernels_parallel import STATS
from hpcsgd.model.flat import ParamSpec, matrices
from hpcsgd.model.layers import ACTIVATIONS, glorot_uniform

def split_columns(n, parts):
    """[lo_0, lo_1, ..., n]: n columns over `parts` ranks, the first n % parts one wider."""
    base, extra = divmod(int(n), int(parts))
    counts = [base + (j < extra) for j in range(parts)]
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


ACTIVATION_CODECS = ("float32", "float16", "dettmers", "dettmers_linear")


def activation_codec(name, block=0):
    """A codec for activation traffic (no error feedback: activations do not recur), or None
    for float32. dettmers: the 8-bit dynamic tree (or linear) type, abs-max per row of the
    (n, c) block (block=0), or per `block` values; a codec per row width, made on demand."""
    from hpcsgd.codecs import make_codec
    if name not in ACTIVATION_CODECS:
        raise ValueError(f"activation codec {name!r}: expected one of {ACTIVATION_CODECS}")
    if name == "float32":
        return None
    if name == "float16":
        codec = make_codec("float16", error_feedback=False)
        return lambda width: codec
    made = {}

    def for_width(width):
        if width not in made:
            made[width] = make_codec("dettmers", error_feedback=False, norm="absmax",
                                     dtype="linear" if name == "dettmers_linear"
                                     else "dynamic_tree", block=block or width)
        return made[width]
    return for_width


class ModelGroup:
    """The model-parallel group as the split layers use it: the communicator, this rank's
    place, the activation codec, and the bytes this rank sent and received per kind of call
    (the traffic test). Coded traffic: each block is encoded by its sender and decoded by
    every receiver (the Allgather: the sender too, so that every rank computes on the same
    values); the Reduce_scatter becomes an Alltoallv of coded blocks, each owner adding its
    own exact block and the others' decoded ones in rank order."""

    def __init__(self, comm, codec="float32", block=0):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.codec_name, self.codec = codec, activation_codec(codec, block)
        self.sent = {"allgather": 0, "reduce_scatter": 0, "softmax": 0}
        self.received = dict(self.sent)
        self.seconds = 0.0   # in these calls, coding included (bench train --grid)
        self._bytes = {}   # coded traffic's byte buffers, grown once to the largest call

    def _scratch(self, name, nbytes):
        buf = self._bytes.get(name)
        if buf is None or buf.size < nbytes:
            buf = self._bytes[name] = np.empty(nbytes, np.uint8)
        return buf[:nbytes]

    def allgather_columns(self, local, out, bounds, recv):
        """out (n, N) <- every rank's columns: local (n, c_me) C-contiguous; recv: scratch of
        n * N values (the blocks of all ranks, back to back, then copied into place)."""
        t0 = time.perf_counter()
        if self.codec is not None:
            self._allgather_coded(local, out, bounds, recv)
        else:
            self._allgather(local, out, bounds, recv)
        self.seconds += time.perf_counter() - t0

    def _allgather(self, local, out, bounds, recv):
        n = local.shape[0]
        counts = (np.diff(bounds) * n).astype(np.int64)
        displs = (bounds[:-1] * n).astype(np.int64)
        self.comm.Allgatherv(local, [recv[:n * bounds[-1]], (counts, displs)])
        for j in range(self.size):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            out[:, lo:hi] = recv[displs[j]:displs[j] + counts[j]].reshape(n, hi - lo)
        mine = int(counts[self.rank]) * local.itemsize
        self.sent["allgather"] += mine * (self.size - 1)
        self.received["allgather"] += int(counts.sum()) * local.itemsize - mine

    def _allgather_coded(self, local, out, bounds, recv):
        n = local.shape[0]
        widths = np.diff(bounds)
        nbytes = np.array([self.codec(int(c)).packed_nbytes(n, int(c)) for c in widths],
                          np.int64)
        displs = np.concatenate([[0], np.cumsum(nbytes)[:-1]]).astype(np.int64)
        packed = self._scratch("allgather", int(nbytes.sum()))
        me = self.rank
        self.codec(int(widths[me])).encode(local, None,
                                           packed[displs[me]:displs[me] + nbytes[me]])
        from mpi4py import MPI
        self.comm.Allgatherv(MPI.IN_PLACE, [packed, (nbytes, displs)])
        for j in range(self.size):
            lo, hi = int(bounds[j]), int(bounds[j + 1])
            block = recv[n * lo:n * hi].reshape(n, hi - lo)
            self.codec(hi - lo).decode(packed[displs[j]:displs[j] + nbytes[j]], block)
            out[:, lo:hi] = block
        self.sent["allgather"] += int(nbytes[me]) * (self.size - 1)
        self.received["allgather"] += int(nbytes.sum() - nbytes[me])

    def reduce_scatter_columns(self, send, out, bounds, n):
        """out (n * c_me values) <- the sum over ranks of each rank's block for my columns;
        send: the blocks (n, c_j) for j = 0..M-1, back to back."""
        t0 = time.perf_counter()
        if self.codec is not None:
            self._reduce_scatter_coded(send, out, bounds, n)
        else:
            self._reduce_scatter(send, out, bounds, n)
        self.seconds += time.perf_counter() - t0

    def _reduce_scatter(self, send, out, bounds, n):
        counts = (np.diff(bounds) * n).astype(np.int64)
        self.comm.Reduce_scatter(send[:int(counts.sum())], out[:int(counts[self.rank])],
                                 counts)
        mine = int(counts[self.rank]) * send.itemsize
        self.sent["reduce_scatter"] += int(counts.sum()) * send.itemsize - mine
        self.received["reduce_scatter"] += mine * (self.size - 1)

    def _reduce_scatter_coded(self, send, out, bounds, n):
        me, M = self.rank, self.size
        widths = np.diff(bounds)
        c = int(widths[me])
        codec = self.codec
        out_nbytes = np.array([codec(int(w)).packed_nbytes(n, int(w)) for w in widths],
                              np.int64)
        send_counts = out_nbytes.copy()
        send_counts[me] = 0
        send_displs = np.concatenate([[0], np.cumsum(send_counts)[:-1]]).astype(np.int64)
        mine_nbytes = int(out_nbytes[me])
        recv_counts = np.full(M, mine_nbytes, np.int64)
        recv_counts[me] = 0
        recv_displs = np.concatenate([[0], np.cumsum(recv_counts)[:-1]]).astype(np.int64)
        packed = self._scratch("rs_send", int(send_counts.sum()))
        for j in range(M):
            if j != me:
                lo, hi = int(bounds[j]), int(bounds[j + 1])
                codec(hi - lo).encode(send[n * lo:n * hi].reshape(n, hi - lo), None,
                                      packed[send_displs[j]:send_displs[j] + send_counts[j]])
        got = self._scratch("rs_recv", int(recv_counts.sum()))
        self.comm.Alltoallv([packed, (send_counts, send_displs)],
                            [got, (recv_counts, recv_displs)])
        total = out[:n * c].reshape(n, c)
        exact = send[n * int(bounds[me]):n * int(bounds[me + 1])].reshape(n, c)
        for r in range(M):   # in rank order: every run adds in the same order
            if r == me:
                if r == 0:
                    total[...] = exact
                else:
                    total += exact
            else:
                piece = got[recv_displs[r]:recv_displs[r] + mine_nbytes]
                (codec(c).decode if r == 0 else codec(c).decode_accumulate)(piece, total)
        self.sent["reduce_scatter"] += int(send_counts.sum())
        self.received["reduce_scatter"] += int(recv_counts.sum())

    def allgather_stats(self, stats, out):
        """out (M * n * STATS values) <- every rank's (n, STATS) softmax statistics (never
        coded: a max or a sum of exponentials in 8 bits would break the softmax)."""
        n = stats.shape[0]
        t0 = time.perf_counter()
        self.comm.Allgather(stats, out)
        self.seconds += time.perf_counter() - t0
        self.sent["softmax"] += n * STATS * stats.itemsize * (self.size - 1)
        self.received["softmax"] += n * STATS * stats.itemsize * (self.size - 1)

    def traffic(self):
        """{kind: (bytes sent, bytes received)} since the start."""
        return {k: (self.sent[k], self.received[k]) for k in self.sent}


class _Columns:
    """What both split layers share: this rank's columns [lo, hi) of {name}.w (n_in, n_out)
    and {name}.b (1, n_out), and the input gradient's Reduce_scatter."""

    def __init__(self, name, n_in, n_out, group):
        self.W, self.b = f"{name}.w", f"{name}.b"
        self.n_in, self.n_out = int(n_in), int(n_out)
        self.group = group
        self.bounds = split_columns(self.n_out, group.size)        # my columns of W
        self.below = split_columns(self.n_in, group.size)          # the layer below's
        self.lo, self.hi = int(self.bounds[group.rank]), int(self.bounds[group.rank + 1])
        self.cols = self.hi - self.lo
        if self.cols < 1:
            raise ValueError(f"layer {name}: {self.n_out} outputs over {group.size} model "
                             f"ranks leave rank {group.rank} none; use model.parallel <= "
                             f"{self.n_out}")
        self.gemm_macs = self.n_in * self.cols

    def specs(self):
        return [ParamSpec(self.W, (self.n_in, self.cols), "weight", "codec", "rows"),
                ParamSpec(self.b, (1, self.cols), "bias", "codec", "rows")]

    def whole(self):
        """{name: (whole shape, my column range)}: how my parameters sit in the whole model."""
        return {self.W: ((self.n_in, self.n_out), (self.lo, self.hi)),
                self.b: ((1, self.n_out), (self.lo, self.hi))}

    def _init(self, views, rng, gain):
        """The unsplit layer's Glorot draw (the same rng sequence on every rank), my columns
        kept: a split model starts from the unsplit model's weights; b = 0."""
        W = np.empty((self.n_in, self.n_out), views[self.W].dtype)
        glorot_uniform(W, rng, gain)
        views[self.W][...] = W[:, self.lo:self.hi]
        views[self.b][...] = 0

    def _input_gradient(self, p, dz, dx, ws, progress):
        """dx (the first n * c'_j values: the layer below's slice) <- the group's sum of
        dz_j W_j^T: my term one GEMM per destination block, straight into the
        Reduce_scatter's send buffer (no packing copy)."""
        n, send = dz.shape[0], ws["send"]
        for j in range(self.group.size):
            lo, hi = int(self.below[j]), int(self.below[j + 1])
            matmul(dz, p[self.W][lo:hi], send[n * lo:n * hi].reshape(n, hi - lo), trans_b=True)
            if progress is not None:
                progress()
        self.group.reduce_scatter_columns(send, dx.reshape(-1), self.below, n)


class SplitDense(_Columns):
    """A hidden layer split by output columns (see the module docstring): the same parameters
    as layers.Dense ({name}.w, {name}.b), this rank's columns of them. Its output buffer (the
    Network's acts) holds the whole gathered y; its own slice f(x W_j + b_j) is in ws."""

    def __init__(self, index, n_in, n_out, activation, group):
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: expected one of {sorted(ACTIVATIONS)}")
        super().__init__(index, n_in, n_out, group)
        self.activation, self.kind = activation, ACTIVATIONS[activation]
        self.output_range = (0.0, 1.0) if self.kind == K.SIGMOID else (0.0, None)

    def workspace(self, max_batch):
        return {"y": (max_batch, self.cols), "recv": (max_batch * self.n_out,),
                "send": (max_batch * self.n_in,)}

    def init(self, views, rng):
        """As layers.Dense: Glorot times 4 for sigmoid, sqrt(2) for ReLU."""
        self._init(views, rng, 4.0 if self.kind == K.SIGMOID else np.sqrt(2.0))

    def forward(self, p, x, y, ops, progress=None, ws=None):
        n = x.shape[0]
        mine = ws["y"][:n]
        matmul(x, p[self.W], mine)
        if progress is not None:
            progress()
        ops.bias_act(mine, p[self.b], self.kind)
        self.group.allgather_columns(mine, y, self.bounds, ws["recv"])

    def backward(self, p, g, x, y, dy, dx, ops, progress=None, ws=None):
        n = x.shape[0]
        dz = ws["y"][:n]
        # my slice of dLoss/dy: the layer above wrote it into the first n * c values
        ops.act_backward(dz, dy.reshape(-1)[:n * self.cols].reshape(n, self.cols), dz,
                         g[self.b], self.kind)
        matmul(x, dz, g[self.W], trans_a=True)
        if progress is not None:
            progress()
        if dx is not None:
            self._input_gradient(p, dz, dx, ws, progress)


class SplitSoftmax(_Columns):
    """The output layer split by output columns (labels): logits, softmax and cross-entropy
    from a group's per-frame statistics (module docstring), never the whole logits; inference
    gathers the log-posteriors at the end (the caller wants them all)."""

    def workspace(self, max_batch):
        return {"z": (max_batch, self.cols), "recv": (max_batch * self.n_out,),
                "send": (max_batch * self.n_in,), "stats": (max_batch, STATS),
                "all": (self.group.size * max_batch * STATS,)}

    def init(self, views, rng):
        self._init(views, rng, 1.0)

    def forward(self, p, x, z, ops, progress=None, ws=None):
        matmul(x, p[self.W], ws["z"][:x.shape[0]])
        if progress is not None:
            progress()

    def _gathered(self, ws, n):
        """Every rank's statistics of the n frames, (M, n, STATS)."""
        out = ws["all"][:self.group.size * n * STATS]
        self.group.allgather_stats(ws["stats"][:n], out)
        return out.reshape(self.group.size, n, STATS)

    def loss(self, p, g, z, labels, ops, scale=1.0, ws=None):
        """As layers.SoftmaxOutput.loss, on my columns: my slice of dLoss/dz (times the loss
        scale) and of the bias gradient; the CE and correct frames of the whole softmax (the
        same on every rank of the group)."""
        n = labels.shape[0]
        mine, stats = ws["z"][:n], ws["stats"][:n]
        ops.split_xent_stats(mine, p[self.b], labels, self.lo, stats)
        ce, correct = ops.split_xent_finish(mine, labels, self.lo, self.group.rank,
                                            self._gathered(ws, n), g[self.b])
        ops.scale(mine, scale)
        ops.scale(g[self.b], scale)
        return ce, correct

    def posteriors(self, p, z, ops, log=True, ws=None):
        """z (n, V) <- the whole log-posteriors (or posteriors), gathered from the group."""
        n = z.shape[0]
        mine, stats = ws["z"][:n], ws["stats"][:n]
        ops.split_lse_stats(mine, p[self.b], stats)
        ops.split_lse_finish(mine, self._gathered(ws, n))
        self.group.allgather_columns(mine, z, self.bounds, ws["recv"])
        if not log:
            ops.exp(z)

    def backward(self, p, g, x, z, dy, dx, ops, progress=None, ws=None):
        dz = ws["z"][:x.shape[0]]
        matmul(x, dz, g[self.W], trans_a=True)
        if progress is not None:
            progress()
        if dx is not None:
            self._input_gradient(p, dz, dx, ws, progress)


# ---- whole matrices (checkpoints) ------------------------------------------------------------

def whole_specs(layers):
    """The unsplit model's parameter specs, in the split model's order."""
    out = []
    for layer in layers:
        whole = layer.whole() if hasattr(layer, "whole") else {}
        out += [s._replace(shape=whole[s.name][0]) if s.name in whole else s
                for s in layer.specs()]
    return out


def _placed(layers):
    """[(whole Matrix, my Matrix, my column range or None: not split), ...] in flat order."""
    ranges = {name: r for layer in layers if hasattr(layer, "whole")
              for name, (_, r) in layer.whole().items()}
    split = matrices([s for layer in layers for s in layer.specs()])
    return [(w, m, ranges.get(m.name)) for w, m in zip(matrices(whole_specs(layers)), split)]


def whole_size(layers):
    """Parameters of the whole (unsplit) model."""
    return sum(s.shape[0] * s.shape[1] for s in whole_specs(layers))


def to_whole(layers, local, group, root=0):
    """The whole flat buffer (the unsplit model's layout) of a per-parameter host array split
    over the group (parameters, momentum, ...), on model rank `root`; None on the others.
    A collective of the group: one Gatherv per split matrix."""
    out = np.empty(sum(w.size for w, _, _ in _placed(layers)), local.dtype) \
        if group.rank == root else None
    for w, m, cols in _placed(layers):
        mine = local[m.offset:m.offset + m.size]
        if cols is None:   # not split: every rank holds all of it
            if out is not None:
                out[w.offset:w.offset + w.size] = mine
            continue
        bounds = split_columns(w.n_rows, group.size)
        counts = (np.diff(bounds) * w.n_cols).astype(np.int64)
        displs = (bounds[:-1] * w.n_cols).astype(np.int64)
        recv = np.empty(w.size, local.dtype) if out is not None else None
        group.comm.Gatherv(mine, [recv, (counts, displs)] if out is not None else None,
                           root=root)
        if out is not None:
            whole = out[w.offset:w.offset + w.size].reshape(w.n_cols, w.n_rows)
            for j in range(group.size):
                lo, hi = int(bounds[j]), int(bounds[j + 1])
                whole[:, lo:hi] = recv[displs[j]:displs[j] + counts[j]].reshape(w.n_cols,
                                                                               hi - lo)
    return out


def from_whole(layers, whole, out):
    """out (this rank's split layout) <- my columns of a whole flat buffer."""
    for w, m, cols in _placed(layers):
        src = whole[w.offset:w.offset + w.size].reshape(w.n_cols, w.n_rows)
        lo, hi = cols if cols is not None else (0, w.n_rows)
        out[m.offset:m.offset + m.size] = src[:, lo:hi].reshape(-1)
    return out


def group_of(layers):
    """The model-parallel group a model is split over, or None (an unsplit model)."""
    return next((layer.group for layer in layers if hasattr(layer, "whole")), None)
