"""hpcsgd.model.flat: parameter specs -> one flat buffer with named views, codec columns
contiguous, exchanged parameters first."""
import numpy as np
import pytest

from hpcsgd.comm.stripes import stripe_ranges
from hpcsgd.model.dnn import layout
from hpcsgd.model.flat import FlatParams, ParamSpec, matrices


def test_layout_flat_views_and_codec_columns():
    lay = layout(6, [5, 4], 3)
    assert lay == [("enc.0.w", (6, 5)), ("enc.0.b", (1, 5)), ("enc.1.w", (5, 4)),
                   ("enc.1.b", (1, 4)), ("out.w", (4, 3)), ("out.b", (1, 3))]
    p = FlatParams(lay)
    assert p.flat.dtype == np.float32 and p.size == 6 * 5 + 5 + 5 * 4 + 4 + 4 * 3 + 3
    p.flat[:] = np.arange(p.size)
    offset = 0
    for m, (name, shape) in zip(p.matrices, lay):
        v = p.views[name]
        assert v.shape == shape and v.flags.c_contiguous and np.shares_memory(v, p.flat)
        assert (m.name, m.offset, m.n_cols, m.n_rows) == (name, offset, shape[0], shape[1])
        for j in range(m.n_cols):   # codec column j = fan-out of input unit j, contiguous
            np.testing.assert_array_equal(
                v[j], p.flat[m.offset + j * m.n_rows:m.offset + (j + 1) * m.n_rows])
        offset += m.size
    # stripes: every rank a contiguous column range of every matrix, together all columns once
    for size in (1, 2, 3, 7):
        covered = np.zeros(p.size, int)
        for rank in range(size):
            rs = stripe_ranges(p.matrices, rank, size)
            assert len(rs) == len(p.matrices)
            for (lo, hi), m in zip(rs, p.matrices):
                assert (lo - m.offset) % m.n_rows == 0 and (hi - lo) % m.n_rows == 0
                covered[lo:hi] += 1
        assert (covered == 1).all()


def test_parameters_are_grouped_by_how_they_are_exchanged():
    """codec first, then float, then none, each group in declaration order: the exchanged
    gradients are one prefix of the flat buffer."""
    specs = [ParamSpec("clip", (1, 2), "clip", "float"), ParamSpec("W0", (3, 4)),
             ParamSpec("frozen", (2, 2), "weight", "none"), ParamSpec("b0", (1, 4), "bias")]
    p = FlatParams(specs)
    assert [m.name for m in p.matrices] == ["W0", "b0", "clip", "frozen"]
    assert [m.offset for m in p.matrices] == [0, 12, 16, 18]
    assert (p.codec_size, p.exchanged, p.size) == (16, 18, 22)
    assert p.matrices[2].exchange == "float" and p.matrices[2].role == "clip"
    p.views["clip"][...] = 7
    np.testing.assert_array_equal(p.flat[16:18], [7, 7])
    # a DNN declares only codec parameters: its order is its declaration order
    assert [m.name for m in matrices(layout(6, [5], 3))] == ["enc.0.w", "enc.0.b", "out.w",
                                                              "out.b"]


def test_bad_specs_are_refused():
    with pytest.raises(ValueError, match="exchange"):
        FlatParams([ParamSpec("W", (2, 2), "weight", "sometimes")])
    with pytest.raises(ValueError, match="repeat"):
        FlatParams([("W", (2, 2)), ("W", (1, 2))])
    with pytest.raises(ValueError, match="shape"):
        FlatParams([("W", (2, 2, 2))])
