"""Recognition of an archive: the model's outputs through the graph, scored against references.

Shared by `hpcsgd decode` (files, ranks, tuning) and `hpcsgd eval --graph` (one report). Two
kinds of model: hybrid frame classifiers (HLG, scaled log-likelihoods) and CTC models (TLG or
greedy search, log-posteriors over tokens; hpcsgd/decode/ctc.py). The references are the
archive's own: its phone token sequences, else its frame alignments, for phone outputs (PER;
silence is not a token); for word outputs (WER) --text when given, else the archive's
transcripts, else the file the graph was made with. Under several ranks each decodes the
utterances hpcsgd/outputs.py deals it; an utterance's hypothesis does not depend on which
rank decodes it.
"""
import os
import time

import numpy as np

from hpcsgd.data import archive
from hpcsgd.decode import mkgraph, score, search, timestamps
from hpcsgd.errors import UserError
from hpcsgd.families import of_model

# (acoustic scale, prior scale) per graph kind, tuned with the float32 recipe on so762's 13
# held-out speakers (docs/decode.md): a phone bigram is a weak LM and wants the acoustics
# weighed twice as much as a word bigram does; both divide out half the log-prior
SCALES = {"phones": (0.2, 0.5), "words": (0.1, 0.5), "digits": (0.1, 0.5)}
TUNE_ACOUSTIC = (0.05, 0.067, 0.083, 0.1, 0.125, 0.15, 0.2, 0.3)
TUNE_PRIOR = (0.0, 0.5, 1.0)
# CTC through TLG: the log-posteriors at scale 1 against G's costs, as icefall's HLG 1-best
# decoding adds them (lm_scale 1); not yet tuned on a CTC model of ours. No prior scale.
# The grid reaches 10: with a phone bigram every so762 CTC model chose the old grid's top, 3
CTC_ACOUSTIC = 1.0
TUNE_CTC = (0.3, 0.5, 0.7, 1.0, 1.4, 2.0, 3.0, 4.0, 6.0, 10.0)
# ... and the insertion penalty (graph cost per output word or phone, Kaldi's word insertion
# penalty): a CTC model through a phone n-gram deletes 5-10x more phones than it inserts on
# so762, so the grid reaches into bonuses. Hybrid graphs keep 0 (their grid is 24 points)
TUNE_CTC_PENALTY = (-3.0, -2.0, -1.0, 0.0, 1.0)
# RNN-T shallow fusion with a token n-gram (hpcsgd/decode/token_lm.py): icefall's LM scales
# for an RNN LM are 0.1-0.3; --tune picks one of these on the held-out speakers
LM_WEIGHT = 0.3
TUNE_LM_WEIGHT = (0.1, 0.2, 0.3, 0.5)
# ... with a reward per token (the LM's log-probabilities are negative, the blank's are not
# scored: without a reward fusion deletes; ESPnet's and Kannan et al.'s length bonus)
LM_BONUS = 0.0
TUNE_LM_BONUS = (0.0, 0.5, 1.0, 1.5, 2.0)
# decode --nbest through a graph: hypotheses per utterance when no count is given (an RNN-T's
# default is its beam size, all its final beam holds)
NBEST = 10


def add_search_arguments(parser):
    """The options `decode` and `eval --graph` share."""
    parser.add_argument("--text", help="Kaldi `text` with the references of word outputs "
                                       "(default: the archive's own transcripts, else the "
                                       "file the graph was made with)")
    parser.add_argument("--acoustic-scale", type=float,
                        help="weight of the scaled log-likelihoods against the graph's costs "
                             "(default per graph kind: " + ", ".join(
                                 f"{k} {a:g}" for k, (a, _) in SCALES.items()) +
                             f"; CTC graphs {CTC_ACOUSTIC:g})")
    parser.add_argument("--prior-scale", type=float,
                        help="hybrid models: how much of the log-prior to subtract from the "
                             "log-posteriors (default per graph kind: " + ", ".join(
                                 f"{k} {b:g}" for k, (_, b) in SCALES.items()) + ")")
    parser.add_argument("--insertion-penalty", type=float, default=0.0,
                        help="added to the graph cost of every output word (a phone graph's "
                             "phone): Kaldi's word insertion penalty; negative favours more "
                             "words (default 0)")
    parser.add_argument("--beam", type=float, default=search.BEAM, help="decoder beam")
    parser.add_argument("--max-active", type=int, default=search.MAX_ACTIVE,
                        help="most tokens alive per frame")


