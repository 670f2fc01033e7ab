"""Adam's moments at the end of two runs of one model, weight by weight: how much larger the
second moment (and the first) of a 1-bit run is than a float32 run's (docs/results.md, "CTC
models on so762": what the 1-bit runs lose).

    python experiments/adam_moments.py runs/ctc/seed1_f32 runs/ctc/seed1_onebit_cold10

Reads each run's latest checkpoint (hpcsgd.checkpoint): Adam's state is opt/sqr and
opt/velocity, or per rank (rank*/opt/...: the striped exchange's owners, each its stripe) laid
back end to end. Prints the ratio sqrt(v_b / v_a) over the weights where both are non-zero
(median, mean, 10th and 90th percentiles), the RMS of each run's first moment and the median
of |m| / sqrt(v), the size of an Adam step before the learning rate.
"""
import sys

import numpy as np

from hpcsgd import checkpoint


def moments(run):
    arrays = checkpoint.load(checkpoint.latest(run))[0]

    def state(name):
        if f"opt/{name}" in arrays:
            return arrays[f"opt/{name}"]
        ranks = sorted(k for k in arrays if k.startswith("rank") and k.endswith(f"/opt/{name}"))
        return np.concatenate([arrays[k] for k in ranks])
    return state("velocity").astype(np.float64), state("sqr").astype(np.float64)


def main(a, b):
    (m_a, v_a), (m_b, v_b) = moments(a), moments(b)
    both = (v_a > 0) & (v_b > 0)
    ratio = np.sqrt(v_b[both] / v_a[both])
    p10, p90 = np.percentile(ratio, [10, 90])
    print(f"sqrt(v {b} / v {a}) over {both.sum():,} weights: median {np.median(ratio):.2f}, "
          f"mean {ratio.mean():.2f}, 10th {p10:.2f}, 90th {p90:.2f}")
    for run, m, v in ((a, m_a, v_a), (b, m_b, v_b)):
        step = np.abs(m[both]) / np.sqrt(v[both])
        print(f"{run}: first moment RMS {np.sqrt(np.mean(m ** 2)):.3g}, "
              f"median |m| / sqrt(v) {np.median(step):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
