"""Error rates as Kaldi's compute-wer prints them, counted by kaldialign's edit distance.

    %WER 12.34 [ 123 / 1000, 10 ins, 20 del, 93 sub ]
    %SER 45.67 [ 71 / 156 ]

(%PER for phone graphs, whose tokens are phones; silence is not a token of either side;
%CER for CTC models over characters or word pieces: the characters of the words, the spaces
between words not counted, as Kaldi's score_kaldi_cer.sh splits words into characters), and
how far to trust them: the 95% confidence interval of a bootstrap over utterances (Bisani &
Ney 2004, Kaldi's compute-wer-bootci, through kaldialign), and the probability that one
system's hypotheses are better than another's on the same utterances.
"""
import numpy as np

FIELDS = ("ins", "del", "sub", "ref", "utts", "utts_wrong")


def counts(ref, hyp):
    """One utterance's [ins, del, sub, ref tokens, 1, 1 if any error] (int64)."""
    import kaldialign
    d = kaldialign.edit_distance(ref, hyp)
    wrong = int(d["ins"] + d["del"] + d["sub"] > 0)
    return np.array([d["ins"], d["del"], d["sub"], len(ref), 1, wrong], np.int64)


def characters(words):
    """A word sequence as the characters of its words for the CER: the boundaries between
    words are not characters (Kaldi's score_kaldi_cer.sh), so a word split in two or two run
    together costs no character error, and a wrong letter costs one, however long its word."""
    return [c for word in words for c in word]


def characters_of(refs, hyps):
    """({utt: characters} of the references, likewise of the hypotheses)."""
    return ({u: characters(w) for u, w in refs.items()},
            {u: characters(w) for u, w in hyps.items()})


def error_rate(total):
    """Errors over reference tokens, in percent (100 * errors when there are none)."""
    ins, dels, sub, ref = (int(x) for x in total[:4])
    return 100.0 * (ins + dels + sub) / max(ref, 1)


def kaldi_lines(name, total):
    ins, dels, sub, ref, utts, wrong = (int(x) for x in total)
    return (f"%{name} {error_rate(total):.2f} [ {ins + dels + sub} / {ref}, {ins} ins, "
            f"{dels} del, {sub} sub ]\n"
            f"%SER {100.0 * wrong / max(utts, 1):.2f} [ {wrong} / {utts} ]")


def as_dict(name, total):
    ins, dels, sub, ref, utts, wrong = (int(x) for x in total)
    return {"metric": name, "error_rate": error_rate(total), "errors": ins + dels + sub,
            "ins": ins, "del": dels, "sub": sub, "ref_tokens": ref, "utterances": utts,
            "sentence_error_rate": 100.0 * wrong / max(utts, 1)}


BOOTSTRAP_REPLICATIONS = 10_000   # Kaldi's compute-wer-bootci default; a fixed seed: the same CI each run


def bootstrap(refs, hyps, hyps2=None):
    """refs, hyps: token lists of the same utterances in the same order. -> (low, high) of the
    error rate's 95% confidence interval in percent; with hyps2, also the probability that
    hyps2 is better than hyps."""
    import kaldialign
    out = kaldialign.bootstrap_wer_ci(refs, hyps, hyps2, replications=BOOTSTRAP_REPLICATIONS,
                                      seed=0)
    first = out["system1"] if hyps2 is not None else out
    interval = (100.0 * first["ci95min"], 100.0 * first["ci95max"])
    return (interval, out["p_s2_improv_over_s1"]) if hyps2 is not None else interval
