"""`hpcsgd plot RUN_DIR`: learning curves and throughput from RUN_DIR/metrics.jsonl to PNG.

Writes RUN_DIR/plots/learning_curves.png (train and cross-validation CE and frame accuracy
against frames seen) and RUN_DIR/plots/throughput.png (frames/s and learning rate). When the
run wrote a timeline (train.timeline), it also prints where the time went per rank and
category, draws RUN_DIR/plots/time_breakdown.png, and merges the ranks' traces into
RUN_DIR/timeline/all.json (one file to open in Perfetto).
"""
import glob
import json
import os

from hpcsgd import timeline
from hpcsgd.data.archive import atomic_write_text
from hpcsgd.errors import UserError


def read_metrics(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UserError(f"{run_dir}: no metrics.jsonl (not a run directory?)")
    records = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                records.append(json.loads(line))
            except ValueError:
                raise UserError(f"{path}:{lineno}: not a JSON line") from None
    return records


def add_arguments(parser):
    parser.add_argument("run_dir", help="a training run directory")


def run(args):
    import matplotlib
    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    records = read_metrics(args.run_dir)
    train = [r for r in records if r["kind"] == "train"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    if not train:
        raise UserError(f"{args.run_dir}: metrics.jsonl has no training records yet")
    out_dir = os.path.join(args.run_dir, "plots")
    os.makedirs(out_dir, exist_ok=True)
    frames = [r["frames"] for r in train]

    fig, (ax_ce, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    # a CTC or RNN-T model: the loss per token, token errors
    ctc = next((k[:-len("_per_token")] for k in ("ctc_per_token", "rnnt_per_token")
                if k in train[0]), None)
    if ctc:
        ax_ce.plot(frames, [r[f"{ctc}_per_token"] for r in train], label="train (running)")
    else:
        ax_ce.plot(frames, [r["ce"] for r in train], label="train (running)")
        ax_acc.plot(frames, [100 * r["frame_accuracy"] for r in train], label="train (running)")
    cv = [r for r in epochs if r.get("cv_ce") is not None]
    if cv and ctc:
        ax_ce.plot([r["frames"] for r in cv], [r[f"cv_{ctc}_per_token"] for r in cv], "o-",
                   label="cross-validation")
        ax_acc.plot([r["frames"] for r in cv], [100 * r["cv_token_error_rate"] for r in cv],
                    "o-", label="cross-validation (greedy)")
    elif cv:
        ax_ce.plot([r["frames"] for r in cv], [r["cv_ce"] for r in cv], "o-", label="cross-validation")
        ax_acc.plot([r["frames"] for r in cv], [100 * r["cv_frame_accuracy"] for r in cv], "o-",
                    label="cross-validation")
        if cv[-1].get("cv_majority") is not None:
            ax_acc.axhline(100 * cv[-1]["cv_majority"], color="grey", ls=":", label="majority class")
    changes = [r for r in records if r["kind"] == "bits"]
    if changes or any("bits" in r for r in train):   # adaptive bit width: the width beside the loss
        ax_bits = ax_ce.twinx()
        steps = [(r["frames"], r["bits"]) for r in train if "bits" in r] + \
                [(r["frames"], r["bits"]) for r in changes]
        steps.sort()
        if changes:   # the width before the first change, from frame 0
            steps.insert(0, (0, changes[0]["previous"]))
        ax_bits.step([f for f, _ in steps], [b for _, b in steps], where="post", color="tab:red",
                     alpha=0.6, label="bits")
        ax_bits.set(ylabel="gradient bits per value", ylim=(1.5, 8.5))
        ax_bits.legend(loc="center right")
    if ctc:
        name = ctc.upper()
        ax_ce.set(xlabel="frames", ylabel=f"{name} loss (nats/token)", title=f"{name} loss")
        ax_acc.set(xlabel="frames", ylabel="token error rate (%)", title="token error rate")
    else:
        ax_ce.set(xlabel="frames", ylabel="cross-entropy (nats/frame)", title="cross-entropy")
        ax_acc.set(xlabel="frames", ylabel="frame accuracy (%)", title="frame accuracy")
    for ax in (ax_ce, ax_acc):
        frames_axis(ax)
        ax.legend()
    fig.tight_layout()
    curves = os.path.join(out_dir, "learning_curves.png")
    fig.savefig(curves, dpi=100)
    plt.close(fig)

    fig, (ax_fps, ax_lr) = plt.subplots(1, 2, figsize=(11, 4))
    ax_fps.plot(frames, [r["frames_per_s"] for r in train])
    ax_fps.set(xlabel="frames", ylabel="frames/s (all ranks)", title="throughput")
    ax_lr.plot(frames, [r["lr"] for r in train])
    ax_lr.set(xlabel="frames", ylabel="learning rate per sample", title="learning rate")
    for ax in (ax_fps, ax_lr):
        frames_axis(ax)
    fig.tight_layout()
    throughput = os.path.join(out_dir, "throughput.png")
    fig.savefig(throughput, dpi=100)
    plt.close(fig)
    print(f"plot: wrote {curves} and {throughput}")
    skips = [r for r in records if r["kind"] == "skip"]
    if skips or any("loss_scale" in r for r in train):
        print(f"plot: wrote {loss_scale_plot(train, skips, out_dir, plt)}")
    if glob.glob(os.path.join(args.run_dir, "timeline", "rank*.json")):
        time_breakdown(args.run_dir, out_dir, plt)
    return 0


def loss_scale_plot(train, skips, out_dir, plt):
    """The loss scale over the run (log scale), from the log lines and every skip, with the
    steps skipped on an overflow marked and counted."""
    points = sorted([(r["frames"], r["loss_scale"]) for r in train if "loss_scale" in r]
                    + [(r["frames"], r["new_scale"]) for r in skips])
    if skips:   # the scale before the first skip, from frame 0
        points.insert(0, (0, skips[0]["scale"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.step([f for f, _ in points], [v for _, v in points], where="post", label="loss scale")
    if skips:
        ax.plot([r["frames"] for r in skips], [r["scale"] for r in skips], "x", color="tab:red",
                label=f"skipped step ({len(skips)})")
    ax.set(xlabel="frames", ylabel="loss scale", yscale="log", title="loss scaling")
    frames_axis(ax)
    ax.legend()
    fig.tight_layout()
    path = os.path.join(out_dir, "loss_scale.png")
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def frames_axis(ax):
    """Frames as 50k, 1.2M (six-digit tick labels ran into each other), at most 6 ticks."""
    from matplotlib.ticker import EngFormatter, MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(6))
    ax.xaxis.set_major_formatter(EngFormatter(sep=""))
    ax.grid(alpha=0.3)


def time_breakdown(run_dir, out_dir, plt):
    """Where the time goes, per rank, from the Chrome traces: a table, a stacked bar chart,
    and the traces merged into one file."""
    paths = sorted(glob.glob(os.path.join(run_dir, "timeline", "rank*.json")))
    events = {os.path.basename(p)[4:8]: timeline.read_events(p) for p in paths}
    rows = {rank: timeline.summarize(ev) for rank, ev in events.items()}
    used = [c for c in timeline.CATEGORIES if any(t[c] for t, _ in rows.values())]
    print("where the time goes (seconds, % of the traced wall time):")
    print("rank  " + "".join(f"{c:>18}" for c in used) + f"{'untraced':>18}")
    for rank, (totals, span) in rows.items():
        other = max(span - sum(totals.values()), 0.0)
        cells = [f"{totals[c]:9.3f} ({100 * totals[c] / max(span, 1e-12):4.1f}%)" for c in used]
        cells.append(f"{other:9.3f} ({100 * other / max(span, 1e-12):4.1f}%)")
        print(f"{int(rank):4d}  " + "".join(f"{c:>18}" for c in cells))
    fig, ax = plt.subplots(figsize=(9, 1.5 + 0.4 * len(rows)))
    left = [0.0] * len(rows)
    for c in used:
        widths = [t[c] for t, _ in rows.values()]
        ax.barh([f"rank {int(r)}" for r in rows], widths, left=left, label=c)
        left = [a + b for a, b in zip(left, widths)]
    ax.set(xlabel="seconds in the traced steps", title="where the time goes")
    ax.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    png = os.path.join(out_dir, "time_breakdown.png")
    fig.savefig(png, dpi=100)
    plt.close(fig)
    merged = os.path.join(run_dir, "timeline", "all.json")
    atomic_write_text(merged, json.dumps([e for ev in events.values() for e in ev]))
    print(f"plot: wrote {png} and {merged} (open it in https://ui.perfetto.dev)")
