"""Kernels of the Conformer's layers (hpcsgd.model.conformer): Numba CPU kernels and the
float64 NumPy references they are tested against.

Shape key: R = T*nb time-major rows (row t*nb + b is step t of utterance b; utterances sorted
by non-increasing length, batch_sizes[t] of them valid at step t: hpcsgd.model.lengths), D the
model width, F the feed-forward width, H heads of dk = D / H values, K depthwise taps,
C = kernels.NCHUNK.

    residual  out = x + s * o (a module's output o, s = 1/2 for the macaron feed-forwards)
    swish     y = z * sigmoid(z)                       dz = dy * (s + z s (1 - s)), s = sigmoid(z)
    glu       y_j = a_j * sigmoid(g_j), [a | g] = z     (R, 2D) -> (R, D)
    depthwise y[t, b, c] = bias_c + sum_j w[j, c] x[t - p + j, b, c]   (p = (K - 1) // 2; zero
              outside 0..L_b - 1: the utterance's own steps, so a padded batch gives what the
              utterance gets alone); padding rows of y are 0
    heads     Q[b, h, t, :] = rope_t(q[t*nb + b, h*dk:(h+1)*dk]) * scale: the time-major
              projection as (nb, H, T, dk) blocks for batched GEMMs, with the rotary position
              embedding (RoFormer, Su et al. 2021) applied to queries and keys: each pair
              (i, i + dk/2) turned by the angle t * 10000^(-2i/dk); padding steps 0
    softmax   P[b, h, t, :] = softmax over the L_b valid keys of S[b, h, t, :]; rows t >= L_b
              and keys >= L_b are 0 (the mask is the utterance's length, never stored)
    conv2d    the 3x3 stride-2 convolutions of the subsampling front end as GEMMs over
              unfolded patches (unfold2d, its adjoint fold2d): x (T*nb, Fi*Ci) with frequency
              major, channel minor; cols ((T'*nb)*Fo, 9*Ci) whose row ((t'*nb + b)*Fo + f')
              holds the patch x[2t' - 1 + i, b, 2f' - 1 + j, :] for i, j = 0..2 (zero outside)

Every kernel is dtype-generic (float32 in training, float64 in the gradient checks). Sums that
a parameter gradient needs (the depthwise taps) are float64 partials per fixed row chunk added
in order: the same bits whatever the number of threads.
"""
import numpy as np
from numba import njit, prange

from hpcsgd.model.kernels import NCHUNK, fexp

ROPE_BASE = 10000.0   # RoFormer's (and LLaMA's) base of the rotary angles


# ---------------------------------------------------------------------------------------------
# element-wise: residual add, swish, GLU


@njit(parallel=True, cache=True)
def add_scaled(x, o, s, out):
    """out (R, M) = x + s * o: the residual add of a module's output o (s of x's dtype);
    out may be x."""
    n, m = x.shape
    for i in prange(n):
        for j in range(m):
            out[i, j] = x[i, j] + s * o[i, j]


@njit(parallel=True, cache=True)
def add_bias(z, b):
    """z (R, M) += b (1, M), in place."""
    n, m = z.shape
    for i in prange(n):
        for j in range(m):
            z[i, j] += b[0, j]


@njit(parallel=True, cache=True)
def swish_forward(z, y):
    """y (R, M) = z * sigmoid(z)."""
    n, m = z.shape
    one = z.dtype.type(1)
    for i in prange(n):
        for j in range(m):
            v = z[i, j]
            y[i, j] = v * (one / (one + fexp(-v)))


@njit(parallel=True, cache=True)
def bias_swish(z, b, y):
    """z (R, M) += b (kept: the backward's pre-activation), y = z * sigmoid(z)."""
    n, m = z.shape
    one = z.dtype.type(1)
    for i in prange(n):
        for j in range(m):
            v = z[i, j] + b[0, j]
            z[i, j] = v
            y[i, j] = v * (one / (one + fexp(-v)))


