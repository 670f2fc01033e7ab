"""Gradient codecs: encode a (n_cols, n_rows) float32 gradient (plus its error-feedback
residual) into a preallocated byte buffer, decode or decode-and-accumulate it back.

    codec = make_codec("onebit", backend="cpu")      # or "cuda", "reference"
    buf = np.empty(codec.packed_nbytes(*g.shape), np.uint8)
    codec.encode(g, residual, buf)                   # residual updated in place
    codec.decode_accumulate(buf, total)              # total += decoded

A codec column is an array row (the fan-out of one input unit, contiguous); a column stripe is
a row slice g[c0:c1]. See docs/codecs.md for layouts and measurements.
"""
from hpcsgd.errors import UserError


def make_codec(name, backend="cpu", **options):
    """Build a codec by name: onebit, kbit, dettmers, float32, float16."""
    if name == "onebit":
        from hpcsgd.codecs.onebit import OneBit as cls
    elif name == "kbit":
        from hpcsgd.codecs.kbit import KBit as cls
    elif name == "dettmers":
        from hpcsgd.codecs.dettmers import Dettmers as cls
    elif name in ("float32", "float16"):
        from hpcsgd.codecs.floats import Float as cls
        options["dtype"] = name
    else:
        raise UserError(f"unknown codec {name!r}; choose onebit, kbit, dettmers, float32 or float16")
    try:
        return cls(backend=backend, **options)
    except TypeError as e:
        raise UserError(f"codec {name}: bad option ({e})") from None