def scales(graph, args):
    """(acoustic scale, prior scale): the options where given, else the graph kind's. A TLG
    (CTC) has no prior scale: None."""
    if graph.topology == "ctc":
        if args.prior_scale is not None:
            raise UserError("--prior-scale is for hybrid models: a CTC model's log-posteriors "
                            "are searched as they are (docs/decode.md)")
        return (CTC_ACOUSTIC if args.acoustic_scale is None else args.acoustic_scale), None
    a, b = SCALES[graph.kind]
    return (a if args.acoustic_scale is None else args.acoustic_scale,
            b if args.prior_scale is None else args.prior_scale)


def unit(graph):
    """What the graph outputs: "phones" (phone graphs) or "words"."""
    return "phones" if graph.kind == "phones" else "words"


def metric(graph):
    return "PER" if graph.kind == "phones" else "WER"


def references(graph, archive_dir, text_path):
    """{utt: tokens} for the archive's utterances that have a reference (phones: all)."""
    return archive_references(unit(graph), archive_dir, text_path, graph.info.get("text"))[0]


def archive_references(kind, archive_dir, text_path=None, graph_text=None):
    """({utt: tokens} for the archive's utterances that have a reference, where they came
    from). kind "phones": the archive's phone tokens, else its frame alignments, runs merged
    (the two agree: data_prep/tokens.py makes one from the other), SIL dropped. kind "words":
    --text when given, else the archive's transcripts, else the file the graph was made with."""
    index = archive.read_index(archive_dir)
    if kind == "phones":
        if "phones" in index["tokens"]:
            symbols, utts = mkgraph.archive_tokens(archive_dir, "phones")
            return ({utt: [symbols[i] for i in ids] for utt, ids in utts},
                    f"{archive_dir} (its phone tokens)")
        if index["frame_labels"]:
            symbols, utts = mkgraph.archive_alignments(archive_dir)
            return ({utt: mkgraph.phone_sequence(symbols, ids, keep_sil=False)
                     for utt, ids, _ in utts}, f"{archive_dir} (its alignments)")
        raise UserError(f"{archive_dir}: no phone references (neither phone tokens nor frame "
                        f"labels): prep it with --tokens phones or --alignments")
    if not text_path and index["has_text"]:
        return mkgraph.archive_text(archive_dir), f"{archive_dir} (its transcripts)"
    text_path = text_path or graph_text
    if not text_path:
        raise UserError(f"{archive_dir} has no transcripts of its own, and word outputs are "
                        f"scored against transcripts: give --text")
    text = mkgraph.read_text(text_path)
    utts = [utt for utt, _ in utterance_frames(archive_dir)]
    return {utt: text[utt] for utt in utts if utt in text}, text_path


def utterance_frames(archive_dir):
    """[(utt, frames)] in archive order, from the shards' offsets alone: the audio each
    hypothesis covers (a CTC model's outputs have fewer rows than the archive has frames)."""
    index = archive.read_index(archive_dir)
    out = []
    for shard in index["shards"]:
        meta = archive.read_shard_meta(os.path.join(index["dir"], shard["file"]))
        out += zip(meta["utt_ids"], np.diff(meta["utt_offsets"]).tolist())
    return out


def training_vocabulary(train_archive):
    """The words of a training archive's transcripts, or None when it is not readable here
    (a model trained elsewhere) or has none."""
    if not train_archive or not os.path.isfile(os.path.join(train_archive, archive.INDEX_NAME)):
        return None
    text = mkgraph.archive_text(train_archive)
    return None if text is None else {w for words in text.values() for w in words}


def out_of_vocabulary(graph, refs, utts):
    """Reference tokens of `utts` the graph cannot output (each one an error whatever the
    acoustic model does)."""
    vocab = set(graph.words)
    return sum(1 for utt in utts if utt in refs for token in refs[utt] if token not in vocab)


def posteriors(model, params, meta, archive_dir, rank=0, world=1, whole=False):
    """This rank's share of the archive as [(utt, (T, P) log-posteriors)] (archive order),
    and the CPU seconds the acoustic model took (all of this process's threads): the model
    family's (a CTC model's (T', V) token log-posteriors; an RNN-T's encoder projections)."""
    return of_model(meta["model"]).posteriors(model, params, meta, archive_dir, rank, world,
                                              whole)


def score_matrix(graph, logpost, log_priors, acoustic_scale, prior_scale):
    """An utterance's model outputs -> the decoder's score matrix: a TLG's scaled
    log-posteriors, an HLG's scaled log-likelihoods (hpcsgd/decode/search.py)."""
    if graph.topology == "ctc":
        return search.ctc_scores(logpost, acoustic_scale)
    return search.scaled_loglikelihoods(logpost, log_priors, acoustic_scale, prior_scale,
                                        graph.states)


