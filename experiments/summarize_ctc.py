"""The CTC table of docs/results.md from experiments/ctc_so762.sh's runs: each run's last CV
loss per token and greedy token error rate (from its metrics.jsonl), and the error rates its
decodes wrote (RUN/decode/*/result.json: greedy, and through the TLG with the tuned scale).

    python experiments/summarize_ctc.py runs/ctc [runs/ctc_pytorch]

A second directory holds experiments/pytorch_ctc.py's result.json (the PyTorch peer), shown
as one more row."""
import glob
import json
import os
import sys


def last_epoch(run):
    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        return None
    epochs = [json.loads(line) for line in open(path) if '"epoch"' in line]
    epochs = [r for r in epochs if r.get("kind", "epoch") == "epoch"]
    return epochs[-1] if epochs else None


def decodes(run):
    out = {}
    for path in sorted(glob.glob(os.path.join(run, "decode", "*", "result.json"))):
        r = json.load(open(path))
        search = "greedy" if r.get("search") == "greedy" else f"TLG a={r['acoustic_scale']:g}"
        out[search] = r
    return out


def main(root, torch_dir=None):
    print(f"{'run':10s} {'epochs':>6s} {'cv ctc/token':>12s} {'greedy TER':>10s}  decodes")
    for run in sorted(glob.glob(os.path.join(root, "*"))):
        epoch = last_epoch(run)
        if epoch is None:
            continue
        parts = []
        for search, r in decodes(run).items():
            cer = f", CER {r['cer']['error_rate']:.2f}" if r.get("cer") else ""
            parts.append(f"{search}: %{r['metric']} {r['error_rate']:.2f} "
                         f"[{r['ci95'][0]:.1f}-{r['ci95'][1]:.1f}]{cer}")
        print(f"{os.path.basename(run):10s} {epoch['epoch'] + 1:6d} "
              f"{epoch.get('cv_ctc_per_token', float('nan')):12.4f} "
              f"{100 * epoch.get('cv_token_error_rate', float('nan')):9.2f}%  "
              + "; ".join(parts))
    if torch_dir and os.path.isfile(os.path.join(torch_dir, "result.json")):
        r = json.load(open(os.path.join(torch_dir, "result.json")))
        last = r["epochs"][-1]
        print(f"{'pytorch':10s} {last['epoch'] + 1:6d} {last['cv_ctc_per_token']:12.4f} "
              f"{100 * last['cv_token_error_rate']:9.2f}%  greedy: %PER {r['per']:.2f} "
              f"(torch {r['torch']}, {r['threads']} threads)")


if __name__ == "__main__":
    main(*sys.argv[1:3])
