"""The Dettmers CPU encode before and after a change, alternated in one process over the 46M
model's largest matrix (2048 x 9304) on 2 threads, with the triad measured between them. The
old module is a file of its own, e.g. the encode before the three-loop split:
    git show 549509d:hpcsgd/codecs/dettmers.py > /tmp/dettmers_old.py
    python experiments/dettmers_ab.py /tmp/dettmers_old.py [rounds] [/tmp/dettmers_new.py]
(the third argument times a second file in place of the package's module; give such runs a
fresh NUMBA_CACHE_DIR).
Codes and residuals must be bit-identical (printed first).
"""
import sys

import numpy as np
from old_module import load
from hpcsgd.bench import membw
import hpcsgd.codecs.dettmers as new
old = load(sys.argv[1], "dettmers_old")
if len(sys.argv) > 3: new = load(sys.argv[3], "dettmers_new")
membw.set_threads(2)
g = np.random.default_rng(0).standard_normal(2048 * 9304).astype(np.float32) * 1e-3
r0 = np.random.default_rng(1).standard_normal(g.size).astype(np.float32) * 1e-5
s = np.float32(np.abs(g + r0).max())
runs = {}
for name, d in (("old", old), ("new", new)):
    table = d.make_table("dynamic_tree"); b = d.code_buckets(d.midpoints(table))
    scales, flags = np.array([s], np.float32), np.zeros(1, np.uint8)
    r, codes = r0.copy(), np.zeros(g.size, np.uint8)
    d.encode_cpu(g, r, True, codes, scales, g.size, table, *b, flags)
    runs[name] = (lambda d, r, codes, table, b, scales, flags: lambda: d.encode_cpu(g, r, True, codes, scales, g.size, table, *b, flags))(d, r, codes, table, b, scales, flags)
    runs[name + "_out"] = (codes, r)
print("same codes and residuals:", np.array_equal(runs["old_out"][0], runs["new_out"][0]), np.array_equal(runs["old_out"][1].view(np.int32), runs["new_out"][1].view(np.int32)))
triad, nbytes = membw.triad_timer(200 << 20)
best = {"old": [], "new": [], "triad": []}
for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 5):
    for name in ("old", "new"):
        t = tt = float("inf")
        for _ in range(5):
            tt = min(tt, membw.best_time(triad, 1)); t = min(t, membw.best_time(runs[name], 1))
        best[name].append(t); best["triad"].append(nbytes / tt)
        print(f"round {rnd} {name} {t*1e3:6.2f} ms {13*g.size/t/(nbytes/tt):4.0%} of triad ({nbytes/tt/1e9:.1f} GB/s)")
for name in ("old", "new"):
    t = min(best[name]); print(f"best {name} {t*1e3:.2f} ms, {13*g.size/t/max(best['triad']):.0%} of the best triad {max(best['triad'])/1e9:.1f} GB/s")
