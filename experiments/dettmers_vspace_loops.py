"""Where the v-keyed Dettmers encode (`encode_vspace_cpu`) spends its time, its codes and
residuals in one loop (the package's since 2026-11-26), and a prefetch that did not pay
(docs/codecs.md, Dettmers' seventh pass; experiments/benchmarks_history.md, "Codec kernels" and
"What did not pay").

    python experiments/dettmers_vspace_loops.py              # the loops, from cache
    git show 976a906:hpcsgd/codecs/dettmers.py > /tmp/dettmers_old.py
    python experiments/dettmers_vspace_loops.py ab /tmp/dettmers_old.py 8
    python experiments/dettmers_vspace_loops.py prefetch 8   # L2 prefetch

1. A copy of the encode whose loops (v = g + r; keys; codes; residuals: the form before) can
   each be left out (the codes are then wrong: only the times count), on 16,384 values from
   cache on one thread; and the codes and residuals in one loop, as LLVM vectorises it (with
   emulated gathers: the package's form) or kept scalar by an empty asm it cannot look into.
2. `ab OLD`: an older module's `encode_vspace_cpu` against the package's, alternated on the
   46M model's largest matrix (2048 x 9304) with 2 threads. Compare modules, not this file's
   copies: a copy of the same loops compiled here can run 15% apart from the package's.
3. `prefetch`: this file's copy asking for the lines of g and r 4,096 values ahead into L2,
   one line each per 16 values of the code loop, against the package's encode.
"""
import sys

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic

import hpcsgd.codecs.dettmers as d
from dettmers_vspace import setup
from hpcsgd.bench import membw
from hpcsgd.codecs.common import f32_bits, order_key

SUB, CHUNK = d.SUB, d.CHUNK
AHEAD = 4096
_order_key = njit(inline="always")(order_key)


@intrinsic
def opaque(typingctx, x):
    """x through an empty asm: LLVM cannot vectorise the loop around it."""
    def codegen(context, builder, sig, args):
        ty = context.get_value_type(sig.args[0])
        asm = ir.InlineAsm(ir.FunctionType(ty, [ty]), "", "=r,0", side_effect=False)
        return builder.call(asm, [args[0]])
    return x(x), codegen


