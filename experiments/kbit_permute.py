"""kbit codes for k <= 4 without float64: a float32 estimate of t = (v - lower) / step, off by
at most one, corrected by the column's exact thresholds (`kbit._threshold`), with the 16-entry
tables (thresholds below and above, decoded values) read by two AVX2 `vpermps` each. Tried on
Zen 3 on 2026-11-26 (docs/benchmarks.md, "The session of 2026-11-26 from 06:01 UTC"): the
same codes and residuals as the package's float64 rule, at most about 14% faster and not in
every run, and only on AVX2: not landed.

    python experiments/kbit_permute.py     # needs AVX2

Prints the bit-identity for k = 2, 3, 4 on random columns (and columns with values on the
bucket edges), then one thread's time per value from cache: the whole column (its min/max
pass included), the min/max pass alone and with the tables, and each code loop alone.
"""
import time

import numba
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.extending import intrinsic
import hpcsgd.codecs.kbit as kb

V8F, V8I = ir.VectorType(ir.FloatType(), 8), ir.VectorType(ir.IntType(32), 8)


@intrinsic
def _step8(typingctx, gc, rc, code8, tlo, thi, dv, lower, inv, maxq, i):
    def codegen(context, builder, sig, args):
        def ptr(k, idx=None, vty=V8F):
            data = context.make_array(sig.args[k])(context, builder, args[k]).data
            p = data if idx is None else builder.gep(data, [idx])
            return builder.bitcast(p, vty.as_pointer())
        perm = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V8F, [V8F, V8I]),
                                              "llvm.x86.avx2.permps")
        i_ = args[9]
        def splat(x, vty=V8F):
            u = ir.Constant(vty, ir.Undefined)
            v = builder.insert_element(u, x, ir.Constant(ir.IntType(32), 0))
            return builder.shuffle_vector(v, u, ir.Constant(V8I, [0] * 8))
        def table(k):
            lo = builder.load(ptr(k), align=4)
            hi = builder.load(ptr(k, ir.Constant(ir.IntType(64), 8)), align=4)
            return lo, hi
        def lookup(tab, q):
            a = builder.call(perm, [tab[0], q])
            b = builder.call(perm, [tab[1], q])
            return builder.select(builder.icmp_signed(">", q, ir.Constant(V8I, [7] * 8)), b, a)
        g8 = builder.load(ptr(0, i_), align=4)
        r8 = builder.load(ptr(1, i_), align=4)
        v = builder.fadd(g8, r8)
        t = builder.fmul(builder.fsub(v, splat(args[6])), splat(args[7]))
        zero = ir.Constant(V8F, [0.0] * 8)
        t = builder.select(builder.fcmp_ordered(">", t, zero), t, zero)
        mq = splat(args[8])
        t = builder.select(builder.fcmp_ordered("<", t, mq), t, mq)
        qa = builder.fptosi(t, V8I)
        up = builder.zext(builder.fcmp_ordered(">=", v, lookup(table(4), qa)), V8I)
        dn = builder.zext(builder.fcmp_unordered("<", v, lookup(table(3), qa)), V8I)
        q = builder.sub(builder.add(qa, up), dn)
        val = lookup(table(5), q)
        builder.store(builder.fsub(v, val), ptr(1, i_), align=4)
        v8b = ir.VectorType(ir.IntType(8), 8)
        builder.store(builder.trunc(q, v8b), ptr(2, i_, v8b), align=1)
        return context.get_dummy_value()
    return types.void(gc, rc, code8, tlo, thi, dv, types.float32, types.float32, types.float32,
                      types.intp), codegen


@njit
def tables(lower, step, inv, k, tlo, thi, dv):
    """The column's thresholds below (tlo[q] = T_q) and above (thi[q] = T_q+1) each code,
    -inf and +inf at the ends, and its decoded values."""
    L = 1 << k
    tlo[0] = -np.inf
    for j in range(1, 16):
        tlo[j] = kb._threshold(j, lower, step, inv) if j < L else np.inf
    for j in range(16):
        thi[j] = tlo[j + 1] if j + 1 < L else np.inf
        dv[j] = kb._value_cpu(min(j, L - 1), lower, step)


