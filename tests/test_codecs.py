"""Codecs: NumPy reference == Numba CPU bit for bit, edge cases, error-feedback invariant,
1-bit conditional means, packed sizes. CUDA parity runs in test_codecs_cuda.py (simulator)."""
import numpy as np
import pytest

from hpcsgd.codecs import make_codec
from hpcsgd.codecs.dettmers import DTYPES, make_table
from hpcsgd.errors import UserError

CONFIGS = ([("onebit", {})]
           + [("kbit", {"bits": k}) for k in range(2, 9)]
           + [("kbit", {"bits": k, "range": "rms"}) for k in (3, 8)]
           + [("dettmers", {"dtype": d}) for d in DTYPES]
           + [("dettmers", {"dtype": "dynamic_tree", "block": 16, "refresh": 3}),
              ("dettmers", {"dtype": "mantissa", "norm": "absmax", "block": 1000}),
              ("dettmers", {"dtype": "linear", "error_feedback": False}),
              ("float32", {}), ("float16", {})])
IDS = [n + "".join(f"-{k}={v}" for k, v in o.items()) for n, o in CONFIGS]
SHAPES = [(5, 70), (3, 1), (1, 64), (4, 33), (0, 50), (2, 2053),
          (37, 70)]  # more columns than tasks: a task encodes a run of columns


