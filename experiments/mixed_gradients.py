"""How far mixed precision's gradient is from float32's, per parameter, at given loss scales:
the investigation behind experiments/conformer_so762.md's "why mixed precision did not train".

    python experiments/mixed_gradients.py --config jobs/configs/so762_conformer_ctc.yaml \
        [--weights RUN_OR_CHECKPOINT] [--step 3] [--scales 0.25,1,4,32,1024]

Takes the minibatch of training step --step as `hpcsgd train` deals it (one rank, the
config's seed: the run is started in-process and stopped at that step's forward-backward),
the weights of --weights (default: the initial ones), and computes the summed loss's gradient
once in float32 and once per scale with train.precision=mixed (float16 stores, the GEMMs'
float16 outputs, then Network.unscale). Per scale: the non-finite values (an overflow: the
step would be skipped), the relative L2 error of the whole gradient and of the worst
parameters, and the share of each parameter's values that float16 flushed to zero.
"""
import argparse
import os
import sys
import tempfile

import numpy as np

from hpcsgd import checkpoint
from hpcsgd.model import build, network


class Captured(Exception):
    """Stops the run at the step (the trainer reports it as a failure; the batch is kept)."""


def capture(config, step):
    """The arguments of the step-th forward_backward of a 1-rank training run of `config`."""
    from hpcsgd.cli import main
    seen, real = [], network.Network.forward_backward

    def grab(self, params, grads, x, y, n, *args, **kwargs):
        seen.append({"describe": self.describe, "max_batch": self.max_batch,
                     "max_sequences": self.max_sequences, "x": np.array(x[:n]), "y": y,
                     "n": n, "params": np.array(params.flat)})
        if len(seen) == step:
            raise Captured(f"stopped at step {step}")
        return real(self, params, grads, x, y, n, *args, **kwargs)
    network.Network.forward_backward = grab
    try:
        with tempfile.TemporaryDirectory() as run:
            main(["train", "--config", config, f"train.run_dir={run}", "train.precision=float32",
                  "train.log_every_seconds=0"])
    finally:
        network.Network.forward_backward = real
    if len(seen) < step:
        sys.exit(f"{config}: the run ended before step {step}")
    return seen[step - 1]


def gradient(batch, weights, precision, scale):
    net = build(batch["describe"], max_batch=batch["max_batch"], precision=precision,
                max_sequences=batch["max_sequences"])
    params, grads = net.new_params(), net.new_params()
    params.flat[:] = weights
    extra = {} if precision == "float32" else {"loss_scale": scale}
    net.forward_backward(params, grads, batch["x"], batch["y"], batch["n"], **extra)
    bad = net.unscale(grads, scale)[0] if precision != "float32" else 0
    return grads, bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--weights", help="a run directory or checkpoint (default: the init)")
    ap.add_argument("--step", type=int, default=3)
    ap.add_argument("--scales", default="0.25,1,4,32,1024")
    args = ap.parse_args()
    batch = capture(args.config, args.step)
    weights = batch["params"]
    if args.weights:
        path = checkpoint.latest(args.weights) if os.path.isdir(args.weights) else args.weights
        weights = checkpoint.load(path, names=("params",))[0]["params"]
    ref, _ = gradient(batch, weights, "float32", 1.0)
    print(f"step {args.step}: {batch['n']} rows, weights {args.weights or 'init'}")
    for scale in (float(s) for s in args.scales.split(",")):
        g, bad = gradient(batch, weights, "mixed", scale)
        rows, zeroed = [], []
        for name, want in ref.views.items():
            a, b = np.asarray(want, np.float64), np.asarray(g.views[name], np.float64)
            err = (np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-30)
                   if np.isfinite(b).all() else np.inf)
            rows.append((err, name))
            zeroed.append((float(((b == 0) & (a != 0)).mean()), name))
        finite = np.isfinite(g.flat)
        total = np.linalg.norm((g.flat - ref.flat)[finite]) / np.linalg.norm(ref.flat[finite])
        print(f"scale {scale:g}: {bad} non-finite; whole gradient {total:.2e}; worst "
              + ", ".join(f"{n} {e:.2e}" for e, n in sorted(rows, reverse=True)[:5])
              + "; flushed to 0: "
              + ", ".join(f"{n} {z:.0%}" for z, n in sorted(zeroed, reverse=True)[:3]))


if __name__ == "__main__":
    main()