@njit
def columns(G, R, CODES, k, reps, rule, each_column):
    """Every column's codes and residuals by `rule` (0: this file's, 1: the package's float64
    `_quantize`), reps times; each_column False takes the first column's range for all (the
    code loop alone, the codes then wrong for the others: only the times count)."""
    n_cols, n = G.shape
    tlo, thi, dv = np.empty(16, np.float32), np.empty(16, np.float32), np.empty(16, np.float32)
    lower, upper, finite = kb._column_minmax(G[0], R[0])
    for _ in range(reps):
        for c in range(n_cols):
            gc, rc = G[c], R[c]
            if each_column:
                lower, upper, finite = kb._column_minmax(gc, rc)
            step = kb._step_cpu(lower, upper, 1 << k)
            inv = kb._inv_cpu(step)
            if rule == 0:
                if each_column or c == 0:
                    tables(lower, step, inv, k, tlo, thi, dv)
                for i in range(0, n // 8 * 8, 8):
                    _step8(gc, rc, CODES[c], tlo, thi, dv, lower, np.float32(inv),
                           np.float32((1 << k) - 1), i)
            else:
                for i in range(n):
                    v = gc[i] + rc[i]
                    q, value = kb._quantize(v, lower, inv, np.float64((1 << k) - 1), step)
                    rc[i] = v - value
                    CODES[c, i] = np.uint8(q)


@njit
def ranges(G, R, k, reps, with_tables):
    """The columns' min/max pass alone, or with the tables."""
    tlo, thi, dv = np.empty(16, np.float32), np.empty(16, np.float32), np.empty(16, np.float32)
    s = 0.0
    for _ in range(reps):
        for c in range(G.shape[0]):
            lower, upper, finite = kb._column_minmax(G[c], R[c])
            if with_tables:
                step = kb._step_cpu(lower, upper, 1 << k)
                tables(lower, step, kb._inv_cpu(step), k, tlo, thi, dv)
            s += lower
    return s


def best_ns(f, args, values, reps=200):
    best = 1e9
    for _ in range(7):
        t = time.perf_counter()
        f(*args)
        best = min(best, time.perf_counter() - t)
    return best / reps / values * 1e9


if __name__ == "__main__":
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    for k in (2, 3, 4):
        for trial in range(3):
            G = (rng.standard_normal((64, 2048)) * 10.0 ** rng.uniform(-8, 3)).astype(np.float32)
            R = (rng.standard_normal(G.shape) * 1e-2 * np.abs(G).max()).astype(np.float32)
            if trial == 2:   # many values on the bucket edges
                lo, hi = G.min(axis=1), G.max(axis=1)
                G[:, ::3] = lo[:, None] + (hi - lo)[:, None] * rng.integers(
                    0, 17, (64, (2048 + 2) // 3)) / 16
                R[:] = 0
            out = []
            for rule in (1, 0):
                r, c = R.copy(), np.zeros(G.shape, np.uint8)
                columns(G, r, c, k, 1, rule, True)
                out.append((r.view(np.int32), c))
            print(f"k{k} columns {trial}: the same codes and residuals:",
                  all(np.array_equal(a, b) for a, b in zip(*out)))
    G = (rng.standard_normal((16, 2048)) * 1e-3).astype(np.float32)
    R = (rng.standard_normal(G.shape) * 1e-5).astype(np.float32)
    C = np.zeros(G.shape, np.uint8)
    for k in (2, 4):
        for _ in range(2):
            for name, rule in (("float64", 1), ("permute", 0)):
                columns(G, R, C, k, 1, rule, True)
                print(f"k{k} {name}, with the min/max pass: "
                      f"{best_ns(columns, (G, R, C, k, 200, rule, True), G.size):.3f} ns/value")
    k = 4
    ranges(G, R, k, 1, True)
    print(f"k4 the min/max pass alone: {best_ns(ranges, (G, R, k, 200, False), G.size):.3f}, "
          f"with the tables: {best_ns(ranges, (G, R, k, 200, True), G.size):.3f} ns/value")
    for _ in range(2):
        for name, rule in (("float64", 1), ("permute", 0)):
            columns(G, R, C, k, 1, rule, False)
            print(f"k4 {name}, the code loop alone: "
                  f"{best_ns(columns, (G, R, C, k, 200, rule, False), G.size):.3f} ns/value")
