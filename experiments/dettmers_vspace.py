"""Would the Dettmers CPU encode be faster keyed by v's own float32 bits? Timed, not landed
(docs/benchmarks.md, "The Dettmers code as (entry + place) >> S").

For one scale s: the 255 thresholds T_c = the smallest float32 v with float64(v) / s >= mid_c,
found by walking float32 order keys (v -> fl(v / s) never falls as v rises, so
code(v) = #{c: T_c <= v} exactly). A bucket table over 2^16-key ranges of order keys holds
lo * 2^16 + 2^16 - t (t: the place of the bucket's one threshold), so code = (entry + place)
>> 16 as in the package. No float64 divide, 8 int32 lanes for the keys. Also an explicit AVX2
gather (`llvm.x86.avx2.gather.*`, a target intrinsic LLVM cannot scalarise) for the bucket
entry and the decoded value, in place of scalar loads.

    python experiments/dettmers_vspace.py

Prints: the three encodes' codes and residuals against the package's (bit-identical), the
compute per value from cache on one thread (16,384 values, best of 7 x 100, alternated), and
the 46M model's largest matrix (19.1M values) on 2 threads, package against v-space,
alternated with the triad.
"""
import time

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

import hpcsgd.codecs.dettmers as d
from hpcsgd.bench import membw
from hpcsgd.codecs.common import f32_bits, f32_from_bits, order_key

PLACE_BITS = 16
SUB = 1024
CHUNK = 1 << 14
_order_key = njit(inline="always")(order_key)


@njit
def thresholds(mids, s, out):
    """out[c] = order key of the smallest float32 v with float64(v) / s >= mids[c]."""
    sd = np.float64(s)
    for c in range(mids.size):
        m = mids[c]
        k = np.int64(_order_key(f32_bits(np.float32(m * sd))))
        while np.float64(f32_from_bits(_order_key(np.int32(k)))) / sd < m:
            k += 1
        while np.float64(f32_from_bits(_order_key(np.int32(k - 1)))) / sd >= m:
            k -= 1
        out[c] = k


@njit
def build(keys, table):
    """Buckets of 2^PLACE_BITS order keys from the one below the first threshold's to the one
    above the last's. Returns (base, buckets), or buckets < 0 if one holds two thresholds."""
    base = (keys[0] >> PLACE_BITS) - 1
    n = (keys[-1] >> PLACE_BITS) + 1 - base + 1
    if n > table.size:
        return base, -2
    j = 0
    for b in range(n):
        start = (base + b) << PLACE_BITS
        end = start + (1 << PLACE_BITS)
        while j < keys.size and keys[j] <= start:
            j += 1
        t = 1 << PLACE_BITS
        if j < keys.size and keys[j] < end:
            t = keys[j] - start
            if j + 1 < keys.size and keys[j + 1] < end:
                return base, -1
        table[b] = (j << PLACE_BITS) + (1 << PLACE_BITS) - t
    return base, n


@njit(inline="always")
def _keys(g, r, ja, jb, kx, vb, lo_k, hi_k):
    """Packed (bucket << 16 | place) and v = g + r for a run of values: 8 int32 lanes."""
    for i in range(ja, jb):
        v = g[i] + r[i]
        vb[i - ja] = v
        ok = np.int32(_order_key(f32_bits(v)))
        k = np.int32(np.int32(min(np.int32(max(np.int32(ok >> np.int32(PLACE_BITS)), lo_k)),
                                  hi_k)) - lo_k)
        kx[i - ja] = np.int32(np.int32(k << np.int32(PLACE_BITS)) | np.int32(ok & np.int32(0xFFFF)))


@njit(parallel=True)
def encode_vspace(g, r, codes, vt, table, base, nb):
    n = g.size
    lo_k, hi_k = np.int32(base), np.int32(base + nb - 1)
    for t in prange(-(-n // CHUNK)):
        lo, hi = t * CHUNK, min(t * CHUNK + CHUNK, n)
        kx, vb = np.empty(SUB, np.int32), np.empty(SUB, np.float32)
        for j in range(lo, hi, SUB):
            ja, jb = np.uint64(j), np.uint64(min(j + SUB, hi))
            _keys(g, r, ja, jb, kx, vb, lo_k, hi_k)
            for i in range(ja, jb):
                w = np.uint64(np.uint32(kx[i - ja]))
                codes[i] = (np.uint64(table[w >> np.uint64(16)]) + (w & np.uint64(0xFFFF))) \
                    >> np.uint64(16)
            for i in range(ja, jb):
                r[i] = vb[i - ja] - vt[codes[i]]


V8I, V8F = ir.VectorType(ir.IntType(32), 8), ir.VectorType(ir.FloatType(), 8)


@intrinsic
def _code8(typingctx, table, kx, codes, vb, vt, r, i, j):
    """codes[i:i+8] = (table[kx >> 16] + (kx & 0xFFFF)) >> 16 and r[i:i+8] = vb[j:j+8] -
    vt[codes], with the two reads as vpgatherdd / vgatherdps."""
    def codegen(context, builder, sig, args):
        def ptr(k, idx=None):
            data = context.make_array(sig.args[k])(context, builder, args[k]).data
            return data if idx is None else builder.gep(data, [idx])
        i8p = ir.IntType(8).as_pointer()
        gi = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            V8I, [V8I, i8p, V8I, V8I, ir.IntType(8)]), "llvm.x86.avx2.gather.d.d.256")
        gf = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
            V8F, [V8F, i8p, V8I, V8F, ir.IntType(8)]), "llvm.x86.avx2.gather.d.ps.256")
        four = ir.Constant(ir.IntType(8), 4)
        ones = ir.Constant(V8I, [-1] * 8)
        w = builder.load(builder.bitcast(ptr(1, args[7]), V8I.as_pointer()), align=4)
        e = builder.call(gi, [ir.Constant(V8I, [0] * 8), builder.bitcast(ptr(0), i8p),
                              builder.lshr(w, ir.Constant(V8I, [16] * 8)), ones, four])
        c = builder.lshr(builder.add(e, builder.and_(w, ir.Constant(V8I, [0xFFFF] * 8))),
                         ir.Constant(V8I, [16] * 8))
        v8b = ir.VectorType(ir.IntType(8), 8)
        builder.store(builder.trunc(c, v8b), builder.bitcast(ptr(2, args[6]), v8b.as_pointer()),
                      align=1)
        dec = builder.call(gf, [ir.Constant(V8F, [0.0] * 8), builder.bitcast(ptr(4), i8p), c,
                                builder.bitcast(ones, V8F), four])
        v = builder.load(builder.bitcast(ptr(3, args[7]), V8F.as_pointer()), align=4)
        builder.store(builder.fsub(v, dec), builder.bitcast(ptr(5, args[6]), V8F.as_pointer()),
                      align=4)
        return context.get_dummy_value()
    return types.void(table, kx, codes, vb, vt, r, types.intp, types.intp), codegen


