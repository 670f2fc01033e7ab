"""`hpcsgd decode`: recognize an archive through a decoding graph, and score it as Kaldi does.

    hpcsgd decode RUN_DIR|CHECKPOINT --data ARCHIVE --graph GRAPH_DIR [--text TEXT] [--tune]
    hpcsgd decode CTC_RUN_DIR --data ARCHIVE --greedy
    hpcsgd decode RNNT_RUN_DIR --data ARCHIVE --greedy | --beam-size 4 [--nbest [N]]
    hpcsgd decode RUN_DIR --data ARCHIVE --graph GRAPH_DIR --nbest [N] [--lattice-beam 4]
    mpiexec -n 4 python -m mpi4py -m hpcsgd.cli decode RUN_DIR --data ARCHIVE --graph GRAPH_DIR

A hybrid model's log-posteriors, minus the scaled log-prior (the training archive's label
frequencies, stored in the checkpoint), times the acoustic scale, go through Kaldi's
FasterDecoder on HLG (hpcsgd/decode/search.py). A CTC model's token log-posteriors
(hpcsgd.outputs.ctc_posteriors) go through a TLG graph (mkgraph --topology ctc) times the
acoustic scale, no prior, or through greedy search without a graph (--greedy). An RNN-T
model's encoder output goes through its own prediction and joint networks: greedy search or
modified beam search (hpcsgd/decode/rnnt.py). The references
are the archive's own: its phone tokens or alignments for phone outputs (PER; silence is not a
token), its transcripts for words (WER, and CER for CTC models over chars or bpe tokens;
--text instead when given, else the file the graph was made with). Under mpiexec the ranks
decode disjoint utterances; the hypotheses do not depend on the number of ranks. --tune
decodes the archive at every scale (a CTC graph's: and insertion penalty) of a grid and keeps
the best: tune on held-out speakers (the CV archive), never on the training speakers; it also
reports each half of the speakers scored at the point the other half chose (held out).

Writes OUT (default RUN_DIR/decode/<graph>_<archive>/, greedy_<archive>/ for --greedy,
beam<K>_<archive>/ for an RNN-T's --beam-size K):
hyp.txt and ref.txt (Kaldi `text`), per_utt.txt (ins del sub ref per utterance), scoring.txt
(the lines printed) and result.json; all under temporary names, renamed. With --ctm (CTC
models) also hyp.ctm: each output word's (a phone model's phone's) start and duration from
the model's emissions (hpcsgd/decode/timestamps.py); --ref-ctm FILE reports how far the
starts of the correctly recognised words are from a reference CTM's (median, 90th percentile).
With --nbest [N] also nbest.txt: each utterance's N best distinct hypotheses, `utt-1 score
words` best first (Kaldi's n-best keys), the score a log-score (higher is better): an RNN-T's
from its final beam, a graph's from the lattice of a second search (Kaldi's
LatticeSimpleDecoder, hpcsgd/decode/lattice.py), minus its total cost; hyp.txt stays the
best path's.
"""
import argparse
import json
import os
import sys
import time
import traceback

import numpy as np

from hpcsgd.data import archive
from hpcsgd.decode import recognize, score, search, timestamps, token_lm
from hpcsgd.decode.rnnt import MAX_SYMBOLS
from hpcsgd.errors import UserError
from hpcsgd.families import of_model
from hpcsgd.model_io import add_device_argument

ABORT_FORWARD_S = 0.5    # a failing rank's last words reach the launcher before MPI_Abort

EXAMPLES = """examples:
  hpcsgd decode runs/so762/run --data runs/so762/archive/cv --graph runs/so762/graph_phones --tune
  mpiexec -n 2 python -m mpi4py -m hpcsgd.cli decode runs/so762/run \\
      --data runs/so762/archive/cv --graph runs/so762/graph_words --acoustic-scale 0.083
  hpcsgd decode runs/so762/ctc --data runs/so762/archive/cv --greedy
  hpcsgd decode runs/so762/ctc --data runs/so762/archive/cv --graph runs/so762/tlg_chars --tune
Graphs: hpcsgd mkgraph TRAIN_ARCHIVE GRAPH_DIR --kind phones|words|digits
[--topology ctc --tokens phones|chars|bpe] (docs/decode.md)."""