@njit(parallel=True, cache=True)
def swish_backward(z, dy, dz):
    """dz (R, M) = dy * swish'(z) from the pre-activation z; dz may be dy."""
    n, m = z.shape
    one = z.dtype.type(1)
    for i in prange(n):
        for j in range(m):
            v = z[i, j]
            s = one / (one + fexp(-v))
            dz[i, j] = dy[i, j] * (s + v * s * (one - s))


@njit(parallel=True, cache=True)
def bias_glu(z, b, y):
    """z (R, 2M) += b (kept), y (R, M) = z[:, :M] * sigmoid(z[:, M:])."""
    n, m = y.shape
    one = z.dtype.type(1)
    for i in prange(n):
        for j in range(2 * m):
            z[i, j] += b[0, j]
        for j in range(m):
            y[i, j] = z[i, j] * (one / (one + fexp(-z[i, m + j])))


@njit(parallel=True, cache=True)
def glu_backward(z, dy, dz):
    """dz (R, 2M) <- the gradient of [a | g] = z from dy (R, M); dz may be z."""
    n, m = dy.shape
    one = z.dtype.type(1)
    for i in prange(n):
        for j in range(m):
            a, g, d = z[i, j], z[i, m + j], dy[i, j]
            s = one / (one + fexp(-g))
            dz[i, j] = d * s
            dz[i, m + j] = d * a * s * (one - s)


# ---------------------------------------------------------------------------------------------
# depthwise convolution over each utterance's own steps


@njit(parallel=True, cache=True)
def depthwise_forward(x, w, b, y, nb, lengths, left):
    """y (T*nb, M) <- the depthwise convolution of x (module docstring); w (K, M), b (1, M);
    lengths (nb,) each utterance's steps."""
    kernel, m = w.shape
    steps = x.shape[0] // nb if nb else 0
    zero = x.dtype.type(0)
    for r in prange(steps * nb):
        t, u = r // nb, r % nb
        length = lengths[u]
        if t >= length:
            for c in range(m):
                y[r, c] = zero
            continue
        for c in range(m):
            y[r, c] = b[0, c]
        for j in range(kernel):
            src = t - left + j
            if 0 <= src < length:
                row = x[src * nb + u]
                for c in range(m):
                    y[r, c] += w[j, c] * row[c]


@njit(parallel=True, cache=True)
def depthwise_backward(x, dy, w, dx, gw, gb, nb, lengths, left, partial):
    """dx (T*nb, M) <- dLoss/dx (0 on the padding; parallel over its rows, taps in order);
    gw (K, M), gb (1, M) <- the taps' and bias's gradients, float64 partials per chunk of
    rows added in order. partial (C, K + 1, >= M) float64. dx must not be dy."""
    kernel, m = w.shape
    steps = x.shape[0] // nb if nb else 0
    rows = steps * nb
    zero = x.dtype.type(0)
    for r in prange(rows):
        t, u = r // nb, r % nb
        length = lengths[u]
        for c in range(m):
            dx[r, c] = zero
        if t >= length:
            continue
        for j in range(kernel):
            at = t + left - j            # the output step whose tap j read step t
            if 0 <= at < length:
                row = dy[at * nb + u]
                for c in range(m):
                    dx[r, c] += w[j, c] * row[c]
    chunk = (rows + NCHUNK - 1) // NCHUNK
    for k in prange(NCHUNK):
        p = partial[k]
        for j in range(kernel + 1):
            for c in range(m):
                p[j, c] = 0.0
        for r in range(k * chunk, min(rows, (k + 1) * chunk)):
            t, u = r // nb, r % nb
            length = lengths[u]
            if t >= length:
                continue
            d = dy[r]
            for c in range(m):
                p[kernel, c] += d[c]
            for j in range(kernel):
                src = t - left + j
                if 0 <= src < length:
                    row = x[src * nb + u]
                    for c in range(m):
                        p[j, c] += d[c] * row[c]
    for c in prange(m):
        for j in range(kernel + 1):
            acc = partial[0, j, c]
            for k in range(1, NCHUNK):
                acc += partial[k, j, c]
            if j < kernel:
                gw[j, c] = acc
            else:
                gb[0, c] = acc


