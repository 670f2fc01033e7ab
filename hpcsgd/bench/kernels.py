"""`hpcsgd bench kernels`: encode and decode-accumulate throughput of every codec on the
gradient of the paper's 46M-parameter DNN (440-7x2048-9304, our (n_in, n_out) layout, plus
biases), as GB/s of the bytes that must move and as a fraction of the fused-triad memory
bandwidth measured in the same run with the same thread count.

Bytes that must move, per value: encode with error feedback reads grad and residual and
writes residual (12 B) plus the packed bytes; without error feedback 4 B plus packed;
decode-accumulate reads packed and reads+writes the float32 sum (8 B plus packed).
An encode that must read more (Dettmers' abs-max pass over a whole matrix before its first
code) has a bound below 100%: the bytes counted over the bytes it moves at least, its
`encode_reread_bytes` included; the `bound` column says what it can reach at the triad's rate.

    hpcsgd bench kernels [--small] [--json FILE] [--compare OLD] [--threads N]
                         [--codecs onebit,kbit4]
"""
import numpy as np

from hpcsgd.bench import membw
from hpcsgd.codecs import make_codec

PAPER_46M = [(440, 2048)] + [(2048, 2048)] * 6 + [(2048, 9304)]
SMALL = [(44, 256), (256, 256), (256, 930)]
CODECS = {
    "onebit": ("onebit", {}),
    "kbit2": ("kbit", {"bits": 2}),
    "kbit4": ("kbit", {"bits": 4}),
    "kbit8": ("kbit", {"bits": 8}),
    "dettmers": ("dettmers", {"dtype": "dynamic_tree"}),
    # the abs-max per 4096 values, taken in the encode's one read (exchange.dettmers_block)
    "dettmers_b4096": ("dettmers", {"dtype": "dynamic_tree", "block": 4096}),
    # the paper's fast setting: the abs-max every 50th encode (timed over the 50)
    "dettmers_r50": ("dettmers", {"dtype": "dynamic_tree", "refresh": 50}),
    "float16": ("float16", {}),
    "float32": ("float32", {}),
}


def add_arguments(parser):
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CI smoke test")
    parser.add_argument("--threads", type=int, default=None, help="Numba threads (default: all)")
    parser.add_argument("--codecs", default=",".join(CODECS),
                        help=f"comma-separated subset of {','.join(CODECS)}")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs, best kept")


def matrices(small):
    """(n_cols, n_rows) of every weight matrix and bias: codec column = input unit."""
    shapes = SMALL if small else PAPER_46M
    return shapes + [(1, n_out) for _, n_out in shapes]


def bench_codec(name, opts, shapes, repeats, rng, triad):
    """Best-of-`repeats` encode and decode-accumulate times, each round also timing one triad
    (`triad` = (run, bytes)) so the limit is sampled as often, and as close in time, as the
    codec: on a shared VM that is the fair 'same run' comparison."""
    codec = make_codec(name, backend="cpu", **opts)
    grads = [rng.standard_normal(s).astype(np.float32) * 1e-3 for s in shapes]
    res = [np.zeros(s, np.float32) for s in shapes]
    bufs = [np.zeros(codec.packed_nbytes(*s), np.uint8) for s in shapes]
    sums = [np.zeros(s, np.float32) for s in shapes]
    ef = codec.error_feedback

    period = getattr(codec, "refresh", 1)   # an encode's time: the mean over a refresh period

    def enc():
        for _ in range(period):
            for g, r, b in zip(grads, res, bufs):
                codec.encode(g, r, b)

    def dec():
        for b, s in zip(bufs, sums):
            codec.decode_accumulate(b, s)

    enc(), dec()  # compile and first touch
    n = sum(a * b for a, b in shapes)
    packed = sum(b.size for b in bufs)
    counted = (12 if ef else 4) * n + packed
    reread = sum(codec.encode_reread_bytes(*s) for s in shapes)
    t_tri = t_enc = t_dec = float("inf")
    for _ in range(repeats):
        t_tri = min(t_tri, membw.best_time(triad[0], 1))
        t_enc = min(t_enc, membw.best_time(enc, 1) / period)
        t_dec = min(t_dec, membw.best_time(dec, 1))
    return {"values": n, "packed_bytes": packed, "bits_per_value": 8 * packed / n,
            "triad_GBps": triad[1] / t_tri / 1e9,
            "encode_s": t_enc, "encode_GBps": counted / t_enc / 1e9,
            "encode_bound_frac_triad": counted / (counted + reread),
            "decode_acc_s": t_dec, "decode_acc_GBps": (8 * n + packed) / t_dec / 1e9}


def run(args):
    threads = membw.set_threads(args.threads)
    small = args.small
    repeats = args.repeats or (2 if small else 15)  # best of many: the VM shares its memory bus
    bw_bytes = (8 << 20) if small else (200 << 20)
    shapes = matrices(small)
    rng = np.random.default_rng(0)
    print(f"hpcsgd bench kernels: {threads} threads, {'small' if small else 'paper 46M'} shapes, "
          f"{sum(a * b for a, b in shapes) / 1e6:.1f}M values")
    triad = membw.triad_timer(bw_bytes)
    rows = {}
    for key in args.codecs.split(","):
        name, opts = CODECS[key]
        rows[key] = bench_codec(name, opts, shapes, repeats, rng, triad)
    samples = [r["triad_GBps"] for r in rows.values()]
    copy = membw.copy_bandwidth(bw_bytes, threads, repeats)
    print(f"memory bandwidth: triad {min(samples):.1f}..{max(samples):.1f} GB/s (best of "
          f"{repeats}, timed in alternation with each codec), copy {copy:.1f} GB/s.\n"
          f"Each codec is judged against the triad timed in alternation with it. Triad counts "
          f"12 B/element; with write-allocate the bus moves 16, so in-place kernels can exceed 100%.")
    width = max(len("codec"), *map(len, rows))
    print(f"{'codec':{width}} {'bits/val':>8} {'enc ms':>8} {'enc GB/s':>9} {'enc/triad':>9} "
          f"{'bound':>6} {'dacc ms':>8} {'dacc GB/s':>9} {'dacc/triad':>10}")
    for key, r in rows.items():
        r["encode_frac_triad"] = r["encode_GBps"] / r["triad_GBps"]
        r["decode_acc_frac_triad"] = r["decode_acc_GBps"] / r["triad_GBps"]
        print(f"{key:{width}} {r['bits_per_value']:8.3f} {1e3 * r['encode_s']:8.2f} "
              f"{r['encode_GBps']:9.2f} {r['encode_frac_triad']:9.0%} "
              f"{r['encode_bound_frac_triad']:6.0%} {1e3 * r['decode_acc_s']:8.2f} "
              f"{r['decode_acc_GBps']:9.2f} {r['decode_acc_frac_triad']:10.0%}")
    return {"threads": threads, "small": small, "triad_GBps": max(samples), "copy_GBps": copy,
            "repeats": repeats, "shapes": shapes, "codecs": rows}


def figures(res):
    out = {"triad GB/s": res["triad_GBps"], "copy GB/s": res["copy_GBps"]}
    for key, r in res["codecs"].items():
        out[f"{key} encode GB/s"] = r["encode_GBps"]
        out[f"{key} encode of triad"] = r["encode_frac_triad"]
        out[f"{key} decode-acc GB/s"] = r["decode_acc_GBps"]
        out[f"{key} decode-acc of triad"] = r["decode_acc_frac_triad"]
    return out
