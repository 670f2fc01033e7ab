"""kbit2 and onebit encodes of a 2048 x 9304 matrix, 25 in a row each, on 2 threads: the spread
of one kernel's time on this machine, in ms:
    python experiments/kbit_series.py
"""
import time

import numpy as np
from hpcsgd.bench import membw
import hpcsgd.codecs.kbit as K
import hpcsgd.codecs.onebit as O
membw.set_threads(2)
rng = np.random.default_rng(0)
g = (rng.standard_normal((2048, 9304)) * 1e-3).astype(np.float32)
r0 = (rng.standard_normal(g.shape) * 1e-5).astype(np.float32)
for name, c in (("kbit2", K.KBit(bits=2)), ("onebit", O.OneBit()), ("kbit2", K.KBit(bits=2))):
    out = np.zeros(c.packed_nbytes(*g.shape), np.uint8); r = r0.copy(); c.encode(g, r, out)
    ts = []
    for _ in range(25):
        t = time.perf_counter(); c.encode(g, r, out); ts.append((time.perf_counter() - t) * 1e3)
    print(name, " ".join(f"{x:.1f}" for x in ts))
