"""The kbit encode's compute per value, with memory out of the way: 64 columns of 2048 rows
(1 MB, cache-resident), one thread, the old module file and the package's alternated, best
of 20 x 50 encodes. Memory-bound figures on this shared VM drift by 30% within the hour;
this one holds to 1-2%.
    git show 0b0f9fe:hpcsgd/codecs/kbit.py > /tmp/kbit_old.py
    python experiments/kbit_compute_ab.py /tmp/kbit_old.py 2,4,8
"""
import sys
import time

import numba
import numpy as np
from old_module import load
import hpcsgd.codecs.kbit as new
old = load(sys.argv[1], "kbit_old")
numba.set_num_threads(1)
rng = np.random.default_rng(0)
g = (rng.standard_normal((64, 2048)) * 1e-3).astype(np.float32)
r0 = (rng.standard_normal(g.shape) * 1e-5).astype(np.float32)
for k in [int(x) for x in sys.argv[2].split(",")]:
    res = {}
    for name, mod in (("old", old), ("new", new)):
        c = mod.KBit(bits=k); out = np.zeros(c.packed_nbytes(*g.shape), np.uint8); r = r0.copy()
        c.encode(g, r, out); res[name] = (c, out, r)
    for rnd in range(3):
        line = []
        for name in ("old", "new"):
            c, out, r = res[name]
            best = 1e9
            for _ in range(20):
                t = time.perf_counter()
                for _ in range(50): c.encode(g, r, out)
                best = min(best, (time.perf_counter() - t) / 50)
            line.append(f"{name} {best / g.size * 1e9:.3f} ns/value")
        print(f"kbit{k}", *line)