@njit
def encode_gather(g, r, codes, vt, table, base, nb):
    """One thread, n a multiple of SUB."""
    lo_k, hi_k = np.int32(base), np.int32(base + nb - 1)
    kx, vb = np.empty(SUB, np.int32), np.empty(SUB, np.float32)
    for j in range(0, g.size, SUB):
        _keys(g, r, np.uint64(j), np.uint64(j + SUB), kx, vb, lo_k, hi_k)
        for q in range(0, SUB, 8):
            _code8(table, kx, codes, vb, vt, r, j + q, q)


def setup(n, seed=0):
    g = np.random.default_rng(seed).standard_normal(n).astype(np.float32) * 1e-3
    r = np.random.default_rng(seed + 1).standard_normal(n).astype(np.float32) * 1e-5
    s = np.float32(np.abs(g + r).max())
    table = d.make_table("dynamic_tree")
    mids = d.midpoints(table)
    keys, vtab = np.empty(255, np.int64), np.empty(1 << 16, np.int32)
    t0 = time.perf_counter()
    thresholds(mids, s, keys)
    base, nb = build(keys, vtab)
    built = time.perf_counter() - t0
    assert nb > 0
    vt = np.empty(256, np.float32)
    d._scaled_table(table, s, vt)
    package = (table, *d.code_buckets(mids))
    return g, r, s, vt, vtab, base, nb, package, built


def main():
    # the same bits: each encode against the package's, from the same residuals
    import llvmlite.binding as llvm
    avx2 = "+avx2" in llvm.get_host_cpu_features().flatten().split(",")
    g, r0, s, vt, vtab, base, nb, package, _ = setup(1 << 14)
    scales, flags = np.array([s], np.float32), np.zeros(1, np.uint8)
    runs = {"package": lambda g, r, c: d.encode_cpu(g, r, True, c, scales, g.size, *package, flags),
            "vspace": lambda g, r, c: encode_vspace(g, r, c, vt, vtab, base, nb)}
    if avx2:
        runs["avx2 gather"] = lambda g, r, c: encode_gather(g, r, c, vt, vtab, base, nb)
    out = {}
    for name, fn in runs.items():
        r, c = r0.copy(), np.zeros(g.size, np.uint8)
        fn(g, r, c)
        out[name] = (c, r)
    for name in runs:
        print(f"{name}: same codes and residuals as the package's:",
              np.array_equal(out[name][0], out["package"][0]),
              np.array_equal(out[name][1].view(np.int32), out["package"][1].view(np.int32)))
    # compute from cache, one thread
    membw.set_threads(1)
    best = dict.fromkeys(runs, float("inf"))
    r, c = r0.copy(), np.zeros(g.size, np.uint8)
    for _ in range(7):
        for name, fn in runs.items():
            best[name] = min(best[name], membw.best_time(lambda: fn(g, r, c), 100))
    for name in runs:
        print(f"from cache, 1 thread: {name} {best[name] / g.size * 1e9:.2f} ns/value")
    # the 46M model's largest matrix, 2 threads, alternated with the triad
    membw.set_threads(2)
    g, r0, s, vt, vtab, base, nb, package, built = setup(2048 * 9304)
    print(f"per-scale table: {nb} buckets, built in {built * 1e6:.0f} us (first call compiles)")
    scales = np.array([s], np.float32)
    triad, nbytes = membw.triad_timer(200 << 20)
    r, c = r0.copy(), np.zeros(g.size, np.uint8)
    full = {"package": lambda: d.encode_cpu(g, r, True, c, scales, g.size, *package, flags),
            "vspace": lambda: encode_vspace(g, r, c, vt, vtab, base, nb)}
    for rnd in range(4):
        for name, fn in full.items():
            fn()
            tt = min(membw.best_time(triad, 1) for _ in range(3))
            t = membw.best_time(fn, 5)
            print(f"round {rnd} {name:8s} {t * 1e3:6.2f} ms, {13 * g.size / t / (nbytes / tt):4.0%}"
                  f" of the triad ({nbytes / tt / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