def grads(shape, steps, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        g = (rng.standard_normal(shape) * 10.0 ** rng.uniform(-4, 0, (shape[0], 1))).astype(np.float32)
        if shape[0] > 1:
            g[1] = 0.0  # an all-zero column
        out.append(g)
    return out


def run_steps(name, opts, backend, gs):
    codec = make_codec(name, backend=backend, **opts)
    shape = gs[0].shape
    r = np.zeros(shape, np.float32)
    buf = np.zeros(codec.packed_nbytes(*shape), np.uint8)
    acc = np.zeros(shape, np.float32)
    bufs = []
    for g in gs:
        codec.encode(g, r, buf)
        codec.decode_accumulate(buf, acc)
        bufs.append(buf.copy())
    dec = np.full(shape, 7.0, np.float32)
    codec.decode(buf, dec)
    return bufs, r, acc, dec


@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_reference_equals_cpu_bit_for_bit(name, opts, shape):
    gs = grads(shape, 3)
    ref = run_steps(name, opts, "reference", gs)
    cpu = run_steps(name, opts, "cpu", gs)
    for a, b in zip(ref[0], cpu[0]):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(ref[1:], cpu[1:]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name,opts", [c for c in CONFIGS if c[1].get("error_feedback", True)],
                         ids=[i for i, c in zip(IDS, CONFIGS) if c[1].get("error_feedback", True)])
def test_error_feedback_invariant(name, opts):
    """Over T steps: sum of decoded = sum of inputs - final residual (nothing is lost)."""
    gs = grads((6, 45), 8, seed=1)
    _, r, acc, _ = run_steps(name, opts, "cpu", gs)
    total = np.sum(np.array(gs, np.float64), axis=0)
    scale = np.abs(np.array(gs)).max()
    np.testing.assert_allclose(acc.astype(np.float64), total - r, atol=1e-5 * scale * len(gs))


def test_onebit_reconstruction_values_are_conditional_means():
    g = grads((4, 77), 1, seed=2)[0]
    r0 = np.random.default_rng(3).standard_normal(g.shape).astype(np.float32) * 0.01
    r0[1] = 0.0  # column 1 stays all zero
    v = g + r0
    codec = make_codec("onebit")
    buf = np.empty(codec.packed_nbytes(*g.shape), np.uint8)
    r = r0.copy()
    codec.encode(g, r, buf)
    means = buf.view(np.float32).reshape(4, -1)[:, :2]
    for c in range(4):
        neg, pos = v[c][v[c] < 0], v[c][v[c] >= 0]
        m0 = neg.mean() if neg.size else 0.0
        m1 = pos.mean() if pos.size else 0.0
        np.testing.assert_allclose(means[c], [m0, m1], rtol=1e-6, atol=1e-30)
    dec = np.empty_like(g)
    codec.decode(buf, dec)
    assert (dec[1] == 0).all() and (r[1] == 0).all()  # all-zero column decodes to 0
    np.testing.assert_allclose(r, v - dec, rtol=0, atol=0)
    # the means minimise the squared error for threshold 0: perturbing them makes it worse
    err = ((v - dec) ** 2).sum()
    for d in (1.01, 0.99):
        assert ((v - np.where(v >= 0, means[:, 1:2] * d, means[:, 0:1])) ** 2).sum() > err


@pytest.mark.parametrize("n_cols,n_rows", [(7, 1), (3, 32), (2, 33), (11, 9304), (0, 5)])
def test_packed_size_formulas(n_cols, n_rows):
    w = lambda bits: -(-n_rows * bits // 32)  # noqa: E731  32-bit words per column
    assert make_codec("onebit").packed_nbytes(n_cols, n_rows) == n_cols * 4 * (2 + w(1))
    for k in range(2, 9):
        assert make_codec("kbit", bits=k).packed_nbytes(n_cols, n_rows) == n_cols * 4 * (2 + w(k))
    n = n_cols * n_rows
    nb = -(-n // 16)
    assert make_codec("dettmers").packed_nbytes(n_cols, n_rows) == (4 + 4 + 4 * -(-n // 4)) * (n > 0)
    assert make_codec("dettmers", block=16).packed_nbytes(n_cols, n_rows) == (
        4 + 4 * nb + 4 * -(-n // 4)) * (n > 0)
    assert make_codec("float32").packed_nbytes(n_cols, n_rows) == 4 * n
    assert make_codec("float16").packed_nbytes(n_cols, n_rows) == 2 * n + 2 * (n % 2)


def test_float16_cpu_kernel_rounds_like_numpy_at_every_value_and_tie():
    """The CPU kernel builds float16 bits without a float16 type (Numba has none on the CPU):
    every finite half, every midpoint between neighbours (round half to even), subnormals,
    the overflow edge (65519.99 -> 65504, 65520 -> inf is an error) and random values over
    20 decades give NumPy's bytes, residuals and decoded values."""
    halves = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    exact = np.sort(halves[np.isfinite(halves)].astype(np.float32))
    ties = ((exact[:-1].astype(np.float64) + exact[1:]) / 2).astype(np.float32)
    rng = np.random.default_rng(5)
    rand = (rng.standard_normal(100_000) * 10.0 ** rng.uniform(-12, 4.8, 100_000)).astype(np.float32)
    edge = np.array([65519.99, -65519.99, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 1e-30],
                    np.float32)
    values = np.concatenate([exact, ties, rand[np.abs(rand) < 65504], edge])
    values = np.concatenate([values, np.zeros(-values.size % 64, np.float32)]).reshape(-1, 64)
    out = {}
    for backend in ("reference", "cpu"):
        codec = make_codec("float16", backend=backend)
        r = np.zeros_like(values)
        packed = np.zeros(codec.packed_nbytes(*values.shape), np.uint8)
        codec.encode(values, r, packed)
        dec = np.empty_like(values)
        codec.decode(packed, dec)
        acc = np.ones_like(values)
        codec.decode_accumulate(packed, acc)
        out[backend] = packed, r, dec, acc
    for a, b in zip(out["reference"], out["cpu"]):
        assert a.tobytes() == b.tobytes()
    assert np.abs(out["cpu"][1]).max() > 0          # the residual holds the rounding error
    with pytest.raises(ValueError, match="NaN or Inf"):
        make_codec("float16").encode(np.full((1, 4), 65520, np.float32), np.zeros((1, 4), np.float32),
                                     np.zeros(8, np.uint8))


def test_bits_per_value_includes_side_info():
    assert make_codec("onebit").bits_per_value(2048, 2048) == 1 + 64 / 2048
    assert make_codec("kbit", bits=3).bits_per_value(10, 32) == 3 + 64 / 32
    assert make_codec("float32").bits_per_value(3, 3) == 32


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("name,opts", CONFIGS, ids=IDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_is_a_clear_error(backend, name, opts, bad):
    g = grads((4, 40), 1)[0]
    g[2, 17] = bad
    codec = make_codec(name, backend=backend, **opts)
    with pytest.raises(ValueError, match=r"column 2 .*\(4, 40\)|\(4, 40\), column 2"):
        codec.encode(g, np.zeros_like(g), np.zeros(codec.packed_nbytes(4, 40), np.uint8))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_dettmers_stale_zero_scale_still_finds_a_nonfinite_value(backend, bad):
    """A reused abs-max of 0 (refresh > 1) must not hide a NaN or Inf: the CPU encode divides
    by +inf then, which keeps finite values at code(0) and turns the others into NaN."""
    codec = make_codec("dettmers", backend=backend, refresh=2)
    buf = np.zeros(codec.packed_nbytes(3, 2000), np.uint8)
    r = np.zeros((3, 2000), np.float32)
    codec.encode(np.zeros((3, 2000), np.float32), r, buf)  # abs-max 0, kept for one more encode
    g = grads((3, 2000), 1)[0]
    g[1, 1500] = bad
    with pytest.raises(ValueError, match=r"column 1 .*\(3, 2000\)|\(3, 2000\), column 1"):
        codec.encode(g, r, buf)


def signed_zero_columns():
    """(g, r) whose v = g + r columns have a zero minimum or maximum of either sign: -0 + -0
    is the only sum that gives -0."""
    g = np.array([[-0.0, 0.0, 1.0, 2.0], [-0.0, -0.0, -1.0, -2.0], [0.0, -0.0, -1.0, -3.0],
                  [0.0, 0.0, 0.0, 0.0], [-0.0, -0.0, -0.0, -0.0], [-0.0, 0.5, 0.0, 0.25]],
                 np.float32)
    r = np.where(np.signbit(g), np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    return g, r


def test_kbit_minmax_orders_minus_zero_below_plus_zero():
    """The range of a column whose min or max is zero takes the zero's sign by one rule on
    every backend (-0 below +0), not by what a CPU's min instruction returns."""
    g, r0 = signed_zero_columns()
    bufs = {}
    for backend in ("reference", "cpu"):
        c = make_codec("kbit", bits=4, backend=backend)
        buf = np.zeros(c.packed_nbytes(*g.shape), np.uint8)
        c.encode(g, r0.copy(), buf)
        bufs[backend] = buf
    assert bufs["reference"].tobytes() == bufs["cpu"].tobytes()
    words = bufs["cpu"].view(np.uint32).reshape(g.shape[0], -1)
    lower, upper = words[:, 0].view(np.float32), words[:, 1].view(np.float32)
    np.testing.assert_array_equal(np.signbit(lower), [True, True, True, False, True, True])
    np.testing.assert_array_equal(np.signbit(upper), [False, True, False, False, True, False])
    np.testing.assert_array_equal(lower, [0, -2, -3, 0, 0, 0])
    np.testing.assert_array_equal(upper, [2, 0, 0, 0, 0, 0.5])


def kbit_edge_columns(bits, n_rows=2048, seed=0):
    """Columns of 2048 rows whose values sit at kbit's bucket edges: each column's min and
    max set the range, and the rest are the float32s at lower + j * step (j = 1 .. 2^k - 1,
    as float32 and float64 give them) and up to three float32s either side of each, padded
    with random values inside the range. Ranges of either sign, tiny, huge and degenerate
    steps."""
    ranges = [(-1.0, 1.0), (-3e-7, 5e-3), (0.1, 0.1000001), (-2.5e30, 1e30), (-0.0, 3.0),
              (-5.0, -1.0), (1.0, 1.0), (-1e-38, 2e-38), (0.0, 1e-44)]
    levels = 1 << bits
    rng = np.random.default_rng(seed)
    cols = []
    for lower, upper in ranges:
        lo, hi = np.float32(lower), np.float32(upper)
        step = np.float32((np.float64(hi) - np.float64(lo)) / levels)
        edges = []
        for j in range(1, levels):
            for e in (np.float32(np.float64(lo) + np.float64(step) * j), np.float32(lo + step * j)):
                x = e
                for _ in range(3):
                    x = np.nextafter(x, np.float32(-np.inf))
                edges += [x := np.nextafter(x, np.float32(np.inf)) for _ in range(7)]
        edges = np.clip(np.array(edges, np.float32), lo, hi)
        fill = (lo + (hi - lo) * rng.random(n_rows - 2 - edges.size)).astype(np.float32)
        cols.append(np.concatenate([[lo, hi], edges, np.clip(fill, lo, hi)]))
    return np.array(cols, np.float32)


@pytest.mark.parametrize("bits", [2, 4])
def test_kbit_codes_values_at_and_beside_every_bucket_edge_as_the_reference(bits):
    """kbit2's CPU encode finds a value's code by the column's three thresholds (the smallest
    float32 of each code, hpcsgd/codecs/kbit.py) instead of float64 arithmetic, kbit4's by
    that arithmetic: at the edges and the float32s beside them both give the reference's
    codes and residuals, bit for bit."""
    v = kbit_edge_columns(bits)
    bufs, res = {}, {}
    for backend in ("reference", "cpu"):
        c = make_codec("kbit", bits=bits, backend=backend)
        bufs[backend] = np.zeros(c.packed_nbytes(*v.shape), np.uint8)
        res[backend] = np.zeros_like(v)
        c.encode(v, res[backend], bufs[backend])
    assert bufs["reference"].tobytes() == bufs["cpu"].tobytes()
    assert res["reference"].tobytes() == res["cpu"].tobytes()
    fields = np.unpackbits(bufs["cpu"].view(np.uint32).reshape(v.shape[0], -1)[:, 2:]
                           .view(np.uint8), axis=1, bitorder="little")
    codes = fields[:, :v.shape[1] * bits].reshape(v.shape[0], -1, bits) @ (1 << np.arange(bits))
    assert len({tuple(np.unique(row)) for row in codes}) > 1
    assert ((codes == (1 << bits) - 1).any(axis=1)).sum() >= 7   # the top code reached


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("bad_col", [0, 1, 2, 5, 38, 39])
def test_kbit_a_nonfinite_column_leaves_the_others_as_without_it(bits, bad_col):
    """A task takes each next column's range inside the previous column's code loop: a bad
    column (first, inside or last of a task's run) must not disturb its neighbours."""
    g = grads((40, 64), 1)[0]
    c = make_codec("kbit", bits=bits)
    W = c.packed_nbytes(1, 64) // 4
    clean_r, clean = np.zeros_like(g), np.zeros(c.packed_nbytes(40, 64), np.uint8)
    c.encode(g, clean_r, clean)
    g[bad_col, 7] = np.nan
    r, buf = np.zeros_like(g), np.zeros(c.packed_nbytes(40, 64), np.uint8)
    with pytest.raises(ValueError, match=rf"column {bad_col} "):
        c.encode(g, r, buf)
    others = [i for i in range(40) if i != bad_col]
    assert (r[bad_col] == 0).all()
    np.testing.assert_array_equal(r[others], clean_r[others])
    np.testing.assert_array_equal(buf.view(np.uint32).reshape(40, W)[others],
                                  clean.view(np.uint32).reshape(40, W)[others])


def test_bad_arguments():
    with pytest.raises(UserError, match="unknown codec"):
        make_codec("twobit")
    with pytest.raises(ValueError, match="bits"):
        make_codec("kbit", bits=9)
    with pytest.raises(UserError, match="bad option"):
        make_codec("onebit", bits=2)
    c = make_codec("onebit")
    g = np.zeros((3, 40), np.float32)
    with pytest.raises(ValueError, match="packed buffer"):
        c.encode(g, g.copy(), np.zeros(5, np.uint8))
    with pytest.raises(ValueError, match="C-contiguous"):
        c.encode(np.zeros((40, 3), np.float32).T, g.copy(), np.zeros(c.packed_nbytes(3, 40), np.uint8))
    with pytest.raises(ValueError, match="needs a residual"):
        c.encode(g, None, np.zeros(c.packed_nbytes(3, 40), np.uint8))


def test_stripes_encode_like_the_whole_matrix_for_column_codecs():
    """A column stripe g[c0:c1] packs to the same bytes as those columns of the whole matrix."""
    g = grads((9, 50), 1)[0]
    for name, opts in [("onebit", {}), ("kbit", {"bits": 5})]:
        c = make_codec(name, **opts)
        whole = np.empty(c.packed_nbytes(9, 50), np.uint8)
        c.encode(g, np.zeros_like(g), whole)
        per = c.packed_nbytes(1, 50)
        stripe = np.empty(c.packed_nbytes(3, 50), np.uint8)
        c.encode(g[3:6], np.zeros((3, 50), np.float32), stripe)
        assert stripe.tobytes() == whole[3 * per:6 * per].tobytes()


def test_dettmers_says_which_encodes_read_a_matrix_twice():
    """Only an abs-max over more than a task's values is a pass of its own (scales_cpu); every
    refresh-th encode takes it; other codecs read grad and residual once."""
    n_cols, n_rows = 100, 1000   # 100,000 values > CHUNK
    det = lambda **o: make_codec("dettmers", **o).encode_reread_bytes(n_cols, n_rows)
    assert det() == 8.0 * 100_000
    assert det(refresh=50) == 8.0 * 100_000 / 50
    assert det(error_feedback=False) == 4.0 * 100_000
    assert det(block=4096) == 0.0 and det(block=20_000) == 8.0 * 100_000
    assert det(dtype="mantissa") == 0.0   # a fixed scale: no abs-max
    assert make_codec("dettmers").encode_reread_bytes(10, 100) == 0.0   # one task's values
    for name in ("onebit", "kbit", "float16", "float32"):
        assert make_codec(name).encode_reread_bytes(n_cols, n_rows) == 0.0


def test_dettmers_tables_are_sorted_256_values():
    for d in DTYPES:
        t = make_table(d)
        assert t.shape == (256,) and (np.diff(t) >= 0).all() and t.dtype == np.float32
    dyn = make_table("dynamic_tree")
    assert 0.0 in dyn and dyn[-1] == 1.0 and len(set(dyn.tolist())) == 256


@pytest.mark.parametrize("dtype", DTYPES)
def test_dettmers_bucket_lookup_counts_midpoints_like_searchsorted(dtype):
    """The CPU encode's one-lookup code equals np.searchsorted(mids, x, 'right') at every
    midpoint, one ulp either side of it, at +-0, denormals, values past the table and in
    every decade between."""
    from numba import njit
    from hpcsgd.codecs.dettmers import _bucket_code, code_buckets, midpoints

    @njit
    def codes(x, buckets, emin, emax, M):
        out = np.empty(x.size, np.int64)
        for i in range(x.size):
            out[i] = _bucket_code(x[i], buckets, emin, emax, M)
        return out

    mids = midpoints(make_table(dtype))
    rng = np.random.default_rng(1)
    x = np.concatenate([
        mids, np.nextafter(mids, -np.inf), np.nextafter(mids, np.inf),
        [0.0, -0.0, 5e-324, -5e-324, 2.2e-308, -2.2e-308, 1e300, -1e300, np.inf, -np.inf],
        rng.standard_normal(200_000) * 10.0 ** rng.uniform(-12, 2, 200_000)])
    buckets = code_buckets(mids)
    assert buckets[0].size <= 8193  # the table stays in L1
    np.testing.assert_array_equal(codes(x, *buckets), np.searchsorted(mids, x, side="right"))


def encode_both(codec_opts, g, r):
    """(packed bytes, residuals) of the CPU encode and of the reference, from the same g, r."""
    out = {}
    for backend in ("cpu", "reference"):
        codec = make_codec("dettmers", backend=backend, **codec_opts)
        rr = r.copy()
        buf = np.zeros(codec.packed_nbytes(*g.shape), np.uint8)
        codec.encode(g, rr, buf)
        out[backend] = (buf, rr)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm,offset", [("absmax", 10.0), ("fixed", 10.0), ("fixed", 7e30),
                                         ("fixed", 3e-41)])
def test_dettmers_codes_by_v_bits_at_and_beside_every_threshold_as_the_reference(
        dtype, norm, offset, monkeypatch):
    """One scale over a large matrix takes the v-keyed encode (scale_thresholds,
    scale_buckets, encode_vspace_cpu); here forced on a small one. Values at m * s for every
    midpoint m and two float32s either side (the true thresholds lie among them), +-0,
    denormals, values beyond the scale and random ones: the same bytes and residuals as the
    reference. A denormal scale crowds the thresholds into one bucket: that takes the float64
    path, the same bits too."""
    import hpcsgd.codecs.dettmers as dm
    monkeypatch.setattr(dm, "VSPACE_MIN_VALUES", 0)
    mids = dm.midpoints(make_table(dtype))
    s = np.float32(0.37) if norm == "absmax" else np.float32(offset)
    near = np.float32(mids * np.float64(s))
    for _ in range(2):
        near = np.concatenate([near, np.nextafter(near[-255:], np.float32(np.inf)),
                               np.nextafter(near[:255], -np.float32(np.inf))])
    rng = np.random.default_rng(2)
    v = np.concatenate([near, [0.0, -0.0, 1e-45, -1e-45, 1e-39, -1e-39, s, -s, 3 * s, -3 * s],
                        (rng.standard_normal(4000) * s * 10.0 ** rng.uniform(-9, 0, 4000))])
    v = v.astype(np.float32)
    if norm == "absmax":   # the scale is s: nothing beyond it
        v = np.clip(v, -s, s)
    g = v.reshape(1, -1)
    r = np.where(np.signbit(g), np.float32(-0.0), np.float32(0.0)).astype(np.float32)  # v = g
    crowded = offset < 1e-38
    assert (dm.scale_buckets(dm.scale_thresholds(dm.midpoints(make_table(dtype)), s))[0].size
            == 0) == crowded
    for ef in (True, False):   # the codes with their residuals in one loop, or alone
        out = encode_both({"dtype": dtype, "norm": norm, "offset": offset,
                           "error_feedback": ef}, g, r)
        assert out["cpu"][0].tobytes() == out["reference"][0].tobytes()
        np.testing.assert_array_equal(out["cpu"][1].view(np.int32),
                                      out["reference"][1].view(np.int32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_dettmers_scale_thresholds_are_the_smallest_float32_reaching_each_midpoint(dtype):
    """T_c by its definition, over 300 scales from 1e-30 to 1e30: float64(T) / s >= m, and
    the float32 just below T gives less (a threshold at -0 stands at +0, the same value)."""
    import hpcsgd.codecs.dettmers as dm
    from hpcsgd.codecs.common import order_key
    mids = dm.midpoints(make_table(dtype))
    for s in np.float32(10.0 ** np.random.default_rng(3).uniform(-30, 30, 300)):
        keys = dm.scale_thresholds(mids, s)
        keys = np.where(keys == 0, -1, keys)   # +0 back to -0: the float32 below is -denormal
        t = order_key(keys.astype(np.int32)).view(np.float32).astype(np.float64)
        below = order_key((keys - 1).astype(np.int32)).view(np.float32).astype(np.float64)
        assert (t / np.float64(s) >= mids).all() and (below / np.float64(s) < mids).all()


def test_dettmers_large_matrix_takes_the_v_keyed_encode_with_the_same_bits_and_finds_nan():
    import hpcsgd.codecs.dettmers as dm
    shape = (2, (dm.VSPACE_MIN_VALUES + 1) // 2 + 5)
    g = grads(shape, 1, seed=4)[0]
    r = (np.random.default_rng(5).standard_normal(shape) * 1e-5).astype(np.float32)
    scale = np.float32(np.abs(g + r).max())
    assert dm.scale_buckets(dm.scale_thresholds(dm.midpoints(make_table("dynamic_tree")),
                                                scale))[0].size > 0
    out = encode_both({}, g, r)
    assert out["cpu"][0].tobytes() == out["reference"][0].tobytes()
    np.testing.assert_array_equal(out["cpu"][1].view(np.int32), out["reference"][1].view(np.int32))
    g[1, 7] = np.nan
    codec = make_codec("dettmers")
    with pytest.raises(ValueError, match=r"column 1"):
        codec.encode(g, r, np.zeros(codec.packed_nbytes(*shape), np.uint8))


def test_dettmers_refresh_reuses_the_scale_and_error_feedback_carries_the_clip():
    c = make_codec("dettmers", dtype="dynamic_tree", refresh=3)
    g = np.full((1, 8), 1.0, np.float32)
    r = np.zeros_like(g)
    buf = np.zeros(c.packed_nbytes(1, 8), np.uint8)
    c.encode(g, r, buf)
    assert buf[4:8].view(np.float32)[0] == 1.0
    c.encode(g * 4, r, buf)  # stale abs-max 1.0: values clip to 1.0, the rest goes to r
    assert buf[4:8].view(np.float32)[0] == 1.0 and np.allclose(r, 3.0)
    c.encode(g, r, buf)
    c.encode(g, r, buf)  # fourth encode refreshes: abs-max of g + r = 4
    assert buf[4:8].view(np.float32)[0] == 4.0


@pytest.mark.parametrize("m0, m1", [(-0.0, 1.5), (-2.0, -0.0), (-0.0, -0.0), (-1.0, 0.0)])
def test_onebit_decode_keeps_the_sign_of_a_zero_mean(m0, m1):
    """The CPU decode zeroes and adds unless a mean is -0.0 (a negative mean that
    underflowed): the bits must match the reference's select either way."""
    from hpcsgd.codecs.onebit import decode_ref
    n_cols, n_rows = 3, 75
    codec = make_codec("onebit")
    packed = np.random.default_rng(0).integers(0, 256, codec.packed_nbytes(n_cols, n_rows),
                                               dtype=np.uint8)
    words = packed.view(np.float32).reshape(n_cols, -1)
    words[:, 0], words[:, 1] = m0, m1
    want = np.empty((n_cols, n_rows), np.float32)
    decode_ref(packed, want, False)
    got = np.full((n_cols, n_rows), 7.0, np.float32)
    codec.decode(packed, got)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert (np.signbit(want) == np.signbit(np.float32(m0))).any()


def test_dettmers_block_and_refresh_come_from_the_config_and_a_fused_block_takes_its_max():
    """exchange.dettmers_block/_refresh reach the striped exchange's codec; blocks a task holds
    whole take their abs-max in the encode's pass (the same scales as a pass of their own)."""
    from hpcsgd import config
    from hpcsgd.comm.exchange import configured_codec
    cfg = config.load(None, ["data.train=x", "exchange.aggregation=striped",
                             "exchange.codec=dettmers", "exchange.dettmers_block=64",
                             "exchange.dettmers_refresh=3"])
    c = configured_codec(cfg)
    assert (c.block, c.refresh, c.dtype) == (64, 3, "dynamic_tree")
    g = grads((3, 100), 1, seed=4)[0]   # 300 values: blocks of 64, the last one short
    buf = np.zeros(c.packed_nbytes(*g.shape), np.uint8)
    c.encode(g, np.zeros_like(g), buf)
    flat = g.reshape(-1)
    want = [np.abs(flat[i:i + 64]).max() for i in range(0, flat.size, 64)]
    np.testing.assert_array_equal(buf[4:4 + 4 * len(want)].view(np.float32), want)
    assert buf[:4].view(np.uint32)[0] == 1   # age: the next two encodes reuse these scales
