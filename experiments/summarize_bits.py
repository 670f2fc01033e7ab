"""The MQGrad experiment's table and figure from ROOT/*/metrics.jsonl (experiments/bits_so762.sh):
per run, held-out CV frame accuracy and CE, the last training CE, training seconds (all epochs,
CV excluded), frames/s, the frame-weighted mean bits and the widths chosen, and the seconds
since the start and the frames each run took to first reach the training CE the fixed 4-bit run
(of the same error-feedback setting) had halfway through its frames (the paper's "MQGrad
reaches the fixed-4 loss sooner"); a figure of training CE against wall time and against
frames.
    python experiments/summarize_bits.py [ROOT] [--plot OUT.png]      (default runs/bits)"""
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
                          for kind in ("start", "train", "epoch", "bits")}
    return runs


def widths(run, name):
    """[(frames, bits)] from the start: fixed runs have one width, adaptive ones their changes."""
    if name.startswith("onebit"):
        return [(0, 1)]
    cfg = run["start"][0]["config"]
    b = cfg["exchange.bits"]
    if isinstance(b, int):
        return [(0, b)]
    out = [(0, cfg["exchange.bits_start"])]
    out += [(r["frames"], r["bits"]) for r in run["bits"]]
    return out


def mean_bits(steps, total):
    acc = 0.0
    for (f0, b), (f1, _) in zip(steps, steps[1:] + [(total, None)]):
        acc += b * (min(f1, total) - f0)
    return acc / max(total, 1)


def first_reach(train, target):
    for r in train:
        if r["ce"] <= target:
            return r["time"], r["frames"]
    return None, None


def main():
    args = sys.argv[1:]
    plot = None
    if "--plot" in args:
        i = args.index("--plot")
        plot = args[i + 1]
        args = args[:i] + args[i + 2:]
    root = args[0] if args else "runs/bits"
    runs = load(root)
    ref = {tag: runs.get(f"kbit4_{tag}") for tag in ("ef", "noef")}
    print("| run | CV acc | CV CE | last train CE | train s | frames/s | mean bits | widths "
          "(at k frames) | reach fixed-4 CE: s / k frames |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, run in runs.items():
        if not run["epoch"]:
            print(f"| {name} | (no epoch finished) |")
            continue
        e = run["epoch"][-1]
        steps = widths(run, name)
        tag = name.rsplit("_", 1)[1]
        target = None
        if ref.get(tag) and ref[tag]["train"]:   # fixed 4 bits' CE halfway through its frames
            half = ref[tag]["train"][-1]["frames"] / 2
            target = min(ref[tag]["train"], key=lambda r: abs(r["frames"] - half))["ce"]
        t, f = first_reach(run["train"], target) if target else (None, None)
        reach = f"{t:.0f} / {f / 1e3:.0f}" if t is not None else "not reached"
        changes = " ".join(f"{b}@{fr / 1e3:.0f}" for fr, b in steps)
        if len(steps) > 8:   # a rule that goes up and down: how often, between which widths
            bits = [b for _, b in steps]
            changes = (f"{len(steps) - 1} changes within {min(bits)}..{max(bits)}, "
                       f"{bits[-1]} at the end")
        seconds = sum(r["seconds"] for r in run["epoch"])
        print(f"| {name} | {100 * e['cv_frame_accuracy']:.2f}% | {e['cv_ce']:.3f} | "
              f"{run['train'][-1]['ce']:.3f} | {seconds:.0f} | "
              f"{e['frames'] / seconds:,.0f} | {mean_bits(steps, e['frames']):.2f} | "
              f"{changes} | {reach} |")
    if plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(2, 2, figsize=(12, 8))
        for row, tag in enumerate(("ef", "noef")):
            for name, run in runs.items():
                if not name.endswith("_" + tag) or not run["train"]:
                    continue
                label = name[:-len(tag) - 1]
                axes[row, 0].plot([r["time"] for r in run["train"]], [r["ce"] for r in run["train"]],
                                  label=label)
                axes[row, 1].plot([r["frames"] for r in run["train"]], [r["ce"] for r in run["train"]],
                                  label=label)
            feedback = "with" if tag == "ef" else "without"
            axes[row, 0].set(xlabel="wall seconds", ylabel="train CE (nats/frame)",
                             title=f"{feedback} error feedback: CE against time")
            axes[row, 1].set(xlabel="frames", ylabel="train CE (nats/frame)",
                             title=f"{feedback} error feedback: CE against frames")
            for ax in axes[row]:
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(plot, dpi=90)
        print(f"wrote {plot}")


if __name__ == "__main__":
    main()
