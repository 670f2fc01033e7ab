"""kbit encode and decode-accumulate before and after a change, on a matrix of the 46M
model's largest size as 9304 columns of 2048 rows (19.1M values; the bench's 2048 x 9304 layer
has 2048 columns of 9304 rows), 2 threads, the old module file and the
package's alternated, each beside a triad timed with it. Prints whether the encodes' bytes
and residuals match.
    git show 0b0f9fe:hpcsgd/codecs/kbit.py > /tmp/kbit_old.py
    python experiments/kbit_ab.py /tmp/kbit_old.py 2,4,8
"""
import sys

import numpy as np
from old_module import load
from hpcsgd.bench import membw
import hpcsgd.codecs.kbit as new
old = load(sys.argv[1], "kbit_old")
membw.set_threads(2)
rng = np.random.default_rng(0)
g = (rng.standard_normal((9304, 2048)) * 1e-3).astype(np.float32)
r0 = (rng.standard_normal(g.shape) * 1e-5).astype(np.float32)
triad, nbytes = membw.triad_timer(200 << 20)
for k in [int(x) for x in sys.argv[2].split(",")]:
    res = {}
    for name, mod in (("old", old), ("new", new)):
        c = mod.KBit(bits=k)
        out = np.zeros(c.packed_nbytes(*g.shape), np.uint8)
        r = r0.copy(); c.encode(g, r, out)
        acc = np.zeros_like(g); c.decode_accumulate(out, acc)
        res[name] = (c, out, r, acc)
    print(f"kbit{k} same bytes:", np.array_equal(res["old"][1], res["new"][1]), "same r:", np.array_equal(res["old"][2], res["new"][2]))
    for rnd in range(3):
        for name in ("old", "new"):
            c, out, r, acc = res[name]
            t = td = tt = float("inf")
            for _ in range(5):
                tt = min(tt, membw.best_time(triad, 1))
                t = min(t, membw.best_time(lambda: c.encode(g, r, out), 1))
                td = min(td, membw.best_time(lambda: c.decode_accumulate(out, acc), 1))
            bw = nbytes / tt
            print(f"kbit{k} {name} enc {t*1e3:6.2f} ms {(12*g.size + out.size)/t/bw:4.0%}  dacc {td*1e3:6.2f} ms {(8*g.size + out.size)/td/bw:4.0%}  triad {bw/1e9:.1f}")
