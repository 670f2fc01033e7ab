"""What the Dettmers encode's code loop costs, part by part: the CPU encode's two loops
(codes, then residuals) over the 46M model's largest matrix (2048 x 9304, 19.1M values) on
2 threads, with each of its three costly parts swapped for a stand-in of no cost:
  divide    x = v / scale in float64  -> v * (1 / scale)
  bucket    the 64-bit gather of the bucket entry  -> arithmetic on the index
  residual  the 32-bit gather of the decoded value -> code x scale
The stand-ins give wrong codes; only the times count. The memory traffic is the same in all.
This keeps the encode's loops as they were up to 2026-11-25 (keys and codes in one loop); the
product now computes keys, codes and residuals in three loops (see hpcsgd/codecs/dettmers.py).
    python experiments/dettmers_encode_parts.py
"""
import numpy as np
from numba import njit, prange

from hpcsgd.bench import membw
from hpcsgd.codecs.common import f64_bits
from hpcsgd.codecs.dettmers import (CHUNK, SUB, _bucket_code, code_buckets,
                                    make_table, midpoints)


@njit(inline="always")
def _bucket_index_only(x, buckets, emin, emax, M):
    """_bucket_code's arithmetic, the index standing in for the gathered entry."""
    u = f64_bits(x)
    s = (u >> 63) & 1
    e = min(max((u >> 52) & 0x7FF, emin), emax)
    m = (u >> (52 - M)) & ((1 << M) - 1)
    lowmask = (1 << (52 - M)) - 1
    entry = ((s * (emax - emin + 1) + e - emin) << M) | m
    xlow = (u & lowmask) ^ (lowmask & -s)
    q = (entry >> 3) + (xlow >= (entry & 1023))
    return 0 if x == 0.0 else q


def variant(divide, bucket, residual):
    @njit(parallel=True)
    def encode(g, r, codes, s, vt, buckets, emin, emax, M):
        n = g.size
        sd = np.float64(s)
        rs = 1.0 / sd
        for t in prange(-(-n // CHUNK)):
            lo, hi = t * CHUNK, min(t * CHUNK + CHUNK, n)
            for j in range(lo, hi, SUB):
                ja, jb = np.uint64(j), np.uint64(min(j + SUB, hi))
                for i in range(ja, jb):
                    v = g[i] + r[i]
                    x = np.float64(v) / sd if divide else np.float64(v) * rs
                    if bucket:
                        codes[i] = _bucket_code(x, buckets, emin, emax, M)
                    else:
                        codes[i] = _bucket_index_only(x, buckets, emin, emax, M)
                for i in range(ja, jb):
                    if residual:
                        r[i] = (g[i] + r[i]) - vt[codes[i]]
                    else:
                        r[i] = (g[i] + r[i]) - np.float32(codes[i]) * np.float32(s)
    return encode


def main():
    threads = membw.set_threads(2)
    g = np.random.default_rng(0).standard_normal(2048 * 9304).astype(np.float32) * 1e-3
    r, codes = np.zeros_like(g), np.zeros(g.size, np.uint8)
    table = make_table("dynamic_tree")
    buckets = code_buckets(midpoints(table))
    s = np.float32(np.abs(g).max())
    vt = (table.astype(np.float64) * s).astype(np.float32)
    triad, nbytes = membw.triad_timer(200 << 20)
    print(f"{threads} threads, {g.size / 1e6:.1f}M values; 13 B/value must move")
    for parts in [(1, 1, 1), (0, 1, 1), (1, 0, 1), (1, 1, 0), (0, 0, 0)]:
        fn = variant(*parts)
        fn(g, r, codes, s, vt, *buckets)
        t = tt = float("inf")
        for _ in range(7):
            tt = min(tt, membw.best_time(triad, 1))
            t = min(t, membw.best_time(lambda: fn(g, r, codes, s, vt, *buckets), 1))
        label = ", ".join(n for n, on in zip(("divide", "bucket", "residual"), parts) if on)
        frac = 13 * g.size / t / (nbytes / tt)
        print(f"{label or 'none of them':26s} {t * 1e3:6.2f} ms  "
              f"{t / g.size * threads * 1e9:5.2f} ns/value/thread  {frac:4.0%} of the triad")


if __name__ == "__main__":
    main()