def add_arguments(parser):
    parser.add_argument("model", help="run directory (latest checkpoint), checkpoint file or "
                                      "exported model")
    parser.add_argument("--data", required=True, help="archive to recognize (hpcsgd prep OUT)")
    how = parser.add_mutually_exclusive_group(required=True)
    how.add_argument("--graph", help="graph directory (hpcsgd mkgraph): HLG for a hybrid "
                                     "model, TLG (--topology ctc) for a CTC model")
    how.add_argument("--greedy", action="store_true",
                     help="CTC models: greedy search, no graph (the best token per frame, "
                          "repeats merged, blanks dropped); RNN-T models: greedy search (at "
                          f"most {MAX_SYMBOLS} symbols per frame)")
    how.add_argument("--beam-size", type=int, metavar="K",
                     help="RNN-T models: modified beam search with K hypotheses (at most one "
                          "symbol per frame, equal prefixes merged; icefall's default is 4)")
    parser.add_argument("--out", help="output directory (default RUN_DIR/decode/GRAPH_ARCHIVE; "
                                      "a model file's: decode/MODEL_GRAPH_ARCHIVE beside it)")
    recognize.add_search_arguments(parser)
    parser.add_argument("--tune", action="store_true",
                        help="decode at every acoustic scale of "
                             f"{','.join(map(str, recognize.TUNE_ACOUSTIC))} and prior scale "
                             f"of {','.join(map(str, recognize.TUNE_PRIOR))} (CTC graphs: "
                             f"acoustic scale {','.join(map(str, recognize.TUNE_CTC))} "
                             f"times insertion penalty "
                             f"{','.join(map(str, recognize.TUNE_CTC_PENALTY))}); keep the "
                             f"best, and score each half of the speakers at the other's best")
    parser.add_argument("--lm-order", type=int, metavar="N",
                        help="RNN-T --beam-size: shallow fusion with a token N-gram estimated "
                             "from the model's training archive (its data.train tokens)")
    parser.add_argument("--lm", metavar="ARPA",
                        help="RNN-T --beam-size: shallow fusion with this ARPA n-gram over the "
                             "model's token symbols instead")
    parser.add_argument("--lm-weight", type=float, default=recognize.LM_WEIGHT,
                        help="weight of the n-gram's log-probabilities in the beam search "
                             "(--tune: tried from " + ",".join(map(str, recognize.TUNE_LM_WEIGHT))
                             + ")")
    parser.add_argument("--lm-bonus", type=float, default=recognize.LM_BONUS,
                        help="with shallow fusion: a reward added to every token extension "
                             "(--tune: tried from " + ",".join(map(str, recognize.TUNE_LM_BONUS))
                             + ")")
    parser.add_argument("--nbest", nargs="?", type=count, const=0, metavar="N",
                        help="also write OUT/nbest.txt, each utterance's N best distinct "
                             "hypotheses with their log-scores, best first: through a graph "
                             "from its lattice (Kaldi's lattice-to-nbest; N default "
                             f"{recognize.NBEST}), an RNN-T's from the final beam of its "
                             "--beam-size K search (N <= K, default K)")
    parser.add_argument("--lattice-beam", type=float, default=search.LATTICE_BEAM,
                        help="--nbest through a graph: the lattice keeps the paths within this "
                             "cost of the best (Kaldi's --lattice-beam; narrowed for an "
                             "utterance whose lattice is too rich to determinize)")
    parser.add_argument("--nbest-beam", type=float, default=search.NBEST_BEAM,
                        help="--nbest through a graph: the lattice search's beam (it has no "
                             "max-active: a word graph's costs >300x the best path's at 13, "
                             "~15x at 8); an utterance whose lattice's best is dearer than "
                             "the best path is searched again at --beam")
    parser.add_argument("--ctm", action="store_true",
                        help="CTC and RNN-T models: also write OUT/hyp.ctm, each word's (phone's) "
                             "start and duration from the emissions (greedy, the graph's best "
                             "path, the beam's best hypothesis)")
    parser.add_argument("--ref-ctm", metavar="CTM",
                        help="with --ctm: score the word starts against this CTM (e.g. a forced "
                             "alignment's): median and 90th percentile error of the words "
                             "recognised correctly")
    parser.add_argument("--sequences", choices=("chunks", "whole"), default="chunks",
                        help="hybrid sequence (LSTM) models: the training chunks, or whole "
                             "utterances")
    add_device_argument(parser)