def recognize(decoder, logposts, log_priors, acoustic_scale, prior_scale, runs=None):
    """-> ({utt: hypothesis tokens}, [the utterances that ended in no final state], search
    CPU seconds of this thread). A TLG takes the log-posteriors times the acoustic scale
    (log_priors and prior_scale unused). runs: a dict to fill with each utterance's emitted
    token runs on the best path (TLG; hpcsgd/decode/timestamps.py)."""
    graph = decoder.graph
    hyps, not_final = {}, []
    t0 = time.thread_time()
    for utt, logpost in logposts:
        scores = score_matrix(graph, logpost, log_priors, acoustic_scale, prior_scale)
        words, final, frame_tokens = decoder.decode(scores)
        if runs is not None:
            runs[utt] = timestamps.token_runs(frame_tokens)
        tokens = [graph.words[w] for w in words]
        if graph.kind == "phones":
            tokens = [t for t in tokens if t != mkgraph.SIL]
        hyps[utt] = tokens
        if not final:
            not_final.append(utt)
    return hyps, not_final, time.thread_time() - t0


def nbest_lists(decoder, logposts, log_priors, acoustic_scale, prior_scale, n):
    """The n best distinct hypotheses of every utterance from its lattice (decoder.nbest) ->
    ({utt: [(score, hypothesis tokens)] best first}, {utt: the lattice beam, where narrowed
    from decoder.lattice_beam}, [the utterances searched again at the best path's beam],
    search CPU seconds of this thread). The score is minus the path's total cost (graph +
    acoustic), a log-score as the RNN-T beam's: higher is better. A phone graph's SIL is no
    token, as in recognize(): hypotheses that differ only in their silences are one."""
    graph = decoder.graph
    sil = graph.words.index(mkgraph.SIL) if graph.kind == "phones" and \
        mkgraph.SIL in graph.words else None
    lists, narrowed, widened = {}, {}, []
    t0 = time.thread_time()
    for utt, logpost in logposts:
        scores = score_matrix(graph, logpost, log_priors, acoustic_scale, prior_scale)
        ranked, _, beam, widen = decoder.nbest(scores, n, skip=() if sil is None else (sil,))
        lists[utt] = [(-cost, [graph.words[w] for w in words]) for cost, words in ranked]
        if beam < decoder.lattice_beam:
            narrowed[utt] = beam
        if widen:
            widened.append(utt)
    return lists, narrowed, widened, time.thread_time() - t0


def error_counts(refs, hyps):
    """Summed [ins, del, sub, ref, utts, utts wrong] over the utterances with a reference, and
    per utterance."""
    per_utt = {utt: score.counts(refs[utt], hyp) for utt, hyp in hyps.items() if utt in refs}
    total = np.sum(list(per_utt.values()), axis=0) if per_utt else \
        np.zeros(len(score.FIELDS), np.int64)
    return total, per_utt


def tune(decoder, logposts, log_priors, refs, comm=None, grid=None, default=None, folds=None):
    """Every (acoustic scale, prior scale, insertion penalty) of the grid on this rank's
    utterances, the counts summed over ranks: -> ([(a, b, p, total counts)], best first:
    fewest errors, then fewest utterances with an error, then fewest that ended in no final
    state, then the nearest to `default` (the (a, b, p) decode would use untuned), so that a
    tie keeps the defaults; held_out). A TLG's grid is the acoustic scales of TUNE_CTC times
    the penalties of TUNE_CTC_PENALTY, prior scale None; an HLG's penalty is decoder's.

    held_out: with `folds` ({utt: 0 or 1}, speaker_folds), each fold scored at the point
    tuned on the other, summed: an error rate tuned on other speakers than it is scored on,
    which the best point of the table (tuned and scored on the same utterances) is not.
    {"counts", "points": [the point fold 0 was scored at, fold 1's]}; None without folds."""
    if grid is None:
        grid = [(a, None, p) for p in TUNE_CTC_PENALTY for a in TUNE_CTC] \
            if decoder.graph.topology == "ctc" else \
            [(a, b, decoder.insertion_penalty) for b in TUNE_PRIOR for a in TUNE_ACOUSTIC]
    width = len(score.FIELDS) + 1
    counts = np.zeros((len(grid), 2, width), np.int64)   # per fold; the last: not final
    decoders = {}
    for i, (a, b, p) in enumerate(grid):
        if p not in decoders:
            decoders[p] = decoder.with_penalty(p)
        hyps, not_final, _ = recognize(decoders[p], logposts, log_priors, a, b)
        _, per_utt = error_counts(refs, hyps)
        for utt, c in per_utt.items():
            counts[i, folds.get(utt, 0) if folds else 0, :-1] += c
        for utt in not_final:
            counts[i, folds.get(utt, 0) if folds else 0, -1] += 1
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)     # cross-rank sync point
    a0, b0, p0 = default or grid[0]
    a0 = max(a0, 1e-6)
    near = [abs(np.log(a / a0)) + (abs(b - b0) if b is not None else 0.0) + abs(p - p0)
            for a, b, p in grid]

    def ranked(c):   # c: (grid, width) counts
        return sorted(range(len(grid)), key=lambda i: (c[i, :3].sum(), c[i, 5], c[i, 6],
                                                       near[i]))
    total = counts.sum(axis=1)
    table = [(*grid[i], total[i, :-1]) for i in ranked(total)]
    held_out = None
    if folds and counts[:, 0, 3].max() > 0 and counts[:, 1, 3].max() > 0:
        picks = [ranked(counts[:, 1 - f])[0] for f in (0, 1)]
        held_out = {"counts": counts[picks[0], 0, :-1] + counts[picks[1], 1, :-1],
                    "points": [grid[i] for i in picks]}
    return table, held_out


