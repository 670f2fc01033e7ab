"""The Dettmers CPU encode's two code rules side by side, and an AVX2-gather variant of the
v-keyed one (experiments/benchmarks_history.md, "What did not pay"; docs/codecs.md, Dettmers'
fifth and sixth passes).

- package float64: `encode_cpu`, keys from x = v / s in float64 (`code_buckets`);
- v-keyed: `encode_vspace_cpu`, keys from v's own float32 bits against the scale's thresholds
  (`scale_thresholds`, `scale_buckets`), what the codec runs for one scale over >= 2^20 values;
- avx2 gather: the v-keyed rule with the bucket entry and the decoded value read by
  `llvm.x86.avx2.gather.*` (a target intrinsic LLVM cannot scalarise) instead of scalar loads.

    python experiments/dettmers_vspace.py

Prints: each encode's codes and residuals against the package float64 one (bit-identical),
the compute per value from cache on one thread (16,384 values, best of 7 x 100, alternated),
and the 46M model's largest matrix (19.1M values) on 2 threads, alternated with the triad.
"""
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic

import hpcsgd.codecs.dettmers as d
from hpcsgd.bench import membw
from hpcsgd.codecs.common import f32_bits, order_key

SUB = 1024
_order_key = njit(inline="always")(order_key)


@njit(inline="always")
def _keys(g, r, ja, jb, kx, vb, lo_k, hi_k):
    """encode_vspace_cpu's keys for a run of values, and v = g + r."""
    for i in range(ja, jb):
        v = g[i] + r[i]
        vb[i - ja] = v
        key = np.int32(_order_key(f32_bits(v + np.float32(0.0))))
        k = np.int32(np.int32(min(np.int32(max(np.int32(key >> np.int32(16)), lo_k)),
                                  hi_k)) - lo_k)
        kx[i - ja] = np.int32(np.int32(k << np.int32(16)) | np.int32(key & np.int32(0xFFFF)))


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
def encode_gather(g, r, codes, vt, table, base):
    """One thread, n a multiple of SUB."""
    lo_k, hi_k = np.int32(base), np.int32(base + table.size - 1)
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
    t0 = time.perf_counter()
    entries, base = d.scale_buckets(d.scale_thresholds(mids, s))
    built = time.perf_counter() - t0
    assert entries.size
    vt = np.empty(256, np.float32)
    d._scaled_table(table, s, vt)
    return g, r, s, vt, entries, base, (table, *d.code_buckets(mids)), built


def main():
    import llvmlite.binding as llvm
    avx2 = "+avx2" in llvm.get_host_cpu_features().flatten().split(",")
    flags = np.zeros(1, np.uint8)

    def encodes(g, s, vt, entries, base, package, gather):
        scales = np.array([s], np.float32)
        runs = {"package float64": lambda r, c: d.encode_cpu(g, r, True, c, scales, g.size,
                                                             *package, flags),
                "v-keyed": lambda r, c: d.encode_vspace_cpu(g, r, True, c, vt, entries, base,
                                                            flags)}
        if gather and avx2:
            runs["avx2 gather"] = lambda r, c: encode_gather(g, r, c, vt, entries, base)
        return runs

    # the same bits, then the compute from cache on one thread
    g, r0, s, vt, entries, base, package, _ = setup(1 << 14)
    runs = encodes(g, s, vt, entries, base, package, True)
    out = {}
    for name, fn in runs.items():
        r, c = r0.copy(), np.zeros(g.size, np.uint8)
        fn(r, c)
        out[name] = (c, r)
    ref = out["package float64"]
    for name in runs:
        print(f"{name}: same codes and residuals:", np.array_equal(out[name][0], ref[0]),
              np.array_equal(out[name][1].view(np.int32), ref[1].view(np.int32)))
    membw.set_threads(1)
    best = dict.fromkeys(runs, float("inf"))
    r, c = r0.copy(), np.zeros(g.size, np.uint8)
    for _ in range(7):
        for name, fn in runs.items():
            best[name] = min(best[name], membw.best_time(lambda: fn(r, c), 100))
    for name in runs:
        print(f"from cache, 1 thread: {name} {best[name] / g.size * 1e9:.2f} ns/value")
    # the 46M model's largest matrix, 2 threads, alternated with the triad
    membw.set_threads(2)
    g, r0, s, vt, entries, base, package, built = setup(2048 * 9304)
    print(f"the scale's table: {entries.size} buckets, built in {built * 1e6:.0f} us")
    runs = encodes(g, s, vt, entries, base, package, False)
    triad, nbytes = membw.triad_timer(200 << 20)
    r, c = r0.copy(), np.zeros(g.size, np.uint8)
    for rnd in range(4):
        for name, fn in runs.items():
            fn(r, c)
            tt = min(membw.best_time(triad, 1) for _ in range(3))
            t = membw.best_time(lambda: fn(r, c), 5)
            print(f"round {rnd} {name:16s} {t * 1e3:6.2f} ms, "
                  f"{13 * g.size / t / (nbytes / tt):4.0%} of the triad ({nbytes / tt / 1e9:.1f} GB/s)")


if __name__ == "__main__":
    main()
