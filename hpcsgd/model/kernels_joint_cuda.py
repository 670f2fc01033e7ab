"""CUDA counterparts of hpcsgd.model.kernels_joint: the RNN-T joint network's element-wise
part and the prediction network's token embedding, for GPU ranks (model/transducer.py).

Layouts as kernels_joint's: enc (T*nb, H) time-major, pred (U1max*nb, H) in the predictor's
order (utterance b at position pos[b]), the lattice rows of utterances b0..b1-1 packed in h
from row 0 (row_offsets[b] - row_offsets[b0] + t*U1_b + u). Wrappers take Numba device arrays
(the index arrays too: the caller copies them once per batch) and launch on the compute stream
without synchronizing.

- joint_forward: a 2-D grid per utterance (blockIdx.y = b - b0), grid-stride over its nodes x
  H values: h = tanh(enc_t + pred_u) or tanh(enc_t * pred_u).
- joint_backward: dh *= 1 - h^2 in place (the same grid), then two sums with no atomics --
  one thread per (t, j) adds over u into denc, one per (u, j) over t into dpred, each in the
  CPU kernel's order (u, resp. t, ascending), accumulated in float32 as the CPU does. With
  CUDA's tanhf against the CPU's ftanh (a few ulp) the two agree within float32 tolerance.
- embed / embed_backward / zero_padding: the embedding's rows gathered for the predictor's
  input tokens (-1: padding, a zero row), its gradient scattered back deterministically (one
  thread per (token, j) adds the rows of that token in row order: np.add.at's order), and the
  padding rows of a product zeroed.
- add_bias: x += b row-wise (the projections' biases; the loss kernel takes no bias);
  add_into: x += y (the output layer's gradient over the joint's sub-batches).
Every result is bit-reproducible on the GPU: no atomics, fixed summation orders.

16-bit storage (GPU ranks with train.precision mixed or bf16: float16 arrays, or uint16 ones
holding bfloat16 bits): enc, pred, h, dh, the embedding table and its rows, the biases may be
16-bit; every load is widened to float32 (F) and every store rounds once (S), as
kernels_cuda's. denc, dpred and the embedding's gradient stay float32 (sums over a lattice's
rows and columns, over the joint's sub-batches).
"""
import math

import numpy as np

from hpcsgd.device import as_device, on_stream
from hpcsgd.half import stored as S
from hpcsgd.half import widen as F
from hpcsgd.lazy_cuda import cuda
from hpcsgd.model.kernels_joint import ADD

BLOCK = (32, 8)   # 32 values of a row x 8 rows
MAX_GRID_X = 1024


def _launch(rows, width, utterances=1):
    """(grid, block): x over the width, y over rows (or utterances x row blocks)."""
    bx, by = min(BLOCK[0], max(width, 1)), min(BLOCK[1], max(rows, 1))
    return (min(-(-width // bx), MAX_GRID_X), max(1, -(-rows // by)) * utterances), (bx, by)


@cuda.jit
def _joint_forward_kernel(enc, pred, nb, pos, frames, u1s, row_offsets, b0, mode, h, yblocks):
    b = b0 + cuda.blockIdx.y // yblocks
    width = enc.shape[1]
    u1 = u1s[b]
    nodes = frames[b] * u1
    r0 = row_offsets[b] - row_offsets[b0]
    j0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    i0 = (cuda.blockIdx.y % yblocks) * cuda.blockDim.y + cuda.threadIdx.y
    for i in range(i0, nodes, yblocks * cuda.blockDim.y):
        t, u = i // u1, i % u1
        for j in range(j0, width, cuda.gridDim.x * cuda.blockDim.x):
            e, p = F(enc[t * nb + b, j]), F(pred[u * nb + pos[b], j])
            h[r0 + i, j] = S(h, math.tanh(e + p if mode == ADD else e * p))


@cuda.jit
def _tanh_grad_kernel(dh, h, n):
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    one = np.float32(1)
    for i in range(i0, n, si):
        for j in range(j0, dh.shape[1], sj):
            y = F(h[i, j])
            dh[i, j] = S(dh, F(dh[i, j]) * (one - y * y))


@cuda.jit
def _denc_kernel(da, enc, pred, nb, pos, frames, u1s, row_offsets, b0, mode, denc, yblocks):
    """Thread (t, j) of utterance b: denc[t*nb + b, j] += sum over u (ascending)."""
    b = b0 + cuda.blockIdx.y // yblocks
    width = enc.shape[1]
    u1 = u1s[b]
    r0 = row_offsets[b] - row_offsets[b0]
    j0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    t0 = (cuda.blockIdx.y % yblocks) * cuda.blockDim.y + cuda.threadIdx.y
    for t in range(t0, frames[b], yblocks * cuda.blockDim.y):
        for j in range(j0, width, cuda.gridDim.x * cuda.blockDim.x):
            acc = denc[t * nb + b, j]
            for u in range(u1):
                d = F(da[r0 + t * u1 + u, j])
                acc += d if mode == ADD else d * F(pred[u * nb + pos[b], j])
            denc[t * nb + b, j] = acc


@cuda.jit
def _dpred_kernel(da, enc, pred, nb, pos, frames, u1s, row_offsets, b0, mode, dpred, yblocks):
    """Thread (u, j) of utterance b: dpred[u*nb + pos[b], j] += sum over t (ascending)."""
    b = b0 + cuda.blockIdx.y // yblocks
    width = enc.shape[1]
    u1 = u1s[b]
    r0 = row_offsets[b] - row_offsets[b0]
    j0 = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    v0 = (cuda.blockIdx.y % yblocks) * cuda.blockDim.y + cuda.threadIdx.y
    for u in range(v0, u1, yblocks * cuda.blockDim.y):
        for j in range(j0, width, cuda.gridDim.x * cuda.blockDim.x):
            acc = dpred[u * nb + pos[b], j]
            for t in range(frames[b]):
                d = F(da[r0 + t * u1 + u, j])
                acc += d if mode == ADD else d * F(enc[t * nb + b, j])
            dpred[u * nb + pos[b], j] = acc


@cuda.jit
def _embed_kernel(table, tok, out):
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, tok.shape[0], si):
        k = tok[i]
        for j in range(j0, out.shape[1], sj):
            out[i, j] = table[k, j] if k >= 0 else S(out, np.float32(0))


@cuda.jit
def _embed_backward_kernel(dy, tok, g):
    """Thread (v, j): g[v, j] = sum of dy[i, j] over the rows i whose token is v, in order."""
    j0, v0 = cuda.grid(2)
    sj, sv = cuda.gridsize(2)
    for v in range(v0, g.shape[0], sv):
        for j in range(j0, g.shape[1], sj):
            acc = np.float32(0)
            for i in range(tok.shape[0]):
                if tok[i] == v:
                    acc += F(dy[i, j])
            g[v, j] = acc


@cuda.jit
def _zero_padding_kernel(x, tok):
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, tok.shape[0], si):
        if tok[i] < 0:
            for j in range(j0, x.shape[1], sj):
                x[i, j] = S(x, np.float32(0))


@cuda.jit
def _add_into_kernel(x, y):
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, x.shape[0], si):
        for j in range(j0, x.shape[1], sj):
            x[i, j] = S(x, F(x[i, j]) + F(y[i, j]))