def tune_lm_weight(model, params, encs, tokens, beam, lm, refs, comm=None, folds=None,
                   grid=None):
    """The RNN-T beam search with shallow fusion at every (LM weight, token bonus) of the grid,
    the counts summed over ranks -> ([(weight, bonus, counts)] best first: fewest errors,
    then the smaller weight and bonus; held_out as tune's: each fold scored at the point the
    other fold chose)."""
    grid = grid or [(w, b) for w in TUNE_LM_WEIGHT for b in TUNE_LM_BONUS]
    counts = np.zeros((len(grid), 2, len(score.FIELDS)), np.int64)
    for i, (w, b) in enumerate(grid):
        hyps, _ = of_model(model.describe).search(model, params, encs, tokens, beam, lm=lm,
                                                  lm_weight=w, bonus=b)
        for utt, c in error_counts(refs, hyps)[1].items():
            counts[i, folds.get(utt, 0) if folds else 0] += c
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI
        comm.Allreduce(MPI.IN_PLACE, counts, op=MPI.SUM)     # cross-rank sync point

    def ranked(c):
        return sorted(range(len(grid)), key=lambda i: (c[i, :3].sum(), c[i, 5], grid[i]))
    total = counts.sum(axis=1)
    held_out = None
    if folds and counts[:, 0, 3].max() > 0 and counts[:, 1, 3].max() > 0:
        picks = [ranked(counts[:, 1 - f])[0] for f in (0, 1)]
        held_out = {"counts": counts[picks[0], 0] + counts[picks[1], 1],
                    "points": [grid[i] for i in picks]}
    return [(*grid[i], total[i]) for i in ranked(total)], held_out


def lm_tuning_lines(table, best, name, held_out=None):
    """The (LM weight x token bonus) table as decode prints it; best the (weight, bonus)."""
    bonuses = sorted({b for _, b, _ in table})
    rate = {(w, b): score.error_rate(c) for w, b, c in table}
    lines = [f"LM weight -> %{name} at token bonus " + " ".join(f"{b:>6g}" for b in bonuses)]
    for w in sorted({w for w, _, _ in table}):
        lines.append(f"  {w:<6g}" + " ".join(f"{rate[(w, b)]:6.2f}" for b in bonuses)
                     + ("  <- best" if w == best[0] else ""))
    if held_out is not None:
        (w0, b0), (w1, b1) = held_out["points"]
        lines.append(f"held out: %{name} {score.error_rate(held_out['counts']):.2f} with each "
                     f"half of the speakers decoded at the point tuned on the other half (LM "
                     f"weight {w0:g} and {w1:g}, token bonus {b0:g} and {b1:g})")
    return lines


def speaker_folds(archive_dir):
    """{utt: 0 or 1}: the archive's speakers in sorted order, alternately in fold 0 and 1
    (tune's held-out estimate: no speaker in both)."""
    index = archive.read_index(archive_dir)
    spk_of = {}
    for shard in index["shards"]:
        meta = archive.read_shard_meta(os.path.join(index["dir"], shard["file"]))
        spk_of.update(zip(meta["utt_ids"], (meta["spk_ids"][i] for i in meta["utt_spk"])))
    fold = {spk: i % 2 for i, spk in enumerate(sorted(set(spk_of.values())))}
    return {utt: fold[spk] for utt, spk in spk_of.items()}