def count(text):
    """--nbest N: a count of hypotheses, 1 or more (a bare --nbest is 0: the default)."""
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: give N >= 1 hypotheses per utterance")
    return n


def word_times(args, meta, graph, index, hyps, runs, tokens):
    """-> (hyp.ctm's text, the start-error summary against --ref-ctm or None)."""
    from hpcsgd.model.encoder import time_stride
    frame_s = time_stride(meta["model"]["encoder"]) * index["frame_shift_ms"] / 1000.0
    prons = None
    if tokens["kind"] == "phones" and graph is not None and graph.kind != "phones":
        prons = timestamps.read_lexicon(os.path.join(graph.dir, "lexicon.txt"))
    lines, spans = [], {}
    for utt in sorted(hyps):
        spans[utt] = timestamps.word_spans(hyps[utt], runs[utt], tokens["symbols"],
                                           tokens["kind"], prons)
        lines.append(timestamps.ctm_lines(utt, spans[utt], frame_s))
    timing = None
    if args.ref_ctm:
        hyp_starts = {u: [(w, a * frame_s) for w, a, _ in s] for u, s in spans.items()}
        timing = timestamps.timing_summary(
            timestamps.start_errors(hyp_starts, timestamps.read_ctm(args.ref_ctm)))
    return "".join(lines), timing


def default_out(model_path, graph_dir, archive_dir):
    """RUN/decode/GRAPH_ARCHIVE; a model file's (an average, an export, a checkpoint file)
    beside it, its name in front: RUN/decode/MODEL_GRAPH_ARCHIVE, apart from the run's own.
    When that directory holds the decode of another archive of the same name (two archives
    called cv), the archive's parent folders go in front of its name until the name is free
    or holds this archive's: GRAPH_PARENT_ARCHIVE, ..."""
    base, prefix = model_path, ""
    if not os.path.isdir(model_path):
        base = os.path.dirname(os.path.abspath(model_path))
        prefix = os.path.splitext(os.path.basename(model_path))[0] + "_"
    graph = os.path.basename(os.path.normpath(graph_dir))
    here = os.path.realpath(archive_dir)
    parts = [p for p in here.split(os.sep) if p]
    for k in range(1, len(parts) + 1):
        out = os.path.join(base, "decode", f"{prefix}{graph}_{'_'.join(parts[-k:])}")
        if decoded_archive(out) in (None, here):
            return out
    return out


def decoded_archive(out):
    """The real path of the archive a decode directory holds (None: none there)."""
    try:
        with open(os.path.join(out, "result.json")) as f:
            result = json.load(f)
    except (OSError, ValueError):
        return None
    return result.get("archive_path") or os.path.realpath(result.get("archive") or "")


def text_lines(mapping):
    return "".join(f"{utt} {' '.join(tokens)}\n".replace(" \n", "\n")
                   for utt, tokens in sorted(mapping.items()))


def run(args):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    try:
        return decode(args, comm)
    except UserError:   # every rank checks the same inputs before any collective: all raise
        raise
    except Exception:
        for line in traceback.format_exc().rstrip().splitlines():
            os.write(2, f"hpcsgd decode: rank {rank}: {line}\n".encode())
        if world > 1:   # a failing rank ends the job instead of leaving the others waiting
            time.sleep(ABORT_FORWARD_S)
            comm.Abort(1)
        return 1


