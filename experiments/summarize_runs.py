"""Print a markdown table of training runs from ROOT/*/metrics.jsonl: CV frame accuracy per
epoch, final CV and train CE, training wall time (CV excluded) and the minibatch sizes the
automatic probe chose (if it ran).
    python experiments/summarize_runs.py [ROOT]      (default runs/table23)"""
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "runs/table23"
rows = []
for name in sorted(os.listdir(root)):
    path = os.path.join(root, name, "metrics.jsonl")
    if os.path.isfile(path):
        records = list(map(json.loads, open(path)))
        rows.append((name, [r for r in records if r["kind"] == "epoch"],
                     [r["chosen"] for r in records if r["kind"] == "probe"]))
n = max((len(e) for _, e, _ in rows), default=0)
print("| run | " + " | ".join(f"CV acc epoch {e}" for e in range(n))
      + " | final CV CE | train CE | train s | probed sizes |")
print("|---" * (n + 5) + "|")
for name, epochs, chosen in rows:
    if not epochs:
        print(f"| {name} | (no epoch finished: diverged or stopped) |")
        continue
    accs = " | ".join(f"{100 * r['cv_frame_accuracy']:.2f}%" for r in epochs)
    accs += " | –" * (n - len(epochs))
    sizes = " → ".join(map(str, chosen)) if chosen else "–"
    print(f"| {name} | {accs} | {epochs[-1]['cv_ce']:.3f} | {epochs[-1]['train_ce']:.3f} | "
          f"{sum(r['seconds'] for r in epochs):.0f} | {sizes} |")
