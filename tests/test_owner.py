"""The 1-bit codec's fused owner pass (hpcsgd/codecs/onebit_owner.py, the striped exchange's
phases 3-5 in one pass per column) against its plain reference: the three unfused phases (decode-sum, Optimizer.post_exchange, encode) with the
NumPy reference codec and with the Numba codec. Same bits, every optimizer setting."""
import math
from types import SimpleNamespace

import numpy as np
import pytest

from hpcsgd import optim
from hpcsgd.codecs import make_codec

SHAPES = [(5, 2048), (3, 37), (2, 9304), (4, 64)]   # (columns, rows) of each matrix piece
OPTIMIZERS = {
    "momentum": dict(momentum_time_constant=300.0),
    "plain": dict(),
    "aggregate+momentum+decay": dict(momentum_time_constant=300.0, adagrad="aggregate",
                                     adagrad_time_constant=5000.0, weight_decay=1e-3),
    "after_momentum": dict(momentum_time_constant=300.0, adagrad="after_momentum"),
    "local+decay": dict(adagrad="local", weight_decay=1e-2),
    "adam+decay": dict(kind="adam", weight_decay=1e-3),
    "adam_local": dict(kind="adam", adam_variance="local"),
}


def setup(K, rng):
    """K contributions to one owner's stripe of SHAPES (packed as the Alltoallv delivers
    them), the owner's weights, residual2 and a gather buffer with the slot at an offset."""
    codec = make_codec("onebit", "cpu")
    nbs = [codec.packed_nbytes(*s) for s in SHAPES]
    slot_lo = 4096                          # my slot does not start at 0 in the gather buffer
    mine = sum(nbs)
    pieces, lo, a, off = [], 0, 0, slot_lo
    for (cols, rows), nb in zip(SHAPES, nbs):
        size = cols * rows
        pieces.append(((SimpleNamespace(n_rows=rows), lo, lo + size, cols, off, nb), a, a + size))
        lo, a, off = lo + size + 7, a + size, off + nb   # flat pieces are not contiguous
    recv = np.zeros(K * mine, np.uint8)
    for src in range(K):
        at = src * mine
        for (cols, rows), nb in zip(SHAPES, nbs):
            g = (rng.standard_normal((cols, rows)) * (src + 1)).astype(np.float32)
            codec.encode(g, np.zeros_like(g), recv[at:at + nb])
            at += nb
    stripe = a
    params = rng.standard_normal(lo).astype(np.float32)
    residual2 = (rng.standard_normal(stripe) * 0.1).astype(np.float32)
    gather = np.full(slot_lo + mine + 64, 0xAB, np.uint8)
    return codec, recv, (slot_lo, slot_lo + mine), pieces, params, residual2, gather, stripe


def make_opt(stripe, options, rng):
    opt = optim.Optimizer(stripe, post_size=stripe, **options)
    if opt.velocity.size > 1:   # momentum, Adam's first moment
        opt.velocity[:] = rng.standard_normal(stripe).astype(np.float32) * 0.5
    if opt.sqr.size > 1:        # AdaGrad's state, Adam's second moment
        opt.sqr[:] = rng.random(opt.sqr.size).astype(np.float32)
        opt.sqr_weight = 2000.0 if opt.kind == "sgd" else 0.3
        opt.adam_p = 0.4
    opt.begin_step(1024, 512)
    return opt


def unfused(backend, K, recv, slot, pieces, params, opt, residual2, gather):
    """Phases 3-5 as hpcsgd/comm/exchange.py runs them without fusion."""
    codec = make_codec("onebit", backend)
    mine = slot[1] - slot[0]
    stripe = pieces[-1][2]
    agg, weights = np.zeros(stripe, np.float32), np.zeros(stripe, np.float32)
    for (m, lo, hi, cols, off, nb), a, b in pieces:
        out = agg[a:b].reshape(cols, m.n_rows)
        at = off - slot[0]
        for src in range(K):
            packed = recv[src * mine + at:src * mine + at + nb]
            (codec.decode if src == 0 else codec.decode_accumulate)(packed, out)
        weights[a:b] = params[lo:hi]
    opt.post_exchange(agg, weights if opt.weight_decay else agg, 0, stripe)
    for (m, lo, hi, cols, off, nb), a, b in pieces:
        codec.encode(agg[a:b].reshape(cols, m.n_rows), residual2[a:b].reshape(cols, m.n_rows),
                     gather[off:off + nb])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("K", [1, 2, 3])
def test_the_fused_owner_pass_gives_the_bits_of_the_three_unfused_passes(K, opt_name, backend):
    rng = np.random.default_rng(K)
    codec, recv, slot, pieces, params, r2, gather, stripe = setup(K, rng)
    opt = make_opt(stripe, OPTIMIZERS[opt_name], np.random.default_rng(7))
    want_opt = make_opt(stripe, OPTIMIZERS[opt_name], np.random.default_rng(7))
    want_r2, want_gather = r2.copy(), gather.copy()
    unfused(backend, K, recv, slot, pieces, params, want_opt, want_r2, want_gather)
    before = params.copy()
    codec.owner_pass(recv, K, slot, pieces, params, opt, r2, gather)
    np.testing.assert_array_equal(gather, want_gather)     # the slot, and nothing outside it
    np.testing.assert_array_equal(r2, want_r2)
    np.testing.assert_array_equal(opt.velocity, want_opt.velocity)
    np.testing.assert_array_equal(opt.sqr, want_opt.sqr)
    np.testing.assert_array_equal(params, before)           # weights are only read
    assert not np.array_equal(gather[slot[0]:slot[1]], np.full(slot[1] - slot[0], 0xAB))
    if opt.velocity.size > 1:   # the state really moved
        assert not np.array_equal(opt.velocity, make_opt(stripe, OPTIMIZERS[opt_name],
                                                         np.random.default_rng(7)).velocity)


def test_a_non_finite_sum_names_the_matrix_and_column():
    rng = np.random.default_rng(0)
    codec, recv, slot, pieces, params, r2, gather, stripe = setup(2, rng)
    (m, lo, hi, cols, off, nb), a, b = pieces[2]      # the (2, 9304) piece, column 1
    r2[a + m.n_rows + 5] = math.inf
    opt = make_opt(stripe, OPTIMIZERS["momentum"], rng)
    with pytest.raises(ValueError, match=r"onebit encode: NaN or Inf .* matrix \(2, 9304\), "
                                         r"column 1"):
        codec.owner_pass(recv, 2, slot, pieces, params, opt, r2, gather)


def test_only_the_cpu_onebit_codec_declares_a_fused_owner_pass():
    assert make_codec("onebit", "cpu").fused_owner
    assert not make_codec("onebit", "reference").fused_owner
    assert not make_codec("onebit", "cuda").fused_owner
    assert not make_codec("kbit", "cpu", bits=4).fused_owner
    assert make_codec("onebit", "reference").fused_apply   # decode_apply on every backend
    assert not make_codec("float32", "cpu").fused_apply