def tuning_lines(table, best, name, held_out=None):
    """The table as decode prints it; `best` the (a, b, p) chosen."""
    penalties = sorted({p for _, _, p, _ in table})
    if table[0][1] is None:     # CTC: acoustic scales (rows) by insertion penalties (columns)
        rate = {(a, p): score.error_rate(c) for a, _, p, c in table}
        lines = [f"acoustic scale -> %{name} at insertion penalty "
                 + " ".join(f"{p:>6g}" for p in penalties)]
        for a in sorted({a for a, _, _, _ in table}):
            mark = "  <- best" if a == best[0] else ""
            lines.append(f"  {a:<6g}" + " ".join(f"{rate[(a, p)]:6.2f}" for p in penalties)
                         + mark)
    else:
        lines = [f"acoustic scale, prior scale -> %{name}"
                 + (f" (insertion penalty {penalties[0]:g})" if penalties != [0.0] else "")]
        for a, b, p, counts in sorted(table, key=lambda r: (r[1], r[0])):
            mark = "  <- best" if (a, b) == tuple(best[:2]) else ""
            lines.append(f"  {a:<6g} {b:<4g} {score.error_rate(counts):6.2f}{mark}")
    if held_out is not None:
        (a0, _, p0), (a1, _, p1) = held_out["points"]
        lines.append(f"held out: %{name} {score.error_rate(held_out['counts']):.2f} with each "
                     f"half of the speakers decoded at the point tuned on the other half "
                     f"(acoustic scale {a0:g} and {a1:g}, insertion penalty {p0:g} and {p1:g})")
    return lines


def recognize_archive(model, params, meta, archive_dir, graph_dir, args, comm=None):
    """Default or given scales: the error rate of `eval --graph` as a dict (score.as_dict
    plus the scales and the search's real-time factor per core; "cer" for a CTC model with
    chars or bpe tokens). Under several ranks (comm) each decodes its share and rank 0
    scores the gathered hypotheses (the others get None)."""
    rank, world = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    graph = search.Graph(graph_dir)
    graph.check_model(meta)
    index = archive.read_index(archive_dir)
    graph.check_archive(index, archive_dir)
    refs = references(graph, archive_dir, args.text)
    priors = of_model(meta["model"]).priors(meta)   # a hybrid's; None: searched as they are
    penalty = getattr(args, "insertion_penalty", 0.0)
    decoder = search.Decoder(graph, beam=args.beam, max_active=args.max_active,
                             insertion_penalty=penalty)
    a, b = scales(graph, args)
    logposts, _ = posteriors(model, params, meta, archive_dir, rank, world)
    hyps, not_final, search_s = recognize(decoder, logposts, priors, a, b)
    not_final = len(not_final)
    lengths = dict(utterance_frames(archive_dir))
    frames = sum(lengths[utt] for utt, _ in logposts)
    if world > 1:
        from mpi4py import MPI
        sums = np.array([frames, search_s, not_final], np.float64)
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)       # cross-rank sync point
        gathered = comm.gather(hyps, root=0)                 # small: token lists
        if rank != 0:
            return None
        hyps = {utt: tokens for part in gathered for utt, tokens in part.items()}
        frames, search_s, not_final = int(sums[0]), float(sums[1]), int(sums[2])
    total, per_utt = error_counts(refs, hyps)
    audio_s = frames * index["frame_shift_ms"] / 1000.0
    lines = score.kaldi_lines(metric(graph), total)
    result = {**score.as_dict(metric(graph), total), "graph": graph_dir, "kind": graph.kind,
              "topology": graph.topology, "acoustic_scale": a, "prior_scale": b,
              "insertion_penalty": penalty,
              "not_final": not_final, "no_reference": len(hyps) - len(per_utt),
              "rtf_search": search_s / audio_s}
    if with_cer(graph.topology == "ctc" and graph.tokens["kind"], unit(graph)):
        cer, _ = error_counts(*score.characters_of(refs, hyps))
        result["cer"] = score.as_dict("CER", cer)
        lines += "\n" + score.kaldi_lines("CER", cer).split("\n")[0]
    result["lines"] = lines
    return result


def with_cer(token_kind, output_unit):
    """A character error rate beside the WER: for CTC models over chars or bpe tokens whose
    outputs are words."""
    return token_kind in ("chars", "bpe") and output_unit == "words"