# ---------------------------------------------------------------------------------------------
# attention: to and from head-major blocks (with the rotary embedding), the masked softmax


def rope_frequencies(dk):
    """The rotary angles' frequencies ROPE_BASE^(-2i/dk), i < dk // 2, in float64."""
    return ROPE_BASE ** (-np.arange(dk // 2, dtype=np.float64) * 2.0 / dk)


def rope_tables(steps, dk, dtype):
    """(cos, sin) (steps, dk // 2) of the rotary angles t * ROPE_BASE^(-2i/dk), computed in
    float64 and rounded once to dtype (the ONNX export computes them so in its graph)."""
    angle = np.arange(steps, dtype=np.float64)[:, None] * rope_frequencies(dk)[None, :]
    return np.cos(angle).astype(dtype), np.sin(angle).astype(dtype)


@njit(parallel=True, cache=True)
def to_heads(src, col, out, nb, heads, lengths, cos, sin, rotate, scale):
    """out (nb, H, T, dk) <- src[:, col:col + H*dk] (T*nb rows) per utterance and head, turned
    by the rotary embedding when rotate, times scale; steps past the utterance's length 0."""
    steps, dk = out.shape[2], out.shape[3]
    half = dk // 2
    zero = out.dtype.type(0)
    for bh in prange(nb * heads):
        u, h = bh // heads, bh % heads
        length = lengths[u]
        base = col + h * dk
        for t in range(steps):
            o = out[u, h, t]
            if t >= length:
                for i in range(dk):
                    o[i] = zero
                continue
            row = src[t * nb + u]
            if rotate:
                for i in range(half):
                    a, b = row[base + i], row[base + half + i]
                    c, s = cos[t, i], sin[t, i]
                    o[i] = (a * c - b * s) * scale
                    o[half + i] = (b * c + a * s) * scale
            else:
                for i in range(dk):
                    o[i] = row[base + i] * scale


@njit(parallel=True, cache=True)
def from_heads(blocks, dst, col, nb, lengths, cos, sin, rotate, scale):
    """dst[:, col:col + H*dk] <- blocks (nb, H, T, dk) laid back time-major, turned back by
    the rotary embedding's transpose (its inverse) when rotate, times scale; the padding rows'
    columns 0. The adjoint of to_heads: the backward's gradient, and the forward's output."""
    heads, steps, dk = blocks.shape[1], blocks.shape[2], blocks.shape[3]
    half = dk // 2
    zero = dst.dtype.type(0)
    for r in prange(steps * nb):
        t, u = r // nb, r % nb
        row = dst[r]
        if t >= lengths[u]:
            for i in range(heads * dk):
                row[col + i] = zero
            continue
        for h in range(heads):
            o = blocks[u, h, t]
            base = col + h * dk
            if rotate:
                for i in range(half):
                    a, b = o[i], o[half + i]
                    c, s = cos[t, i], sin[t, i]
                    row[base + i] = (a * c + b * s) * scale
                    row[base + half + i] = (b * c - a * s) * scale
            else:
                for i in range(dk):
                    row[base + i] = o[i] * scale


@njit(parallel=True, cache=True)
def masked_softmax(s, p, lengths):
    """p (nb, H, T, T) <- the softmax of s over each utterance's valid keys, row by row; 0
    for the padding's rows and keys. p may be s."""
    nb, heads, steps = s.shape[0], s.shape[1], s.shape[2]
    zero = s.dtype.type(0)
    for bh in prange(nb * heads):
        u, h = bh // heads, bh % heads
        length = lengths[u]
        for t in range(steps):
            srow, prow = s[u, h, t], p[u, h, t]
            if t >= length:
                for j in range(steps):
                    prow[j] = zero
                continue
            mx = srow[0]
            for j in range(1, length):
                mx = max(mx, srow[j])
            total = 0.0
            for j in range(length):
                e = fexp(srow[j] - mx)
                prow[j] = e
                total += e
            inv = s.dtype.type(1.0 / total)
            for j in range(length):
                prow[j] = prow[j] * inv
            for j in range(length, steps):
                prow[j] = zero


@njit(parallel=True, cache=True)
def masked_softmax_backward(p, dp, ds, lengths):
    """ds (nb, H, T, T) <- p * (dp - sum_j p dp) over each row's valid keys, 0 elsewhere;
    ds may be dp."""
    nb, heads, steps = p.shape[0], p.shape[1], p.shape[2]
    zero = p.dtype.type(0)
    for bh in prange(nb * heads):
        u, h = bh // heads, bh % heads
        length = lengths[u]
        for t in range(steps):
            prow, dprow, dsrow = p[u, h, t], dp[u, h, t], ds[u, h, t]
            if t >= length:
                for j in range(steps):
                    dsrow[j] = zero
                continue
            dot = 0.0
            for j in range(length):
                dot += prow[j] * dprow[j]
            d = p.dtype.type(dot)
            for j in range(length):
                dsrow[j] = prow[j] * (dprow[j] - d)
            for j in range(length, steps):
                dsrow[j] = zero


# ---------------------------------------------------------------------------------------------
# the subsampling front end's 3x3 stride-2 convolutions (padding 1 in time and frequency)


@njit(parallel=True, cache=True)
def unfold2d(x, cols, nb, steps_in, steps_out, f_in, f_out, channels):
    """cols ((steps_out*nb)*f_out, 9*channels) <- every output position's 3x3 patch of x
    (steps_in*nb, f_in*channels) (module docstring); taps outside the input 0 (the padding
    rows of x must be 0: the Network masks them)."""
    for r in prange(steps_out * nb):
        t, u = r // nb, r % nb
        for f in range(f_out):
            out = cols[r * f_out + f]
            for i in range(3):
                ti = 2 * t - 1 + i
                for j in range(3):
                    fi = 2 * f - 1 + j
                    k0 = (i * 3 + j) * channels
                    if 0 <= ti < steps_in and 0 <= fi < f_in:
                        row = x[ti * nb + u]
                        for c in range(channels):
                            out[k0 + c] = row[fi * channels + c]
                    else:
                        for c in range(channels):
                            out[k0 + c] = 0


@njit(parallel=True, cache=True)
def fold2d(dcols, dx, nb, steps_in, steps_out, f_in, f_out, channels):
    """dx (steps_in*nb, f_in*channels) <- unfold2d's adjoint of dcols: each input position
    the sum of the taps that read it, in tap order (parallel over dx's rows)."""
    for r in prange(steps_in * nb):
        t, u = r // nb, r % nb
        row = dx[r]
        for k in range(f_in * channels):
            row[k] = 0
        for i in range(3):
            at = t + 1 - i                  # = 2 t' when tap i of output step t' reads t
            if at < 0 or at % 2:
                continue
            tp = at // 2
            if tp >= steps_out:
                continue
            for f in range(f_in):
                for j in range(3):
                    af = f + 1 - j
                    if af < 0 or af % 2:
                        continue
                    fp = af // 2
                    if fp >= f_out:
                        continue
                    src = dcols[(tp * nb + u) * f_out + fp]
                    k0 = (i * 3 + j) * channels
                    for c in range(channels):
                        row[f * channels + c] += src[k0 + c]


# ---------------------------------------------------------------------------------------------
# NumPy references (float64)


def ref_sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, np.float64)))


