"""Decoding speed: the beam search's real-time factor per core beside the acoustic model's.

One process, one thread for the search (kaldi-decoder's FasterDecoder is single-threaded)
and one for the network (BLAS pinned to 1 thread here, so both figures are per core). The
network runs once; the search runs for each beam and max-active pair on the same scores, so
the rows differ only in the search. A real-time factor is CPU seconds over seconds of audio;
the acoustic model's forward pass is the reference each search figure is set beside (what
recognition costs beyond the network). Each row also gives the error rate, so a faster
setting that loses accuracy shows it.

Without a model, the bundled demo corpus is prepared, a small DNN trained on it for one epoch
and its word graph made, all in a temporary directory (the CI smoke test).
"""
import os
import subprocess
import sys
import tempfile

from hpcsgd.bench.loader import DEMO

TARGET_RTF = 0.02     # issue 46: the word graph on so762 at <= 0.02 per core


def add_arguments(parser):
    parser.add_argument("model", nargs="?", help="run directory or checkpoint (default: train "
                                                 "a small DNN on the demo corpus)")
    parser.add_argument("--data", help="archive to decode (held-out speakers)")
    parser.add_argument("--graph", help="graph directory (hpcsgd mkgraph)")
    parser.add_argument("--text", help="Kaldi `text` for word references (default: the "
                                       "graph's)")
    parser.add_argument("--beams", default="9,13", help="beams to time")
    parser.add_argument("--max-active", default="1000,7000", help="max-active values to time")
    parser.add_argument("--acoustic-scale", type=float, help="default: the graph kind's")
    parser.add_argument("--prior-scale", type=float, help="default: the graph kind's")
    parser.add_argument("--small", action="store_true", help="quick smoke test (CI)")


def _demo(tmp):
    """Archive, model and word graph of the bundled demo corpus in `tmp`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    cli = [sys.executable, "-m", "hpcsgd.cli"]
    arch, run, graph = (os.path.join(tmp, n) for n in ("archive", "run", "graph"))
    for argv in (["prep", DEMO, arch, "--alignments", os.path.join(DEMO, "phones.ctm"),
                  "--labels", os.path.join(DEMO, "labels.txt"), "--cv-speakers", "8"],
                 ["train", f"data.train={arch}/train", "data.cv=", f"train.run_dir={run}",
                  "model.hidden=[256, 256]", "train.epochs=1", "train.tensorboard=false"],
                 ["mkgraph", f"{arch}/train", graph, "--kind", "words", "--text",
                  os.path.join(DEMO, "text")]):
        subprocess.run(cli + argv, check=True, stdout=subprocess.DEVNULL, env=env)
    return run, f"{arch}/cv", graph


def run(args):
    from hpcsgd import threads
    threads.enforce(1)       # numpy's pool has started (the bench command imported it)
    from hpcsgd.data import archive
    from hpcsgd.decode import recognize, score, search
    from hpcsgd.model_io import check_archive, load_model
    from hpcsgd.outputs import log_priors
    tmp = None
    model_path, data, graph_dir = args.model, args.data, args.graph
    if model_path is None:
        tmp = tempfile.TemporaryDirectory(prefix="hpcsgd-bench-")
        model_path, data, graph_dir = _demo(tmp.name)
    elif not (data and graph_dir):
        print("hpcsgd bench decode: a MODEL needs --data and --graph", file=sys.stderr)
        return 2
    graph = search.Graph(graph_dir)
    index = archive.read_index(data)
    graph.check_archive(index, data)
    model, params, meta = load_model(model_path)
    check_archive(data, meta)
    refs = recognize.references(graph, data, args.text)
    priors = log_priors(meta["label_counts"])
    logposts, forward_s = recognize.posteriors(model, params, meta, data)
    audio_s = sum(len(lp) for _, lp in logposts) * index["frame_shift_ms"] / 1000.0
    a, b = recognize.scales(graph, args)
    beams = [float(x) for x in args.beams.split(",")]
    actives = [int(x) for x in args.max_active.split(",")]
    if args.small:
        beams, actives = beams[-1:], actives[:1]
    name = recognize.metric(graph)
    print(f"{model_path} on {data} ({len(logposts)} utterances, {audio_s:.1f} s of audio) "
          f"through {graph_dir} ({graph.kind}, HLG {graph.info['hlg_states']} states, "
          f"{graph.info['hlg_arcs']} arcs); acoustic scale {a:g}, prior scale {b:g}")
    print(f"acoustic model forward: real-time factor {forward_s / audio_s:.4f} per core "
          f"({forward_s:.2f} s)")
    print(f"{'beam':>6s} {'max active':>10s} {'search RTF':>11s} {'vs forward':>11s} "
          f"{'%' + name:>8s}")
    rows = []
    for beam in beams:
        for active in actives:
            decoder = search.Decoder(graph, beam=beam, max_active=active)
            hyps, not_final, search_s = recognize.recognize(decoder, logposts, priors, a, b)
            total, _ = recognize.error_counts(refs, hyps)
            rtf = search_s / audio_s
            rows.append({"setting": f"beam {beam:g} max-active {active}", "beam": beam,
                         "max_active": active, "search_seconds": search_s,
                         "rtf_search": rtf, "search_of_forward": search_s / forward_s,
                         "error_rate": score.error_rate(total), "not_final": len(not_final)})
            print(f"{beam:6g} {active:10d} {rtf:11.4f} {search_s / forward_s:11.2f} "
                  f"{score.error_rate(total):8.2f}")
    default = next((r for r in rows if r["beam"] == search.BEAM
                    and r["max_active"] == search.MAX_ACTIVE), None)
    if default is not None:
        print(f"target (the defaults, beam {search.BEAM:g}, max active {search.MAX_ACTIVE}): "
              f"search RTF <= {TARGET_RTF} per core: "
              f"{'met' if default['rtf_search'] <= TARGET_RTF else 'NOT met'}")
    if tmp is not None:
        tmp.cleanup()
    return {"model": args.model or "(a DNN trained on the demo corpus here)", "data": data,
            "graph": args.graph or "(the demo's word graph)", "kind": graph.kind,
            "hlg_states": graph.info["hlg_states"], "hlg_arcs": graph.info["hlg_arcs"],
            "utterances": len(logposts), "audio_seconds": audio_s,
            "acoustic_scale": a, "prior_scale": b, "forward_seconds": forward_s,
            "rtf_forward": forward_s / audio_s, "rows": rows, "target_rtf": TARGET_RTF}


def figures(res):
    figs = {"acoustic model RTF per core": res["rtf_forward"]}
    for r in res["rows"]:
        figs[f"search RTF per core, {r['setting']}"] = r["rtf_search"]
        figs[f"error rate %, {r['setting']}"] = r["error_rate"]
    return figs
