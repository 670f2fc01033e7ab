"""Print the Table 2/3 comparison from runs/table23/*/metrics.jsonl (CV frame accuracy per epoch)."""
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else "runs/table23"
print("| run | " + " | ".join(f"CV acc epoch {e}" for e in range(3)) + " | final CV CE | train CE |")
print("|---|---|---|---|---|---|")
for name in sorted(os.listdir(root)):
    path = os.path.join(root, name, "metrics.jsonl")
    if not os.path.isfile(path):
        continue
    epochs = [r for r in map(json.loads, open(path)) if r["kind"] == "epoch"]
    if not epochs:
        print(f"| {name} | (no epoch finished: diverged or stopped) |")
        continue
    accs = " | ".join(f"{100 * r['cv_frame_accuracy']:.2f}%" for r in epochs)
    print(f"| {name} | {accs} | {epochs[-1]['cv_ce']:.3f} | {epochs[-1]['train_ce']:.3f} |")
