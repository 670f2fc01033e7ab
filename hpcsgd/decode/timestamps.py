"""Word (or phone) timestamps from a model's emissions, written as a CTM, and scored against a
reference CTM.

A CTC model's search gives one token per output frame, the blank included (the greedy argmax,
or the best path through TLG). Its non-blank runs are the emitted tokens: `a a <blk> b` ->
a at frames 0-1, b at frame 3. A hypothesis word spans the runs that spell it:

    chars   its letters (the `<space>` runs between words belong to no word)
    bpe     its pieces' letters (a bare `▁` piece begins the word after it)
    phones  one run per phone (a phone graph's output), or, through a word graph, the runs
            of one of its pronunciations in the graph's lexicon.txt

so a word starts at its first run's first frame and ends after its last run's last frame. An
RNN-T emits each token at one encoder frame (its greedy search's, or the best alignment
merged into the beam search's hypothesis): a run of one frame. Output frame t of a model
that subsamples by s covers audio [t s, (t + 1) s) frame shifts. CTC's emissions are peaky
(one or two frames per token), so a word's duration is from its first to its last token
emission, shorter than the word as a forced alignment times it; its start is what the
reference is compared on (CTM's convention: `utt channel start duration word`, seconds).

Timing accuracy (`decode --ref-ctm`): the hypothesis and reference words of each utterance
are aligned by edit distance (kaldialign); each word recognised correctly contributes
|hyp start - ref start|; the median and the 90th percentile are reported in ms.
"""
import numpy as np

from hpcsgd.decode.ctc import SPACE, WORD_START
from hpcsgd.decode.mkgraph import SIL   # a lexicon's and an alignment's silence: never a token


def token_runs(frame_tokens, blank=0):
    """Per-frame token ids (T',) -> [(token, first frame, last frame)] of the non-blank runs."""
    frame_tokens = np.asarray(frame_tokens)
    if not len(frame_tokens):
        return []
    starts = np.flatnonzero(np.concatenate([[True], frame_tokens[1:] != frame_tokens[:-1]]))
    ends = np.append(starts[1:], len(frame_tokens)) - 1
    return [(int(frame_tokens[a]), int(a), int(b)) for a, b in zip(starts, ends)
            if frame_tokens[a] != blank]


def emission_runs(token_ids, frames):
    """RNN-T: the emitted tokens and the encoder frame of each -> runs of one frame."""
    return [(int(k), int(t), int(t)) for k, t in zip(token_ids, frames)]


def word_spans(words, runs, symbols, kind, prons=None):
    """-> [(word, first frame, last frame)] for the hypothesis `words` spelled by `runs` (see
    the module docstring). prons: {word: [phone tuples]} for phone tokens through a word graph.
    ValueError when the runs do not spell the words (a search that is not this model's)."""
    if kind == "phones" and prons is None:
        if len(runs) != len(words):
            raise ValueError(f"{len(runs)} phone runs for {len(words)} phones")
        return [(w, a, b) for w, (_, a, b) in zip(words, runs)]
    if kind == "phones":
        return _phone_words(words, runs, symbols, prons)
    letters = []    # (letter, run index) of every letter the runs write, in order
    for i, (k, _, _) in enumerate(runs):
        text = "" if symbols[k] == SPACE else str(symbols[k]).replace(WORD_START, "")
        letters += [(c, i) for c in text]
    if "".join(c for c, _ in letters) != "".join(words):
        raise ValueError(f"the emitted tokens spell {''.join(c for c, _ in letters)!r}, "
                         f"not the words {' '.join(words)!r}")
    out, pos = [], 0
    for word in words:
        first, last = letters[pos][1], letters[pos + len(word) - 1][1]
        if first and symbols[runs[first - 1][0]] == WORD_START:
            first -= 1      # a bare `▁` piece begins the word after it
        out.append((word, runs[first][1], runs[last][2]))
        pos += len(word)
    return out


def _phone_words(words, runs, symbols, prons):
    out, pos = [], 0
    phones = [symbols[k] for k, _, _ in runs]
    for word in words:
        for variant in prons.get(word, []):
            variant = [p for p in variant if p != SIL]
            if phones[pos:pos + len(variant)] == variant:
                out.append((word, runs[pos][1], runs[pos + len(variant) - 1][2]))
                pos += len(variant)
                break
        else:
            raise ValueError(f"no pronunciation of {word!r} matches the phones "
                             f"{' '.join(phones[pos:pos + 6])} ...")
    return out


def read_lexicon(path):
    """A graph's lexicon.txt -> {word: [phone tuples]} (its variants in file order)."""
    prons = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            p = line.split()
            if len(p) >= 2:
                prons.setdefault(p[0], []).append(tuple(p[1:]))
    return prons


def ctm_lines(utt, spans, frame_s):
    """`utt 1 start duration word` lines; frame_s: seconds per output frame."""
    return "".join(f"{utt} 1 {a * frame_s:.3f} {(b + 1 - a) * frame_s:.3f} {w}\n"
                   for w, a, b in spans)


def read_ctm(path):
    """{utt: [(word, start s)]} in file order, silence (a phone CTM's SIL) left out."""
    out = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            p = line.split()
            if len(p) >= 5 and p[4] != SIL:
                out.setdefault(p[0], []).append((p[4], float(p[2])))
    return out


def start_errors(hyp, ref):
    """|hyp start - ref start| in seconds of every word recognised correctly: hyp, ref
    {utt: [(word, start)]}, the words of each utterance aligned by edit distance."""
    import kaldialign
    errors = []
    for utt, h in hyp.items():
        r = ref.get(utt)
        if not r or not h:
            continue
        pairs = kaldialign.align([w for w, _ in r], [w for w, _ in h], "*")
        i = j = 0
        for a, b in pairs:
            if a != "*" and b != "*":
                if a == b:
                    errors.append(abs(h[j][1] - r[i][1]))
            i += a != "*"
            j += b != "*"
    return np.asarray(errors, np.float64)


def timing_summary(errors):
    """{words, median_ms, p90_ms, mean_ms} of start errors in seconds."""
    if not len(errors):
        return {"words": 0, "median_ms": float("nan"), "p90_ms": float("nan"),
                "mean_ms": float("nan")}
    return {"words": int(len(errors)), "median_ms": 1000 * float(np.median(errors)),
            "p90_ms": 1000 * float(np.percentile(errors, 90)),
            "mean_ms": 1000 * float(errors.mean())}
