"""The Dettmers encode through the codec (Dettmers.encode: the scale pass, then whichever
encode the codec picks) before and after a change, alternated in one process over the 46M
model's largest matrix (2048 x 9304) on 2 threads, with the triad measured between them:
    git show 1ad28b3:hpcsgd/codecs/dettmers.py > /tmp/dettmers_old.py
    python experiments/dettmers_codec_ab.py /tmp/dettmers_old.py [rounds] [refresh]
refresh 50 reuses the scale, as the paper does (the time is then mostly the codes). Packed
bytes and residuals must be bit-identical (printed first).
"""
import sys

import numpy as np
from old_module import load
from hpcsgd.bench import membw
import hpcsgd.codecs.dettmers as new
old = load(sys.argv[1], "dettmers_old")
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 4
refresh = int(sys.argv[3]) if len(sys.argv) > 3 else 1
membw.set_threads(2)
g = (np.random.default_rng(0).standard_normal((2048, 9304)) * 1e-3).astype(np.float32)
r0 = (np.random.default_rng(1).standard_normal(g.shape) * 1e-5).astype(np.float32)
runs, outs = {}, {}
for name, d in (("old", old), ("new", new)):
    codec = d.Dettmers(refresh=refresh)
    r, buf = r0.copy(), np.zeros(codec.packed_nbytes(*g.shape), np.uint8)
    codec.encode(g, r, buf)
    outs[name] = (buf.copy(), r.copy())
    runs[name] = (lambda codec, r, buf: lambda: codec.encode(g, r, buf))(codec, r, buf)
print("same bytes and residuals:", outs["old"][0].tobytes() == outs["new"][0].tobytes(),
      np.array_equal(outs["old"][1].view(np.int32), outs["new"][1].view(np.int32)))
triad, nbytes = membw.triad_timer(200 << 20)
best = {"old": [], "new": [], "triad": []}
for rnd in range(rounds):
    for name in ("old", "new"):
        t = tt = float("inf")
        for _ in range(5):
            tt = min(tt, membw.best_time(triad, 1))
            t = min(t, membw.best_time(runs[name], 1))
        best[name].append(t)
        best["triad"].append(nbytes / tt)
        print(f"round {rnd} {name} {t * 1e3:6.2f} ms {13 * g.size / t / (nbytes / tt):4.0%} of "
              f"triad ({nbytes / tt / 1e9:.1f} GB/s)")
for name in ("old", "new"):
    t = min(best[name])
    print(f"best {name} {t * 1e3:.2f} ms, {13 * g.size / t / max(best['triad']):.0%} of the best "
          f"triad {max(best['triad']) / 1e9:.1f} GB/s")
