"""Adam's moments at the end of two runs of one model, weight by weight: how much larger the
second moment (and the first) of a 1-bit run is than a float32 run's (experiments/ctc_so762.md,
"1-bit SGD": what the 1-bit runs lose).

    python experiments/adam_moments.py runs/ctc/seed1_f32 runs/ctc/seed1_onebit_cold10

Reads each run's latest checkpoint (hpcsgd.checkpoint): Adam's state is opt/sqr and
opt/velocity (replicated: the allreduce), or per rank (rank*/opt/...): the striped exchange's
owners, each its compact stripe of every matrix, laid back into the model's flat order
(hpcsgd.comm.stripes.unstripe) -- or, for optim.adam_variance=local, a whole second moment
per rank (their mean; the per-rank ones are the variance of N/K frames' gradient). Prints the
ratio sqrt(v_b / v_a) over the weights where both are non-zero (median, mean, 10th and 90th
percentiles) and the ratio of the two runs' median sqrt(v) (which needs no pairing), the RMS
of each run's first moment and the median of |m| / sqrt(v), the size of an Adam step before
the learning rate (|m| itself for a local second moment, which divided before m).

Before 2026-11-28 the per-rank stripes were concatenated rank after rank, not laid back: a
striped run's weights were then paired with other weights of an allreduce run, which
widened the ratio's spread (its mean and percentiles) though not the runs' own statistics.
"""
import sys

import numpy as np

from hpcsgd import checkpoint
from hpcsgd.comm.stripes import unstripe
from hpcsgd.model import build


def moments(run):
    """(first moment, second moment) of a run's latest checkpoint, float64, in flat order."""
    path = checkpoint.latest(run)
    arrays, meta = checkpoint.load(path)
    size = arrays["params"].size

    def state(name):
        if f"opt/{name}" in arrays:
            return arrays[f"opt/{name}"]
        parts = [arrays[checkpoint.rank_prefix(r) + f"opt/{name}"] for r in range(meta["world"])]
        if parts[0].size == size:   # a whole state per rank: Adam's local second moment
            return np.mean(parts, axis=0)
        matrices = build(meta["model"]).new_params().matrices
        return unstripe(parts, matrices, meta["world"], out=np.zeros(size, parts[0].dtype))
    local = meta["config"].get("optim.adam_variance") == "local"
    return state("velocity").astype(np.float64), state("sqr").astype(np.float64), local


def main(a, b):
    (m_a, v_a, local_a), (m_b, v_b, local_b) = moments(a), moments(b)
    both = (v_a > 0) & (v_b > 0)
    ratio = np.sqrt(v_b[both] / v_a[both])
    p10, p90 = np.percentile(ratio, [10, 90])
    medians = np.sqrt(np.median(v_b[both]) / np.median(v_a[both]))
    print(f"sqrt(v {b} / v {a}) over {both.sum():,} weights: median {np.median(ratio):.2f}, "
          f"mean {ratio.mean():.2f}, 10th {p10:.2f}, 90th {p90:.2f}; ratio of the medians "
          f"{medians:.2f}")
    for run, m, v, local in ((a, m_a, v_a, local_a), (b, m_b, v_b, local_b)):
        # a local second moment divided the gradients before m: the step is |m| itself
        step = np.abs(m[both]) / (1.0 if local else np.sqrt(v[both]))
        print(f"{run}: first moment RMS {np.sqrt(np.mean(m ** 2)):.3g}, "
              f"median |m| / sqrt(v) {np.median(step):.3f}" + (" (|m|: v local)" if local else ""))


if __name__ == "__main__":
    main(*sys.argv[1:3])
