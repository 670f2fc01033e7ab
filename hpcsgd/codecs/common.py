"""Pieces every codec shares: argument checks, the canonical 32-lane column sum, device helpers.

Why a canonical sum: reference, CPU and CUDA must produce identical packed bytes, so the
per-column statistics (sums, sums of squares) must be added in the same order everywhere.
The order is fixed as: lane l (0..31) adds rows l, l+32, l+64, ... sequentially in float64,
then the 32 lanes are combined by the tree off = 16, 8, 4, 2, 1 (a[l] += a[l + off]).
A warp does exactly this on the GPU; the CPU loop vectorises over the 32 lanes (AVX-512).
Products of two float32 values are exact in float64, so a GPU fused multiply-add gives the
same bits as a separate multiply and add; every formula below keeps to such exact products.
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core.extending import intrinsic

from hpcsgd.lazy_cuda import cuda

LANES = 32
SET, ADD, SUB_LR = 0, 1, 2   # decode modes: out = d, out += d, out -= lr * d (decode_apply)


@intrinsic
def f64_bits(typingctx, x):
    """The bits of a float64 as int64 (a register move, vectorised)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(64))
    return types.int64(types.float64), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bits of a float32 as int32 (a register move, vectorised)."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen


@intrinsic
def f32_from_bits(typingctx, u):
    """The float32 whose bits are the int32 u."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.int32), codegen


def order_key(u):
    """A float32's bits (int32) -> an int32 in the float's order: -0 just below +0, NaNs
    beyond the infinities. Its own inverse; works on scalars and NumPy arrays. Integer
    min/max of keys vectorise where a float min/max (NaN rules) does not, and are exact."""
    return u ^ ((u >> np.int32(31)) & np.int32(0x7FFFFFFF))


def order_key_ref(v):
    """order_key of a float32 array's bits (NumPy)."""
    return order_key(np.ascontiguousarray(v, np.float32).view(np.int32))


KEY_NEG_INF = int(order_key_ref(np.array([-np.inf], np.float32))[0])   # finite keys lie
KEY_POS_INF = int(order_key_ref(np.array([np.inf], np.float32))[0])    # strictly between


def row_threads(n_rows, most=128):
    """Threads of a CUDA decode block (one block per column, threads striding its rows): at
    most `most`, no more than the rows (a short column gets no idle threads)."""
    return max(1, min(most, n_rows))


def lane_tree(acc):
    """Combine 32 lane partial sums (float64 array, modified) in the canonical order."""
    off = LANES // 2
    while off >= 1:
        for i in range(off):
            acc[i] += acc[i + off]
        off //= 2
    return acc[0]


lane_tree_cpu = njit(inline="always")(lane_tree)
lane_tree_cuda = cuda.jit(device=True)(lane_tree)


