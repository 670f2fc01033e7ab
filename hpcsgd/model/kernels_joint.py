"""The RNN-T joint network's element-wise part (Numba CPU) and its float64 NumPy reference:
every lattice node (t, u) of an utterance gets h = tanh(combine(enc_t, pred_u)), combine
additive (Graves 2012: enc + pred) or multiplicative (Saon et al. 2021: enc * pred), and its
backward sums dLoss/dh over the lattice's rows and columns into dLoss/denc and dLoss/dpred.
The GEMMs around it (h @ W_out, its gradients) are model/transducer.py's.

Layouts (model/transducer.py): enc (T*nb, H) is time-major, utterance b's step t at row
t*nb + b; pred (U1max*nb, H) is the prediction network's time-major output in its own order
(sequences sorted by length: utterance b at position pos[b]), its step u at row u*nb + pos[b].
The lattice rows of utterances b0..b1-1 are packed in h (model.kernels_rnnt's layout):
utterance b's node (t, u) at row row_offsets[b] - row_offsets[b0] + t*U1_b + u.

Utterances run in parallel (prange); each writes only its own rows of h, denc and dpred, so
the sums need no atomics. denc and dpred are accumulated (+=): the caller zeroes them once per
batch, then runs the joint in sub-batches of utterances (a memory budget) over them.
"""
import numpy as np
from numba import njit, prange

from hpcsgd.model.kernels_lstm import ftanh

ADD, MUL = 0, 1
MODES = {"add": ADD, "mul": MUL}


@njit(parallel=True, cache=True)
def joint_forward(enc, pred, nb, pos, frames, u1s, row_offsets, b0, b1, mode, h):
    """h[rows of b0..b1-1] <- tanh(enc_t + pred_u) (mode ADD) or tanh(enc_t * pred_u) (MUL)."""
    width = enc.shape[1]
    base = row_offsets[b0]
    for b in prange(b0, b1):
        u1 = u1s[b]
        r0 = row_offsets[b] - base
        for t in range(frames[b]):
            e = enc[t * nb + b]
            for u in range(u1):
                p = pred[u * nb + pos[b]]
                out = h[r0 + t * u1 + u]
                if mode == ADD:
                    for j in range(width):       # vectorized
                        out[j] = ftanh(e[j] + p[j])
                else:
                    for j in range(width):
                        out[j] = ftanh(e[j] * p[j])


@njit(parallel=True, cache=True)
def joint_backward(dh, h, enc, pred, nb, pos, frames, u1s, row_offsets, b0, b1, mode, denc,
                   dpred):
    """From dh = dLoss/dh over the rows of b0..b1-1 (overwritten with dLoss/d(combine)):
    denc[t*nb + b] += sum over u, dpred[u*nb + pos[b]] += sum over t of it (times pred_u,
    resp. enc_t, under MUL)."""
    width = enc.shape[1]
    base = row_offsets[b0]
    one = h.dtype.type(1)
    for b in prange(b0, b1):
        u1 = u1s[b]
        r0 = row_offsets[b] - base
        for t in range(frames[b]):
            e, de = enc[t * nb + b], denc[t * nb + b]
            for u in range(u1):
                r = r0 + t * u1 + u
                p, dp = pred[u * nb + pos[b]], dpred[u * nb + pos[b]]
                d, y = dh[r], h[r]
                for j in range(width):           # vectorized
                    d[j] = d[j] * (one - y[j] * y[j])
                if mode == ADD:
                    for j in range(width):
                        de[j] += d[j]
                        dp[j] += d[j]
                else:
                    for j in range(width):
                        de[j] += d[j] * p[j]
                        dp[j] += d[j] * e[j]


# the prediction network's embedding and the projections' biases (NumPy; their CUDA
# counterparts in kernels_joint_cuda.py, the same results in the same summation order)


def embed(table, tok, out):
    """out[i] = table[tok[i]] where tok[i] >= 0 (an input token), else 0 (the padding)."""
    valid = tok >= 0
    out[~valid] = 0
    out[valid] = table[tok[valid]]


def embed_backward(dy, tok, g):
    """g = the rows of dy summed by token, in row order (every row of g written)."""
    g[...] = 0
    valid = tok >= 0
    np.add.at(g, tok[valid], dy[valid])


def zero_padding(x, tok):
    """x[i] = 0 where tok[i] < 0."""
    x[tok < 0] = 0


def add_bias(x, b):
    """x (rows, m) += b (1, m)."""
    x += b


def add_into(x, y):
    """x += y (same shape)."""
    x += y


# ---------------------------------------------------------------------------------------------
# NumPy reference (float64; clarity first)


def ref_joint(enc_b, pred_b, mode):
    """One utterance: enc_b (T, H), pred_b (U1, H) -> h (T, U1, H)."""
    e, p = np.asarray(enc_b, np.float64)[:, None, :], np.asarray(pred_b, np.float64)[None]
    return np.tanh(e + p if mode == ADD else e * p)


def ref_joint_backward(dh, enc_b, pred_b, mode):
    """One utterance: dh (T, U1, H) -> (denc (T, H), dpred (U1, H))."""
    h = ref_joint(enc_b, pred_b, mode)
    da = np.asarray(dh, np.float64) * (1 - h * h)
    if mode == ADD:
        return da.sum(axis=1), da.sum(axis=0)
    e, p = np.asarray(enc_b, np.float64), np.asarray(pred_b, np.float64)
    return (da * p[None]).sum(axis=1), (da * e[:, None]).sum(axis=0)