@cuda.jit
def _add_bias_kernel(x, b):
    j0, i0 = cuda.grid(2)
    sj, si = cuda.gridsize(2)
    for i in range(i0, x.shape[0], si):
        for j in range(j0, x.shape[1], sj):
            x[i, j] = S(x, F(x[i, j]) + F(b[0, j]))


# ---------------------------------------------------------------------------------------------
# wrappers: device arrays in (pos, frames, u1s, row_offsets int64 on the device, as the caller
# copied them); b0, b1 and the longest lattice side are host numbers


def _per_utterance(longest, width, b0, b1):
    grid, block = _launch(longest, width, b1 - b0)
    return grid, block, grid[1] // (b1 - b0)


def joint_forward(enc, pred, nb, pos, frames, u1s, row_offsets, b0, b1, mode, h, longest):
    """kernels_joint.joint_forward on the device; `longest`: the most nodes of one of the
    utterances b0..b1-1 (the grid's rows per utterance)."""
    if b1 > b0:
        grid, block, yb = _per_utterance(longest, enc.shape[1], b0, b1)
        _joint_forward_kernel[on_stream((grid, block))](
            as_device(enc), as_device(pred), nb, pos, frames, u1s, row_offsets, b0, mode,
            as_device(h), yb)


def joint_backward(dh, h, n, enc, pred, nb, pos, frames, u1s, row_offsets, b0, b1, mode,
                   denc, dpred, longest_t, longest_u):
    """kernels_joint.joint_backward on the device (dh's first n rows overwritten with
    dLoss/d(combine)); longest_t, longest_u: the most frames, targets + 1 of b0..b1-1."""
    if b1 <= b0:
        return
    width = enc.shape[1]
    dh, h = as_device(dh), as_device(h)
    _tanh_grad_kernel[on_stream(_launch(n, width))](dh, h, n)
    args = (as_device(enc), as_device(pred), nb, pos, frames, u1s, row_offsets, b0, mode)
    grid, block, yb = _per_utterance(longest_t, width, b0, b1)
    _denc_kernel[on_stream((grid, block))](dh, *args, as_device(denc), yb)
    grid, block, yb = _per_utterance(longest_u, width, b0, b1)
    _dpred_kernel[on_stream((grid, block))](dh, *args, as_device(dpred), yb)


def embed(table, tok, out):
    """out[i] = table[tok[i]] (tok[i] >= 0), else 0; tok int64 on the device."""
    if len(out):
        _embed_kernel[on_stream(_launch(len(out), out.shape[1]))](as_device(table), tok,
                                                                  as_device(out))


def embed_backward(dy, tok, g):
    """g = the rows of dy summed by token (g zeroed first: every row of g is written)."""
    _embed_backward_kernel[on_stream(_launch(g.shape[0], g.shape[1]))](as_device(dy), tok,
                                                                       as_device(g))


def zero_padding(x, tok):
    """x[i] = 0 where tok[i] < 0."""
    if len(x):
        _zero_padding_kernel[on_stream(_launch(len(x), x.shape[1]))](as_device(x), tok)


def add_bias(x, b):
    """x (rows, m) += b (1, m)."""
    if len(x):
        _add_bias_kernel[on_stream(_launch(len(x), x.shape[1]))](as_device(x), as_device(b))


def add_into(x, y):
    """x += y, both (rows, m)."""
    if len(x):
        _add_into_kernel[on_stream(_launch(len(x), x.shape[1]))](as_device(x), as_device(y))