def pack_chunk(codes, lane, k, words, at, n_words):
    """The k-bit fields of a 32-row chunk (row b's code codes[b] at bit b * k of the chunk's
    32 k bits) as k words: lane j < n_words assembles words[at + j] from the shared codes
    (a field may straddle two words: each word takes its part). A CUDA warp encodes a column
    32 rows at a time, each lane reading and writing its own row (coalesced), then packs here;
    rows past the column's end have code 0, the padding the CPU leaves."""
    if lane < n_words:
        lo = 32 * lane
        word = np.uint64(0)
        for b in range(lo // k, min(LANES, (lo + 31) // k + 1)):
            off = b * k - lo
            q = np.uint64(codes[b])
            if off >= 0:
                word |= q << np.uint64(off)
            else:
                word |= q >> np.uint64(-off)
        words[at + lane] = np.uint32(word & np.uint64(0xFFFFFFFF))


pack_chunk_cuda = cuda.jit(device=True)(pack_chunk)


def ref_lane_sums(x64):
    """NumPy reference of the canonical sum over axis 1 of a (n_cols, n_rows) float64 array."""
    n_cols, n_rows = x64.shape
    n_chunks = -(-n_rows // LANES)
    pad = np.zeros((n_cols, n_chunks * LANES), np.float64)  # +0.0 padding never changes a lane
    pad[:, :n_rows] = x64
    pad = pad.reshape(n_cols, n_chunks, LANES)
    acc = np.zeros((n_cols, LANES), np.float64)
    for k in range(n_chunks):  # sequential per lane, as the kernels add
        acc += pad[:, k, :]
    off = LANES // 2
    while off >= 1:
        acc[:, :off] += acc[:, off:2 * off]
        off //= 2
    return acc[:, 0].copy()


def check_matrix(name, a, shape=None):
    """Codec inputs are C-contiguous float32 (n_cols, n_rows); say which argument is wrong."""
    if a.dtype != np.float32 or a.ndim != 2:
        raise ValueError(f"{name}: expected 2-D float32 (n_cols, n_rows), got {a.dtype} {a.shape}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)} does not match {tuple(shape)}")
    if hasattr(a, "flags") and not a.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{name}: must be C-contiguous (codec columns are array rows)")


def check_packed(codec, packed, n_cols, n_rows):
    need = codec.packed_nbytes(n_cols, n_rows)
    if packed.dtype != np.uint8 or packed.ndim != 1 or packed.shape[0] != need:
        raise ValueError(f"{codec.name}: packed buffer must be uint8[{need}] for shape "
                         f"({n_cols}, {n_rows}), got {packed.dtype}{list(packed.shape)}")


def nonfinite_error(codec_name, shape, col):
    """Numeric fault in a gradient, not bad user input: ValueError naming matrix and column."""
    return ValueError(f"{codec_name} encode: NaN or Inf in gradient+residual of matrix {tuple(shape)}, "
                      f"column {col} (array row {col}); the packed buffer is invalid and training "
                      f"must stop or resume from a checkpoint")


class Codec:
    """Shared argument handling; a subclass holds its options and implements the kernels.

    Every codec: packed_nbytes(n_cols, n_rows), encode(grad, residual, out), decode(packed,
    out), decode_accumulate(packed, out). Fusions a codec may declare, which the striped
    exchange offers to the step (hpcsgd/comm/exchange.py):
      fused_apply  decode_apply(packed, w, lr): w -= lr * decoded in one pass over w, the
                   same bits as decode followed by Optimizer.apply
      fused_owner  owner_pass(recv, K, slot, pieces, params, opt, residual2, gather): the
                   owner's decode-sum, the optimizer's post-exchange element arithmetic and
                   the re-encode in one pass per column, the same bits as the three passes
    And one property: buffer_state, whether an encode reads state an earlier encode left in
    its output buffer (Dettmers' scales with refresh > 1); a checkpoint then keeps the buffers.
    encode_reread_bytes(n_cols, n_rows) says what the CPU encode reads from memory beyond its
    one pass over grad and residual (bytes per encode, averaged over a refresh period):
    `hpcsgd bench kernels` states the fraction of the memory limit an encode can reach.
    """
    name = "?"
    error_feedback = True
    fused_apply = False
    fused_owner = False
    buffer_state = False

    # GPU encodes: a non-finite value sets a flag on the device, one int32 slot per encode.
    # Reading it is a host synchronisation, so the striped exchange sets defer_checks and
    # reads every pending slot at once at its next sync point (check_flags); otherwise each
    # encode reads its own. A clean read leaves the slots zero (a fault ends the run).
    defer_checks = False
    FLAG_SLOTS = 256
    _flags = None

    def __init__(self, backend="cpu"):
        if backend not in ("cpu", "cuda", "reference"):
            raise ValueError(f"backend must be cpu, cuda or reference, got {backend!r}")
        self.backend = backend

    def set_loss_scale(self, scale):
        """The loss scale of the gradient about to be encoded (mixed precision: the step's).
        Only a codec whose range it affects keeps it (float16: it sends v * scale); the
        others encode the unscaled gradient as they always do."""

    # ---- several matrices at once (the striped exchange's pieces). items: (element offset
    # in the flat arrays, columns, rows, byte offset in the packed buffer) per matrix. A
    # codec with the two GPU launches of the table path (_launch_encode, _launch_decode: the
    # 1-bit and k-bit codecs) takes every matrix in one launch on GPU ranks, from a
    # per-layout table of their columns (column_table); the others loop over the matrices.
    # Decode modes: SET, ADD (out +=) and SUB_LR (out -= lr * decoded: decode_apply).

    def _table_path(self):
        return self.backend == "cuda" and hasattr(self, "_launch_encode")

    def encode_many(self, items, src, residual, out):
        if not self._table_path():
            for a, cols, rows, off in items:
                n, nb = cols * rows, self.packed_nbytes(cols, rows)
                self.encode(src[a:a + n].reshape(cols, rows),
                            residual[a:a + n].reshape(cols, rows), out[off:off + nb])
            return
        table = self.column_table(items, self.words_per_column)
        if table.shape[0]:
            flag = self._device_flag(lambda v: nonfinite_error(
                self.name, *self.column_of(items, v - 1)))
            self._launch_encode(table, src, residual, out, flag)
            self._flagged()

    def decode_sum_many(self, items, recv, stride, n_src, out):
        """out = the sum of the n_src contributions `stride` bytes apart (decode_sum), per
        matrix."""
        if not self._table_path() or stride % 4:
            for a, cols, rows, off in items:
                self.decode_sum(recv, stride, off, self.packed_nbytes(cols, rows), n_src,
                                out[a:a + cols * rows].reshape(cols, rows))
            return
        self._decode_table(items, recv, out, SET, n_src=n_src, stride=stride)

    def decode_many(self, items, packed, out, lr=None):
        """out = decoded (lr None), or out -= lr * decoded (decode_apply), per matrix."""
        if not self._table_path():
            for a, cols, rows, off in items:
                p, o = packed[off:off + self.packed_nbytes(cols, rows)], \
                    out[a:a + cols * rows].reshape(cols, rows)
                if lr is None:
                    self.decode(p, o)
                else:
                    self.decode_apply(p, o, lr)
            return
        self._decode_table(items, packed, out, SET if lr is None else SUB_LR,
                           0.0 if lr is None else lr)

    def _decode_table(self, items, packed, out, mode, lr=0.0, n_src=1, stride=0):
        table = self.column_table(items, self.words_per_column)
        if table.shape[0]:
            from hpcsgd.device import as_device
            self._launch_decode(table, packed, as_device(out), mode, lr, n_src, stride // 4,
                                max(rows for _, _, rows, _ in items))

    def column_table(self, items, words_per_column):
        """The device table of items' columns, int64 (columns, 3): element offset, rows, word
        offset of its packed column (words_per_column(rows) words each); made once per
        layout (the one copy to the device), then looked up."""
        key = tuple(items)
        tables = self.__dict__.setdefault("_tables", {})
        table = tables.get(key)
        if table is None:
            rows_of = []
            for a, cols, rows, off in items:
                W = words_per_column(rows)
                for j in range(cols):
                    rows_of.append((a + j * rows, rows, off // 4 + j * W))
            from hpcsgd.device import zeros
            table = zeros((len(rows_of), 3), np.int64, "cuda")
            if rows_of:
                table.copy_to_device(np.array(rows_of, np.int64))
            tables[key] = table
        return table

    @staticmethod
    def column_of(items, c):
        """(shape, column) of the items' c-th column (error messages)."""
        for a, cols, rows, off in items:
            if c < cols:
                return (cols, rows), c
            c -= cols
        raise IndexError(c)

    def decode_sum(self, recv, stride, at, nbytes, n_src, out):
        """out = the sum of n_src packed contributions, source s's at recv[s * stride + at:]
        (nbytes each), added in source order 0..n_src-1 (the first overwrites: no zeroing
        pass), so every run adds in the same order. The table path (GPU 1-bit and k-bit) does
        it in one launch that reads each contribution once and writes out once, the same
        float32 sums in the same order; otherwise a decode per source."""
        if self._table_path() and not (stride % 4 or at % 4) and out.size:
            from hpcsgd.device import as_device
            self._check_decode(recv[at:at + nbytes], out)
            self._decode_table([(0, *out.shape, at)], recv, as_device(out).reshape(out.size),
                               SET, n_src=n_src, stride=stride)
            return
        for src in range(n_src):
            packed = recv[src * stride + at:src * stride + at + nbytes]
            if src == 0:
                self.decode(packed, out)
            else:
                self.decode_accumulate(packed, out)

    def _device_flag(self, error):
        """A zeroed device int32 slot for one GPU encode to flag a fault in (0: none, else
        what error(value) names): error(value) -> the exception check_flags raises."""
        if self._flags is None:
            from hpcsgd.device import zeros
            self._flags, self._pending = zeros(self.FLAG_SLOTS, np.int32, "cuda"), []
        if len(self._pending) == self.FLAG_SLOTS:
            self.check_flags()
        self._pending.append(error)
        k = len(self._pending) - 1
        return self._flags[k:k + 1]

    def _flagged(self):
        """After a GPU encode's launch: its check now, unless deferred."""
        if not self.defer_checks:
            self.check_flags()

    def check_flags(self):
        """Read the pending GPU encodes' flags (one device-to-host copy: a sync point) and
        raise the first fault's error."""
        if not getattr(self, "_pending", None):
            return
        got = self._flags[:len(self._pending)].copy_to_host()
        errors, self._pending = self._pending, []
        bad = np.flatnonzero(got)
        if bad.size:
            raise errors[bad[0]](int(got[bad[0]]))

    def encode_reread_bytes(self, n_cols, n_rows):
        return 0.0

    def bits_per_value(self, n_cols, n_rows):
        n = n_cols * n_rows
        return 8.0 * self.packed_nbytes(n_cols, n_rows) / n if n else 0.0

    def _check_encode(self, grad, residual, out):
        check_matrix(f"{self.name} grad", grad)
        if residual is not None:
            check_matrix(f"{self.name} residual", residual, grad.shape)
        elif self.error_feedback:
            raise ValueError(f"{self.name}: error feedback is on, so encode needs a residual array")
        check_packed(self, out, *grad.shape)

    def _check_decode(self, packed, out):
        check_matrix(f"{self.name} decode out", out)
        check_packed(self, packed, *out.shape)