def decode(args, comm):
    from hpcsgd.model_io import EVAL_BATCH, check_archive, load_model
    from hpcsgd.outputs import longest_utterance
    rank, world = comm.Get_rank(), comm.Get_size()
    # every input checked on every rank before the first collective: a bad one stops them all
    graph = search.Graph(args.graph) if args.graph else None
    index = archive.read_index(args.data)
    whole = args.sequences == "whole"
    model, params, meta = load_model(args.model, max(EVAL_BATCH, longest_utterance(args.data))
                                     if whole else EVAL_BATCH, device=args.device, comm=comm)
    fam = of_model(meta["model"])   # what it outputs (frame labels or tokens), how it is searched
    tokens = meta["tokens"] if fam.UTTERANCES else None
    if graph is not None and "graph" not in fam.SEARCHES:
        raise UserError(f"{meta['path']} is an RNN-T model: its prediction network is its "
                        f"language model, searched by --greedy or --beam-size (a graph weighs "
                        f"per-frame posteriors, which a transducer does not give)")
    if args.beam_size is not None and ("beam" not in fam.SEARCHES or args.beam_size < 1):
        raise UserError(f"--beam-size {args.beam_size}: the beam search of RNN-T models, "
                        f"K >= 1 ({meta['path']} is a {meta['model'].get('type', 'dnn')} model)")
    if (args.ctm or args.ref_ctm) and not fam.TIMESTAMPS:
        raise UserError(f"--ctm: word times from CTC or RNN-T emissions; {meta['path']} is a "
                        f"{meta['model'].get('type', 'dnn')} model")
    if args.ref_ctm and not os.path.isfile(args.ref_ctm):
        raise UserError(f"--ref-ctm {args.ref_ctm}: no such file")
    runs = {} if args.ctm or args.ref_ctm else None   # utt -> emitted token runs (timestamps)
    if graph is not None:
        graph.check_model(meta)
        graph.check_archive(index, args.data)
        unit, scales = recognize.unit(graph), recognize.scales(graph, args)
    elif "greedy" not in fam.SEARCHES:
        raise UserError(f"--greedy is for CTC models, and {meta['path']} is a hybrid model: "
                        f"give --graph GRAPH_DIR (hpcsgd mkgraph)")
    else:
        fusion = args.lm or args.lm_order
        if (args.tune and not fusion) or args.acoustic_scale is not None \
                or args.prior_scale is not None or args.insertion_penalty:
            raise UserError("--tune, --acoustic-scale, --prior-scale and --insertion-penalty "
                            "weigh a graph search: greedy search has nothing to weigh (an "
                            "RNN-T's --beam-size with --lm-order or --lm tunes --lm-weight)")
        unit, scales = ("phones" if tokens["kind"] == "phones" else "words"), None
    if args.nbest is not None and graph is None and not args.beam_size:
        raise UserError("--nbest: the N best hypotheses of a search that keeps more than one: "
                        "a graph's lattice (--graph) or an RNN-T's --beam-size K beam; "
                        "greedy search keeps one")
    if args.nbest and args.beam_size and args.nbest > args.beam_size:
        raise UserError(f"--nbest {args.nbest}: an RNN-T's final beam holds --beam-size "
                        f"{args.beam_size} hypotheses; give --beam-size {args.nbest} or more")
    for name, value, default in (("--lattice-beam", args.lattice_beam, search.LATTICE_BEAM),
                                 ("--nbest-beam", args.nbest_beam, search.NBEST_BEAM)):
        if value != default and (args.nbest is None or graph is None):
            raise UserError(f"{name}: the lattice search of --nbest through a graph")
        if value <= 0:
            raise UserError(f"{name} {value:g}: a cost above 0")
    n_best = None if args.nbest is None else \
        (args.nbest or args.beam_size or recognize.NBEST)    # a bare --nbest: the default
    nbest = {} if n_best else None      # utt -> [(score, words)], best first
    lm = None
    if args.lm or args.lm_order:
        if not args.beam_size:
            raise UserError("--lm-order/--lm: shallow fusion in the RNN-T beam search; give "
                            "--beam-size K (a CTC model's LM is its graph: --graph)")
        lm = token_lm.load(args.lm, args.lm_order, meta)
    check_archive(args.data, meta)     # features; labels (hybrid) or tokens (CTC)
    refs, ref_source = recognize.archive_references(
        unit, args.data, args.text, graph.info.get("text") if graph is not None else None)
    priors = fam.priors(meta)   # a hybrid's label priors; None: searched as they are
    decoder = None if graph is None else \
        search.Decoder(graph, beam=args.beam, max_active=args.max_active,
                       insertion_penalty=args.insertion_penalty, lattice_beam=args.lattice_beam,
                       nbest_beam=args.nbest_beam)

    logposts, forward_s = recognize.posteriors(model, params, meta, args.data, rank, world, whole)
    table = held_out = lm_table = None
    # --nbest through a graph: the lattice search's seconds, the 1-bests off hyp.txt, the
    # utterances searched again at --beam
    lattice_s = differ = widened = 0
    narrowed = {}               # ... and the utterances whose lattice beam was narrowed
    penalty = args.insertion_penalty
    lm_weight, lm_bonus = args.lm_weight, args.lm_bonus
    if decoder is None:
        if lm is not None and args.tune:
            lm_table, held_out = recognize.tune_lm_weight(
                model, params, logposts, tokens, args.beam_size, lm, refs, comm,
                folds=recognize.speaker_folds(args.data))
            lm_weight, lm_bonus = lm_table[0][:2]
        hyps, search_s = fam.search(model, params, logposts, tokens, args.beam_size, lm=lm,
                                    lm_weight=lm_weight, bonus=lm_bonus, nbest=nbest, runs=runs)
        if nbest is not None:     # the final beam holds K: the N best of them
            nbest = {utt: ranked[:n_best] for utt, ranked in nbest.items()}
        not_final = 0
    else:
        if args.tune:
            table, held_out = recognize.tune(decoder, logposts, priors, refs, comm,
                                             default=(*scales, penalty),
                                             folds=recognize.speaker_folds(args.data))
            scales, penalty = table[0][:2], table[0][2]
            decoder = decoder.with_penalty(penalty)
        hyps, not_final, search_s = recognize.recognize(decoder, logposts, priors, *scales, runs)
        not_final = len(not_final)
        if nbest is not None:   # a second search, hyp.txt stays the best path's
            nbest, narrowed, widened, lattice_s = recognize.nbest_lists(
                decoder, logposts, priors, *scales, n_best)
            widened = len(widened)
            differ = sum(1 for utt, ranked in nbest.items()
                         if not ranked or ranked[0][1] != hyps[utt])
    lengths = dict(recognize.utterance_frames(args.data))   # audio frames, not output rows
    frames = sum(lengths[utt] for utt, _ in logposts)
    sums = np.array([frames, search_s, forward_s, not_final, lattice_s, differ, widened],
                    np.float64)
    from mpi4py import MPI
    comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)       # cross-rank sync point
    gathered = comm.gather((hyps, runs, nbest, narrowed), root=0)  # small: token lists
    if rank != 0:
        return 0
    narrowed = {u: b for *_, part in gathered for u, b in part.items()}

    hyps = {utt: words for part, *_ in gathered for utt, words in part.items()}
    runs = None if runs is None else {u: r for _, part, *_ in gathered for u, r in part.items()}
    nbest = None if nbest is None else {u: r for _, _, part, _ in gathered
                                        for u, r in part.items()}
    total, per_utt = recognize.error_counts(refs, hyps)
    frames, search_s, forward_s, not_final, lattice_s, differ, widened = sums
    audio_s = frames * index["frame_shift_ms"] / 1000.0
    name = "PER" if unit == "phones" else "WER"
    lines = []
    if table is not None:
        lines.append(f"tuned on {args.data} ({len(per_utt)} utterances):")
        lines += recognize.tuning_lines(table, (*scales, penalty), name, held_out)
    if lm_table is not None:
        lines.append(f"tuned on {args.data} ({len(per_utt)} utterances):")
        lines += recognize.lm_tuning_lines(lm_table, (lm_weight, lm_bonus), name, held_out)
    if graph is None:
        lines.append(f"{args.model} on {args.data} by "
                     f"{fam.describe_search(args.beam_size, tokens['kind'])}"
                     + ("" if lm is None else f", shallow fusion with {lm.source} at weight "
                        f"{lm_weight:g}, token bonus {lm_bonus:g}"))
    elif graph.topology == "ctc":   # a TLG (graph.check_model: the model's is a CTC model)
        lines.append(f"{args.model} on {args.data} through {args.graph} ({graph.kind}, CTC over "
                     f"{tokens['kind']} tokens): acoustic scale {scales[0]:g}, "
                     f"insertion penalty {penalty:g}, beam "
                     f"{args.beam:g}, max active {args.max_active}")
    else:
        lines.append(f"{args.model} on {args.data} through {args.graph} ({graph.kind}): "
                     f"acoustic scale {scales[0]:g}, prior scale {scales[1]:g}"
                     + (f", insertion penalty {penalty:g}" if penalty else "") + ", beam "
                     f"{args.beam:g}, max active {args.max_active}")
    lines.append(score.kaldi_lines(name, total))
    scored = sorted(per_utt)
    low, high = score.bootstrap([refs[u] for u in scored], [hyps[u] for u in scored]) \
        if scored else (float("nan"), float("nan"))
    lines.append(f"95% confidence interval {low:.2f}-{high:.2f} (a bootstrap over the "
                 f"utterances, as Kaldi's compute-wer-bootci)")
    cer = None
    if recognize.with_cer(tokens and tokens["kind"], unit):
        ref_chars, hyp_chars = score.characters_of(refs, hyps)
        cer_total, _ = recognize.error_counts(ref_chars, hyp_chars)
        c_low, c_high = score.bootstrap([ref_chars[u] for u in scored],
                                        [hyp_chars[u] for u in scored]) \
            if scored else (float("nan"), float("nan"))
        lines.append(score.kaldi_lines("CER", cer_total).split("\n")[0] +
                     f" (the words' characters, no spaces); 95% interval {c_low:.2f}-{c_high:.2f}")
        cer = {**score.as_dict("CER", cer_total), "ci95": [c_low, c_high]}
    oov = recognize.out_of_vocabulary(graph, refs, hyps) if graph is not None else None
    if graph is not None and graph.kind != "phones":
        lines.append(f"{oov} of the {int(total[3])} reference words are not in the graph's "
                     f"vocabulary ({100 * oov / max(int(total[3]), 1):.2f}%: errors whatever "
                     f"the acoustic model says)")
    elif graph is None and unit == "words":    # greedy: beside the training transcripts' words
        train = (meta.get("config") or {}).get("data.train")
        vocab = recognize.training_vocabulary(train)
        if vocab is not None:
            oov = sum(1 for u in per_utt for w in refs[u] if w not in vocab)
            lines.append(f"{oov} of the {int(total[3])} reference words never occur in the "
                         f"training transcripts ({train}): {100 * oov / max(int(total[3]), 1):.2f}%")
    ctm = timing = None
    if runs is not None:
        ctm, timing = word_times(args, meta, graph, index, hyps, runs, tokens)
        lines.append(f"hyp.ctm: {sum(len(v) for v in hyps.values())} {unit} timed from the "
                     f"emissions" + ("" if timing is None else
                                     f"; start error against {args.ref_ctm} over the "
                                     f"{timing['words']} {unit} recognised correctly: median "
                                     f"{timing['median_ms']:.0f} ms, 90th percentile "
                                     f"{timing['p90_ms']:.0f} ms, mean {timing['mean_ms']:.0f} ms"))
    if nbest is not None:
        held = sum(len(r) for r in nbest.values()) / max(len(nbest), 1)
        line = f"nbest.txt: up to {n_best} hypotheses per utterance, {held:.1f} on average"
        if graph is not None:
            line += (f", from lattices (beam {decoder.nbest_beam:g}, lattice beam "
                     f"{args.lattice_beam:g}): search {lattice_s:.2f} s (the best path's "
                     f"{search_s:.2f} s); {int(widened)} searched again at beam "
                     f"{args.beam:g} (the best path lost); {int(differ)} utterance(s) whose "
                     f"lattice's best differs from hyp.txt; {len(narrowed)} too rich to "
                     f"determinize, at a lattice beam down to "
                     f"{min(narrowed.values(), default=args.lattice_beam):g}")
        lines.append(line)
    finals = "" if graph is None else f"; {int(not_final)} ended in no final state"
    lines.append(f"{len(hyps)} utterances, {int(frames)} frames ({audio_s:.1f} s of audio) on "
                 f"{world} rank(s){finals}; {len(hyps) - len(per_utt)} without a reference "
                 f"(not scored); references: {ref_source}")
    lines.append(f"real-time factor per core: search {search_s / audio_s:.4f} "
                 f"({search_s:.2f} s), acoustic model {forward_s / audio_s:.4f} "
                 f"({forward_s:.2f} s)")
    report = "\n".join(lines) + "\n"
    print(report, end="")
    result = {"model": args.model, "archive": args.data,
              "archive_path": os.path.realpath(args.data), "graph": args.graph,
              "kind": graph.kind if graph is not None else None,
              "topology": graph.topology if graph is not None else "ctc",
              "search": "graph" if graph is not None else (
                  f"beam {args.beam_size}" if args.beam_size else "greedy"),
              "tokens": tokens["kind"] if tokens else None, **score.as_dict(name, total),
              "cer": cer, "references": ref_source,
              "acoustic_scale": scales[0] if scales else None,
              "prior_scale": scales[1] if scales else None,
              "insertion_penalty": penalty if graph is not None else None,
              "beam": args.beam if graph is not None else None,
              "max_active": args.max_active if graph is not None else None,
              "nbest": n_best, "lattice_beam": args.lattice_beam
              if graph is not None and n_best else None,
              "nbest_beam": decoder.nbest_beam if graph is not None and n_best else None,
              "nbest_seconds": lattice_s if graph is not None and n_best else None,
              "nbest_differ": int(differ) if graph is not None and n_best else None,
              "nbest_widened": int(widened) if graph is not None and n_best else None,
              "nbest_narrowed": narrowed if graph is not None and n_best else None,
              "frames": int(frames), "audio_seconds": audio_s,
              "not_final": int(not_final), "no_reference": len(hyps) - len(per_utt),
              "oov_tokens": oov, "ci95": [low, high], "timing": timing,
              "lm": None if lm is None else lm.source, "lm_weight": lm_weight if lm else None,
              "lm_bonus": lm_bonus if lm else None,
              "lm_tuning": None if lm_table is None else
              [{"lm_weight": w, "lm_bonus": b, "error_rate": score.error_rate(c)}
               for w, b, c in lm_table],
              "ranks": world, "search_seconds": search_s, "forward_seconds": forward_s,
              "rtf_search": search_s / audio_s, "rtf_forward": forward_s / audio_s,
              "tuning": None if table is None else
              [{"acoustic_scale": a, "prior_scale": b, "insertion_penalty": p,
                "error_rate": score.error_rate(c)} for a, b, p, c in table],
              "held_out": None if held_out is None else
              {**score.as_dict(name, held_out["counts"]),
               "points": [{"lm_weight": pt[0], "lm_bonus": pt[1]} if lm_table is not None else
                          {"acoustic_scale": pt[0], "prior_scale": pt[1],
                           "insertion_penalty": pt[2]} for pt in held_out["points"]]}}
    out = args.out or default_out(args.model, args.graph or (
        f"beam{args.beam_size}" if args.beam_size else "greedy"), args.data)
    os.makedirs(out, exist_ok=True)
    archive.atomic_write_text(os.path.join(out, "hyp.txt"), text_lines(hyps))
    archive.atomic_write_text(os.path.join(out, "ref.txt"), text_lines(
        {utt: refs[utt] for utt in hyps if utt in refs}))
    archive.atomic_write_text(os.path.join(out, "per_utt.txt"), "".join(
        f"{utt} {c[0]} {c[1]} {c[2]} {c[3]}\n" for utt, c in sorted(per_utt.items())))
    if ctm is not None:
        archive.atomic_write_text(os.path.join(out, "hyp.ctm"), ctm)
    if nbest is not None:     # Kaldi's n-best keys: utt-1 the best; a log-score, higher better
        archive.atomic_write_text(os.path.join(out, "nbest.txt"), "".join(
            f"{utt}-{i} {sc:.4f} {' '.join(words)}\n" for utt in sorted(nbest)
            for i, (sc, words) in enumerate(nbest[utt], 1)))
    archive.atomic_write_text(os.path.join(out, "scoring.txt"), report)
    archive.atomic_write_text(os.path.join(out, "result.json"), json.dumps(result, indent=1) + "\n")
    print(f"decode: wrote {out}/ (hyp.txt, ref.txt, per_utt.txt, scoring.txt, result.json)")
    sys.stdout.flush()
    return 0