def ref_swish(z):
    z = np.asarray(z, np.float64)
    return z * ref_sigmoid(z)


def ref_swish_backward(z, dy):
    z = np.asarray(z, np.float64)
    s = ref_sigmoid(z)
    return np.asarray(dy, np.float64) * (s + z * s * (1 - s))


def ref_glu(z):
    z = np.asarray(z, np.float64)
    m = z.shape[1] // 2
    return z[:, :m] * ref_sigmoid(z[:, m:])


def ref_glu_backward(z, dy):
    z, dy = np.asarray(z, np.float64), np.asarray(dy, np.float64)
    m = z.shape[1] // 2
    s = ref_sigmoid(z[:, m:])
    return np.concatenate([dy * s, dy * z[:, :m] * s * (1 - s)], axis=1)


def _utterances(rows, nb, lengths):
    """[(utterance b, its valid time-major row indices)]."""
    return [(b, np.arange(int(n)) * nb + b) for b, n in enumerate(lengths)]


def ref_depthwise(x, w, b, nb, lengths, left):
    """y float64 of depthwise_forward, each utterance alone."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y = np.zeros_like(x)
    for _, rows in _utterances(len(x), nb, lengths):
        xs = x[rows]
        n = len(rows)
        ys = np.tile(np.asarray(b, np.float64), (n, 1))
        for j in range(w.shape[0]):
            for t in range(n):
                src = t - left + j
                if 0 <= src < n:
                    ys[t] += w[j] * xs[src]
        y[rows] = ys
    return y


def ref_depthwise_backward(x, dy, w, nb, lengths, left):
    """(dx, gw, gb) float64 of depthwise_backward."""
    x, dy, w = (np.asarray(a, np.float64) for a in (x, dy, w))
    dx, gw, gb = np.zeros_like(x), np.zeros_like(w), np.zeros((1, w.shape[1]))
    for _, rows in _utterances(len(x), nb, lengths):
        xs, ds = x[rows], dy[rows]
        n = len(rows)
        gb += ds.sum(0, keepdims=True)
        d = np.zeros_like(xs)
        for j in range(w.shape[0]):
            for t in range(n):
                src = t - left + j
                if 0 <= src < n:
                    d[src] += w[j] * ds[t]
                    gw[j] += ds[t] * xs[src]
        dx[rows] = d
    return dx, gw, gb


def ref_rope(a, t, dk):
    """The rotary embedding of the rows a (n, dk) at positions t (n,), float64."""
    a = np.asarray(a, np.float64)
    half = dk // 2
    inv = ROPE_BASE ** (-np.arange(half, dtype=np.float64) * 2.0 / dk)
    ang = np.asarray(t, np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = a[:, :half], a[:, half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=1)


def ref_attention(q, k, v, heads, nb, lengths, rotate=True):
    """The attention output (T*nb, D) float64 of time-major q, k, v (T*nb, D): per utterance
    alone and head, softmax(rope(q) rope(k)^T / sqrt(dk)) v over its own steps; padding 0."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    d = q.shape[1]
    dk = d // heads
    out = np.zeros_like(q)
    for _, rows in _utterances(len(q), nb, lengths):
        n = len(rows)
        for h in range(heads):
            cols = slice(h * dk, (h + 1) * dk)
            qs, ks, vs = q[rows, cols], k[rows, cols], v[rows, cols]
            if rotate:
                qs, ks = ref_rope(qs, np.arange(n), dk), ref_rope(ks, np.arange(n), dk)
            s = qs @ ks.T / np.sqrt(dk)
            s -= s.max(1, keepdims=True) if n else 0
            p = np.exp(s)
            p /= p.sum(1, keepdims=True)
            out[rows, cols] = p @ vs
    return out


def ref_unfold2d(x, nb, steps_in, f_in, channels):
    """(cols, steps_out, f_out) of unfold2d, float64."""
    x = np.asarray(x, np.float64)
    steps_out, f_out = -(-steps_in // 2), -(-f_in // 2)
    img = x.reshape(steps_in, nb, f_in, channels)
    pad = np.zeros((steps_in + 2, nb, f_in + 2, channels))
    pad[1:-1, :, 1:-1] = img
    cols = np.zeros((steps_out, nb, f_out, 3, 3, channels))
    for i in range(3):
        for j in range(3):
            cols[:, :, :, i, j] = pad[i:i + 2 * steps_out:2, :, j:j + 2 * f_out:2][:steps_out,
                                                                                   :, :f_out]
    return cols.reshape(steps_out * nb * f_out, 9 * channels), steps_out, f_out
