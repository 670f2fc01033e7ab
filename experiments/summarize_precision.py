"""The mixed-precision experiment's table and figure from ROOT/*/metrics.jsonl
(experiments/precision_so762.sh): per run, held-out CV frame accuracy and CE after each epoch,
the last epoch's training CE, seconds per epoch (CV excluded), the steps skipped on an overflow
and the loss scale at the end; its difference in CV accuracy from the float32 run; a figure of
the loss scale over the frames of every scaled run.
    python experiments/summarize_precision.py [ROOT] [--plot OUT.png]   (default runs/precision)"""
import json
import os
import sys


def load(root):
    runs = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "metrics.jsonl")
        if os.path.isfile(path):
            records = [json.loads(line) for line in open(path)]
            runs[name] = {kind: [r for r in records if r["kind"] == kind]
                          for kind in ("train", "epoch", "skip")}
    return runs


def scale_curve(run):
    """[(frames, scale)]: the first scale, every skip's new scale and every log line's."""
    points = [(r["frames"], r["loss_scale"]) for r in run["train"] if "loss_scale" in r]
    points += [(r["frames"], r["new_scale"]) for r in run["skip"]]
    if run["skip"]:
        points.append((0, run["skip"][0]["scale"]))
    return sorted(points)


def main():
    args = sys.argv[1:]
    plot = None
    if "--plot" in args:
        i = args.index("--plot")
        plot = args[i + 1]
        args = args[:i] + args[i + 2:]
    root = args[0] if args else "runs/precision"
    runs = load(root)
    base = runs.get("float32", {}).get("epoch", [])
    print("| run | CV acc per epoch (%) | Δ vs float32 (points) | CV CE | train CE | s/epoch "
          "| skipped steps | final scale |")
    print("|---|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        ep = run["epoch"]
        if not ep:
            continue
        accs = " / ".join(f"{100 * e['cv_frame_accuracy']:.2f}" for e in ep)
        delta = (f"{100 * (ep[-1]['cv_frame_accuracy'] - base[len(ep) - 1]['cv_frame_accuracy']):+.3f}"
                 if len(base) >= len(ep) else "")
        scale = [r["loss_scale"] for r in run["train"] if "loss_scale" in r]
        secs = sum(e["seconds"] for e in ep) / len(ep)
        print(f"| {name} | {accs} | {delta} | {ep[-1]['cv_ce']:.4f} | {ep[-1]['train_ce']:.4f} "
              f"| {secs:.1f} | {len(run['skip'])} | {scale[-1] if scale else '':g} |"
              if scale else
              f"| {name} | {accs} | {delta} | {ep[-1]['cv_ce']:.4f} | {ep[-1]['train_ce']:.4f} "
              f"| {secs:.1f} | {len(run['skip'])} | |")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, run in runs.items():
            curve = scale_curve(run)
            if curve:
                ax.step([f for f, _ in curve], [s for _, s in curve], where="post",
                        label=f"{name} ({len(run['skip'])} skipped)")
        ax.set(xlabel="frames", ylabel="loss scale", yscale="log",
               title="loss scale on so762, mixed precision")
        ax.legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
        print(f"wrote {plot}")


if __name__ == "__main__":
    main()
