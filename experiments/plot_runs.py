"""Learning curves of several runs in one figure: CV frame accuracy per epoch (left) and the
training cross-entropy of the log windows (right), against training frames.
    python experiments/plot_runs.py OUT.png RUN_DIR [RUN_DIR ...]"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out, runs = sys.argv[1], sys.argv[2:]
fig, (acc_ax, ce_ax) = plt.subplots(1, 2, figsize=(11, 4))
for run in runs:
    records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    epochs = [r for r in records if r["kind"] == "epoch"]
    train = [r for r in records if r["kind"] == "train"]
    name = os.path.basename(os.path.normpath(run))
    acc_ax.plot([r["frames"] / 1e6 for r in epochs],
                [100 * r["cv_frame_accuracy"] for r in epochs], marker="o", label=name)
    if len(train) >= len(epochs):   # the log windows; else (sparse logging) each epoch's
        ce_ax.plot([r["frames"] / 1e6 for r in train], [r["ce"] for r in train], label=name)
    else:
        ce_ax.plot([r["frames"] / 1e6 for r in epochs], [r["train_ce"] for r in epochs],
                   marker="o", label=name)
acc_ax.set(xlabel="training frames (millions)", ylabel="CV frame accuracy (%)",
           title="held-out speakers")
ce_ax.set(xlabel="training frames (millions)", ylabel="train CE (nats/frame)",
          title="training cross-entropy")
for ax in (acc_ax, ce_ax):
    ax.grid(alpha=0.3)
    ax.legend()
fig.tight_layout()
fig.savefig(out, dpi=110)
print(f"wrote {out}")
