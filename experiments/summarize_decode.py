"""The recognition table of docs/results.md from the runs of experiments/decode_so762.sh:
per model, held-out frame accuracy (`hpcsgd eval`) and the error rate through each graph
(`hpcsgd decode` on 2 ranks), at the default acoustic and prior scales and at the scales
--tune picks on the same held-out speakers. A last row gives each graph's floor: the
held-out archive's own alignments as the "acoustic model" (probability 0.7 on the aligned
phone, the rest spread), which leaves only the errors of the graph (LM, lexicon, OOV words).
    python experiments/summarize_decode.py [ROOT] [--archive CV] [--graphs phones,words]
        [--models float32,onebit,...] [--no-floor]
        (default runs/decode, runs/so762/archive/cv, phones,words, every model of ROOT)"""
import json
import os
import subprocess
import sys

CLI = [sys.executable, "-m", "hpcsgd.cli"]
MPI = [os.path.join(os.path.dirname(sys.executable), "mpiexec"), "-n", "2", sys.executable,
       "-m", "mpi4py", "-m", "hpcsgd.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1",
           MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
MODELS = ("float32", "onebit", "mixed", "int4/model_int4.h5", "blstm")


def call(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return proc.stdout


def main():
    args = sys.argv[1:]
    opts = {"--archive": "runs/so762/archive/cv", "--graphs": "phones,words",
            "--models": ",".join(MODELS)}
    no_floor = "--no-floor" in args
    if no_floor:
        args.remove("--no-floor")
    for key in opts:
        if key in args:
            i = args.index(key)
            opts[key] = args[i + 1]
            del args[i:i + 2]
    root = args[0] if args else "runs/decode"
    archive, graphs = opts["--archive"], opts["--graphs"].split(",")
    head = "| model | CV frame accuracy |"
    for g in graphs:
        head += f" {g}: default scales | {g}: tuned (acoustic, prior) |"
    print(head)
    print("|---" * (2 + 2 * len(graphs)) + "|")
    for model in opts["--models"].split(","):
        path = os.path.join(root, model)
        if not os.path.exists(path):
            continue
        out = os.path.join(root, "summary", model.split("/")[0])
        os.makedirs(out, exist_ok=True)
        call(CLI + ["eval", path, "--data", archive, "--json", f"{out}/eval.json"])
        acc = json.load(open(f"{out}/eval.json"))["frame_accuracy"]
        row = f"| {model} | {100 * acc:.2f}% |"
        for g in graphs:
            graph = os.path.join(root, f"graph_{g}")
            cells = []
            for tuned in (False, True):
                dest = f"{out}/{g}_{'tuned' if tuned else 'default'}"
                call(MPI + ["decode", path, "--data", archive, "--graph", graph, "--out", dest]
                     + (["--tune"] if tuned else []))
                r = json.load(open(f"{dest}/result.json"))
                cell = f"{r['metric']} {r['error_rate']:.2f}"
                if tuned:
                    cell += f" ({r['acoustic_scale']:g}, {r['prior_scale']:g})"
                else:
                    cell += f" (RTF {r['rtf_search']:.4f})"
                cells.append(cell)
            row += " " + " | ".join(cells) + " |"
        print(row, flush=True)
    compare(root, graphs, opts["--models"].split(","))
    if no_floor:
        return
    row = "| the alignments (graph floor) | 100% |"
    for g in graphs:
        row += f" {floor(archive, os.path.join(root, f'graph_{g}'))} | |"
    print(row)


def compare(root, graphs, models):
    """Each model against float32 at the default scales, on the same utterances: the 95%
    confidence interval of its error rate and the probability that it is the better one (a
    bootstrap over utterances, Kaldi's compute-wer-bootci, through hpcsgd.decode.score)."""
    from hpcsgd.decode import mkgraph, score
    base = os.path.join(root, "summary", "float32")
    if not os.path.isdir(base):
        return
    print()
    print("| model | " + " | ".join(f"{g}: 95% interval | {g}: P(better than float32)"
                                    for g in graphs) + " |")
    print("|---" * (1 + 2 * len(graphs)) + "|")
    for model in models:
        name = model.split("/")[0]
        row = f"| {name} |"
        for g in graphs:
            refs = mkgraph.read_text(os.path.join(base, f"{g}_default", "ref.txt"))
            utts = sorted(refs)
            ref = [refs[u] for u in utts]
            ours = mkgraph.read_text(os.path.join(base, f"{g}_default", "hyp.txt"))
            theirs = mkgraph.read_text(os.path.join(root, "summary", name, f"{g}_default", "hyp.txt"))
            (lo, hi), better = score.bootstrap(ref, [ours[u] for u in utts],
                                               [theirs[u] for u in utts])
            interval = score.bootstrap(ref, [theirs[u] for u in utts])
            row += f" {interval[0]:.1f}-{interval[1]:.1f} | {'' if name == 'float32' else f'{better:.2f}'} |"
        print(row, flush=True)


def floor(archive_dir, graph_dir):
    """The error rate through the graph when the frames say exactly what the alignment says."""
    import numpy as np
    from hpcsgd.decode import mkgraph, recognize, score, search
    graph = search.Graph(graph_dir)
    symbols, utts = mkgraph.archive_alignments(archive_dir)
    refs = recognize.references(graph, archive_dir, None)
    decoder = search.Decoder(graph)
    logposts = []
    for utt, ids, lengths in utts:
        frames = np.repeat(ids, lengths)
        logpost = np.full((len(frames), len(symbols)), np.log(0.3 / (len(symbols) - 1)),
                          np.float32)
        logpost[np.arange(len(frames)), frames] = np.log(0.7)
        logposts.append((utt, logpost))
    hyps, _, _ = recognize.recognize(decoder, logposts, np.zeros(len(symbols), np.float32),
                                     1.0, 0.0)
    total, _ = recognize.error_counts(refs, hyps)
    return f"{recognize.metric(graph)} {score.error_rate(total):.2f}"


if __name__ == "__main__":
    main()
