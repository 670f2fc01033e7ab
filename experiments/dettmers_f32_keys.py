"""Would a float32 code rule make the Dettmers encode faster? The CPU encode computes
x = v / scale in float64 and looks up a 64-bit bucket entry keyed by x's float64 bits (eight
lanes per AVX-512 gather, four per AVX2 one). This tries the float32 rule: x = v / scale
rounded to float32, a bucket table of int32 entries keyed by its float32 bits (twice the
lanes per gather and per vector op). First it checks the float32 table against searchsorted
on the float32 quotients for every Dettmers type (0 mismatches expected), then times both
encodes over the 46M model's largest matrix (2048 x 9304) on 2 threads, as a share of the
triad measured in the same run.
    python experiments/dettmers_f32_keys.py
"""
import numpy as np
from numba import njit, prange, types
from numba.core.extending import intrinsic
from llvmlite import ir
from hpcsgd.bench import membw
from hpcsgd.codecs.dettmers import (CHUNK, SUB, _bucket_code, code_buckets, encode_cpu,
                                    make_table, midpoints)

SHIFT = 23

def code_buckets32(mids):
    mids = np.asarray(mids, np.float64)
    mag = np.abs(mids[mids != 0])
    emin = int(np.frexp(mag.min())[1]) - 1 + 127 - 1
    emax = int(np.frexp(mag.max())[1]) - 1 + 127 + 1
    ne = emax - emin + 1
    for M in range(1, 13):
        lowmask = (1 << (23 - M)) - 1
        e, m = np.meshgrid(np.arange(emin, emax + 1, dtype=np.int64), np.arange(1 << M, dtype=np.int64), indexing="ij")
        b0 = ((e << 23) | (m << (23 - M))).ravel()
        ok = True; entries = []
        for sign in (0, 1):
            sb = np.int64(sign) << 31
            def q_at(low):  # count at mirrored low bits `low` (x grows with low)
                bits = b0 | (low if sign == 0 else lowmask - low) | sb
                x = bits.astype(np.uint32).view(np.float32).astype(np.float64)
                return np.searchsorted(mids, x, side="right")
            lo = q_at(np.zeros_like(b0)); hi = q_at(np.full_like(b0, lowmask))
            if (hi - lo > 1).any():
                ok = False; break
            # smallest low with q_at(low) > lo: binary search
            a = np.zeros_like(b0); b = np.full_like(b0, lowmask + 1)
            while (b - a > 0).any():
                mid = (a + b) // 2
                up = q_at(np.minimum(mid, lowmask)) > lo
                up &= mid <= lowmask
                b = np.where(up & (b - a > 0), mid, b)
                a = np.where(~up & (b - a > 0), mid + 1, a)
            t = np.where(hi > lo, a, lowmask + 1)
            entries.append((lo << SHIFT) | t)
        if ok:
            table = np.concatenate(entries).astype(np.int32)
            return table, emin, emax, M, int(np.searchsorted(mids, 0.0, side="right"))
    raise ValueError

@intrinsic
def _f32_bits(typingctx, x):
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(types.float32), codegen

@njit(inline="always")
def bcode32(x, buckets, emin, emax, M, qzero):
    u = _f32_bits(x)
    s = (u >> 31) & 1
    e = min(max((u >> 23) & 0xFF, emin), emax)
    m = (u >> (23 - M)) & ((1 << M) - 1)
    lowmask = (1 << (23 - M)) - 1
    entry = buckets[((s * (emax - emin + 1) + e - emin) << M) | m]
    xlow = (u & lowmask) ^ (lowmask & -s)
    q = (entry >> SHIFT) + (xlow >= (entry & ((1 << SHIFT) - 1)))
    return qzero if x == 0.0 else q

def make_encode(f32):
    """The CPU encode's two loops (codes, then residuals) under either code rule."""
    @njit(parallel=True)
    def encode(g, r, codes, s, vt, buckets, emin, emax, M, qzero):
        n = g.size
        sd = np.float64(s)
        for t in prange(-(-n // CHUNK)):
            lo, hi = t * CHUNK, min(t * CHUNK + CHUNK, n)
            for j in range(lo, hi, SUB):
                ja, jb = np.uint64(j), np.uint64(min(j + SUB, hi))
                for i in range(ja, jb):
                    v = g[i] + r[i]
                    if f32:
                        codes[i] = bcode32(v / s, buckets, np.int32(emin), np.int32(emax),
                                           np.int32(M), qzero)
                    else:
                        codes[i] = _bucket_code(np.float64(v) / sd, buckets, emin, emax, M)
                for i in range(ja, jb):
                    r[i] = (g[i] + r[i]) - vt[codes[i]]
    return encode


enc32, enc64 = make_encode(True), make_encode(False)


def main():
    threads = membw.set_threads(2)
    for dt in ("dynamic_tree", "linear", "mantissa", "static_tree"):
        table = make_table(dt); mids = midpoints(table)
        b32 = code_buckets32(mids)
        rng = np.random.default_rng(1)
        x = np.concatenate([rng.standard_normal(1 << 20).astype(np.float32) * 10.0 ** rng.integers(-9, 1, 1 << 20),
                            mids.astype(np.float32), np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
                            np.nextafter(mids.astype(np.float32), -np.float32(np.inf)), [0, -0.0, 1, -1, 2, -2, 1e-30, -1e-30]]).astype(np.float32)
        ref = np.searchsorted(mids, x.astype(np.float64), side="right")
        @njit
        def allc(x, b, emin, emax, M, qz):
            out = np.empty(x.size, np.int64)
            for i in range(x.size):
                out[i] = bcode32(x[i], b, np.int32(emin), np.int32(emax), np.int32(M), qz)
            return out
        got = allc(x, *b32)
        print(dt, "M", b32[3], "entries", b32[0].size, "mismatches", int((got != ref).sum()))
    g = np.random.default_rng(0).standard_normal(2048 * 9304).astype(np.float32) * 1e-3
    r, codes = np.zeros_like(g), np.zeros(g.size, np.uint8)
    table = make_table("dynamic_tree"); mids = midpoints(table)
    s = np.float32(np.abs(g).max())
    vt = (table.astype(np.float64) * s).astype(np.float32)
    triad, nbytes = membw.triad_timer(200 << 20)
    b64 = code_buckets(mids); b32 = code_buckets32(mids)
    scales, flags = np.array([s], np.float32), np.zeros(1, np.uint8)
    runs = {"hpcsgd encode_cpu": lambda: encode_cpu(g, r, True, codes, scales, g.size, table,
                                                      *b64, flags),
            "float64 rule": lambda: enc64(g, r, codes, s, vt, *b64, 0),
            "float32 rule": lambda: enc32(g, r, codes, s, vt, *b32)}
    for name, fn in list(runs.items()) * 2:
        fn()
        t = tt = float("inf")
        for _ in range(7):
            tt = min(tt, membw.best_time(triad, 1))
            t = min(t, membw.best_time(fn, 1))
        print(f"{name:18s} {t * 1e3:6.2f} ms {t / g.size * threads * 1e9:5.2f} ns/value/thread "
              f"{13 * g.size / t / (nbytes / tt):4.0%} of the triad ({nbytes / tt / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
