"""The quantization-aware training experiment's table from ROOT/*/metrics.jsonl
(experiments/qat_so762.sh): per run, held-out CV frame accuracy after each epoch, its last
epoch's CV CE, seconds per epoch (CV excluded) and the difference from the float32 control
(the same fine-tuning epochs unquantized); then, per model, post-training quantization (the
float model exported at INT8 and INT4 with the MAX rule, no fine-tuning) and each fine-tuned
model exported as integers, evaluated with `hpcsgd eval` (the export's size against float32,
and whether its accuracy equals the fake-quantized checkpoint's).
    python experiments/summarize_qat.py [ROOT] [--archive CV]   (default runs/qat,
                                                                runs/so762/archive/cv)"""
import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "hpcsgd.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


def load(root):
    runs = {}
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, "metrics.jsonl")
        if os.path.isfile(path):
            records = [json.loads(line) for line in open(path)]
            runs[name] = [r for r in records if r["kind"] == "epoch"]
    return runs


def evaluate(model, archive, out):
    proc = subprocess.run(CLI + ["eval", model, "--data", archive, "--json", out],
                          capture_output=True, text=True, env=ENV)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return json.load(open(out))


def export(model, bits, out):
    proc = subprocess.run(CLI + ["export", model, f"--int{bits}", "--out", out],
                          capture_output=True, text=True, env=ENV)
    if proc.returncode:
        raise SystemExit(proc.stderr)
    return proc.stdout.strip().splitlines()[-1]


def main():
    args = sys.argv[1:]
    archive = "runs/so762/archive/cv"
    if "--archive" in args:
        i = args.index("--archive")
        archive = args[i + 1]
        args = args[:i] + args[i + 2:]
    root = args[0] if args else "runs/qat"
    runs = load(root)
    print("| run | CV acc per epoch (%) | Δ vs the float32 control (points) | CV CE | s/epoch |")
    print("|---|---|---|---|---|")
    for name, ep in runs.items():
        if not ep:
            continue
        model = name.split("_")[0]
        control = runs.get(f"{model}_tune_float32", [])
        accs = " / ".join(f"{100 * e['cv_frame_accuracy']:.2f}" for e in ep)
        delta = (f"{100 * (ep[-1]['cv_frame_accuracy'] - control[-1]['cv_frame_accuracy']):+.2f}"
                 if "_tune_" in name and control else "")
        secs = sum(e["seconds"] for e in ep) / len(ep)
        print(f"| {name} | {accs} | {delta} | {ep[-1]['cv_ce']:.4f} | {secs:.0f} |")
    print("\n| model | weights | CV acc (%) | CV CE | as exported | equals the checkpoint |")
    print("|---|---|---|---|---|---|")
    for name in runs:
        run = os.path.join(root, name)
        if name.endswith("_float32") and "_tune_" not in name:   # post-training quantization
            base = evaluate(run, archive, os.path.join(run, "cv_float.json"))
            print(f"| {name} | float32 | {100 * base['frame_accuracy']:.2f} | {base['ce']:.4f} "
                  f"| checkpoint | |")
            for bits in (8, 4):
                out = os.path.join(run, f"ptq_int{bits}.h5")
                said = export(run, bits, out)
                r = evaluate(out, archive, os.path.join(run, f"cv_ptq{bits}.json"))
                print(f"| {name} | INT{bits} MAX, no fine-tuning | {100 * r['frame_accuracy']:.2f} "
                      f"| {r['ce']:.4f} | {said.split(': ', 1)[1]} | |")
        elif "_int" in name:
            bits = 4 if "_int4" in name else 8
            out = os.path.join(run, f"model_int{bits}.h5")
            said = export(run, bits, out)
            ck = evaluate(run, archive, os.path.join(run, "cv_ckpt.json"))
            r = evaluate(out, archive, os.path.join(run, f"cv_int{bits}.json"))
            same = r["ce"] == ck["ce"] and r["frame_accuracy"] == ck["frame_accuracy"]
            print(f"| {name} | INT{bits} (fine-tuned) | {100 * r['frame_accuracy']:.2f} | "
                  f"{r['ce']:.4f} | {said.split(': ', 1)[1]} | {'yes' if same else 'NO'} |")


if __name__ == "__main__":
    main()