@intrinsic
def prefetch_l2(typingctx, arr, i):
    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
            "llvm.prefetch.p0")
        builder.call(fn, [builder.bitcast(builder.gep(data, [args[1]]), i8p),
                          ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return types.void(arr, types.uint64), codegen


@njit(inline="always")
def _code(keys, entries, i):
    w = np.uint64(np.uint32(keys[i]))
    return (np.uint64(entries[w >> np.uint64(16)]) + (w & np.uint64(0xFFFF))) >> np.uint64(16)


@njit(parallel=True)
def encode(g, r, codes, vt, entries, base, loops, prefetch):
    """encode_vspace_cpu with ef on and no NaN flag; loops: 1 v, 2 keys, 4 codes,
    8 residuals, 16 codes and residuals in one loop (prefetching if asked), 32 the same
    kept scalar."""
    n = g.size
    lo_k, hi_k = np.int32(base), np.int32(base + entries.size - 1)
    for t in prange(-(-n // CHUNK)):
        lo, hi = t * CHUNK, min((t + 1) * CHUNK, n)
        keys, vs = np.empty(SUB, np.int32), np.empty(SUB, np.float32)
        for j in range(lo, hi, SUB):
            ja, jb = np.uint64(j), np.uint64(min(j + SUB, hi))
            if loops & 1:
                for i in range(ja, jb):
                    vs[i - ja] = g[i] + r[i]
            if loops & 2:
                for i in range(np.uint64(0), jb - ja):
                    key = np.int32(_order_key(f32_bits(vs[i] + np.float32(0.0))))
                    k = np.int32(np.int32(min(np.int32(max(np.int32(key >> np.int32(16)), lo_k)),
                                              hi_k)) - lo_k)
                    keys[i] = np.int32(np.int32(k << np.int32(16)) | np.int32(key & np.int32(0xFFFF)))
            if loops & 4:
                for i in range(ja, jb):
                    codes[i] = _code(keys, entries, i - ja)
            if loops & 8:
                for i in range(ja, jb):
                    r[i] = vs[i - ja] - vt[codes[i]]
            if loops & 16:
                for i0 in range(ja, jb, np.uint64(16)):
                    if prefetch:
                        prefetch_l2(g, i0 + np.uint64(AHEAD))
                        prefetch_l2(r, i0 + np.uint64(AHEAD))
                    for i in range(i0, min(i0 + np.uint64(16), jb)):
                        c = _code(keys, entries, i - ja)
                        codes[i] = c
                        r[i] = vs[i - ja] - vt[c]
            if loops & 32:
                for i in range(ja, jb):
                    c = _code(keys, entries, opaque(i - ja))
                    codes[i] = c
                    r[i] = vs[i - ja] - vt[c]


def parts():
    g, r0, s, vt, entries, base, _, _ = setup(1 << 14)
    variants = {"four loops (before)": 15, "v only": 1, "v + keys": 3, "v + codes": 5,
                "v + residuals": 9, "without residuals": 7,
                "codes and residuals in one loop": 19, "the same, scalar": 35}
    flags = np.zeros(1, np.uint8)
    ref_r, ref_c = r0.copy(), np.zeros(g.size, np.uint8)
    d.encode_vspace_cpu(g, ref_r, True, ref_c, vt, entries, base, flags)
    for name, m in variants.items():
        if m in (15, 19, 35):   # the whole encode: the package's bits
            r, c = r0.copy(), np.zeros(g.size, np.uint8)
            encode(g, r, c, vt, entries, base, m, False)
            assert np.array_equal(c, ref_c) and np.array_equal(r.view(np.int32), ref_r.view(np.int32))
    membw.set_threads(1)
    best = dict.fromkeys(variants, float("inf"))
    r, c = r0.copy(), np.zeros(g.size, np.uint8)
    for _ in range(5):
        for name, m in variants.items():
            r[:] = r0
            best[name] = min(best[name], membw.best_time(
                lambda: encode(g, r, c, vt, entries, base, m, False), 100))
    for name in variants:
        print(f"from cache, 1 thread: {name:32s} {best[name] / g.size * 1e9:.2f} ns/value")


def alternate(runs, rounds):
    """Each encode's bits against the first's, then rounds of each, with the triad between."""
    membw.set_threads(2)
    g, r0, s, vt, entries, base, _, _ = setup(2048 * 9304)
    flags = np.zeros(1, np.uint8)
    runs = {name: (lambda f: lambda r, c: f(g, r, c, vt, entries, base, flags))(f)
            for name, f in runs.items()}
    out = []
    for fn in runs.values():
        r, c = r0.copy(), np.zeros(g.size, np.uint8)
        fn(r, c)
        out.append((r.view(np.int32), c))
    print("same bits:", all(np.array_equal(a, b) for o in out[1:] for a, b in zip(out[0], o)))
    triad, nbytes = membw.triad_timer(200 << 20)
    total = dict.fromkeys(runs, 0.0)
    r, c = r0.copy(), np.zeros(g.size, np.uint8)
    for rnd in range(rounds):
        for name, fn in runs.items():
            tt = min(membw.best_time(triad, 1) for _ in range(3))
            t = membw.best_time(lambda: fn(r, c), 5)
            total[name] += t
            print(f"round {rnd} {name:16s} {t * 1e3:6.2f} ms, "
                  f"{13 * g.size / t / (nbytes / tt):4.0%} of the triad ({nbytes / tt / 1e9:.1f} GB/s)")
    print("sum over the rounds:", {k: f"{v * 1e3:.2f} ms" for k, v in total.items()})


def package(g, r, c, vt, entries, base, flags):
    d.encode_vspace_cpu(g, r, True, c, vt, entries, base, flags)


if __name__ == "__main__":
    if sys.argv[1:2] == ["ab"]:
        from old_module import load
        old = load(sys.argv[2], "dettmers_old")
        alternate({"old": lambda g, r, c, vt, entries, base, flags: old.encode_vspace_cpu(
            g, r, True, c, vt, entries, base, flags), "package": package},
            int(sys.argv[3]) if len(sys.argv) > 3 else 8)
    elif sys.argv[1:2] == ["prefetch"]:
        alternate({"package": package, "prefetch into L2": lambda g, r, c, vt, entries, base, flags:
                   encode(g, r, c, vt, entries, base, 19, True)},
                  int(sys.argv[2]) if len(sys.argv) > 2 else 8)
    else:
        parts()
