"""Reproduce Dettmers (2016) Table 1: mean absolute and mean relative error of the four 8-bit
types on U(0,1), N(0,1), N(0,10^2), N(0,0.2^2) samples.

Normalisation as in the paper: dynamic tree (and linear) divide by the sample's abs-max;
mantissa and static tree use an exponent offset of 10^1 (10^2 for N(0,10^2)).
    python experiments/codecs_dettmers_table1.py [--n 25000000] [--json out.json]
"""
import argparse
import json

import numpy as np

from hpcsgd.codecs import make_codec

PAPER = {  # (mean abs error, mean relative error %) from the paper's Table 1
    "U(0,1)": {"dynamic_tree": (0.00004, 1.39), "linear": (0.0024, 2.16),
               "mantissa": (0.0017, 7.22), "static_tree": (0.0007, 4.82)},
    "N(0,1)": {"dynamic_tree": (0.0005, 2.46), "linear": (0.0004, 6.47),
               "mantissa": (0.0104, 6.89), "static_tree": (0.0093, 6.3)},
    "N(0,10^2)": {"dynamic_tree": (0.049, 2.49), "linear": (0.041, 6.44),
                  "mantissa": (1.066, 7.19), "static_tree": (0.926, 6.28)},
    "N(0,0.2^2)": {"dynamic_tree": (0.000018, 2.45), "linear": (0.000015, 6.15),
                   "mantissa": (0.00055, 8.26), "static_tree": (0.00022, 6.58)},
}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=4_000_000, help="samples per distribution")
    ap.add_argument("--json")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    cols = 1000
    n = args.n // cols * cols
    dists = {"U(0,1)": lambda: rng.uniform(0, 1, n), "N(0,1)": lambda: rng.normal(0, 1, n),
             "N(0,10^2)": lambda: rng.normal(0, 10, n), "N(0,0.2^2)": lambda: rng.normal(0, 0.2, n)}
    out = {}
    print(f"{'dist':11} {'type':13} {'MAE':>10} {'paper':>9} {'MRE %':>7} {'paper':>6} "
          f"{'mean err':>10} {'median RE%':>10}")
    for dname, draw in dists.items():
        x = draw().astype(np.float32).reshape(cols, -1)
        offset = 100.0 if dname == "N(0,10^2)" else 10.0
        for dtype in ("dynamic_tree", "linear", "mantissa", "static_tree"):
            codec = make_codec("dettmers", dtype=dtype, offset=offset, error_feedback=False)
            buf = np.zeros(codec.packed_nbytes(*x.shape), np.uint8)
            codec.encode(x, None, buf)
            y = np.empty_like(x)
            codec.decode(buf, y)
            e = y.astype(np.float64) - x
            nz = x != 0
            rel = np.abs(e[nz]) / np.abs(x[nz].astype(np.float64))
            row = {"mae": float(np.abs(e).mean()), "mre_pct": float(100 * rel.mean()),
                   "mean_signed_err": float(e.mean()), "median_re_pct": float(100 * np.median(rel)),
                   "paper": PAPER[dname][dtype]}
            out.setdefault(dname, {})[dtype] = row
            print(f"{dname:11} {dtype:13} {row['mae']:10.2e} {row['paper'][0]:9.2g} "
                  f"{row['mre_pct']:7.2f} {row['paper'][1]:6.2f} {row['mean_signed_err']:10.1e} "
                  f"{row['median_re_pct']:10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
