"""CTC outputs: greedy search, and token sequences turned into the words they spell.

A CTC model gives per utterance a (T', V) matrix of log-posteriors over the archive's token
inventory, column 0 the blank `<blk>` (hpcsgd/data/archive.py), T' the frames after the
model's subsampling. Greedy search (icefall's `greedy_search` for CTC) takes the best token
of each frame, merges repeats and drops blanks: `a a <blk> a b b` -> `a a b`. A blank between
two equal tokens is what keeps them two. The graph search is hpcsgd/decode/search.py on TLG.

Tokens to words, per inventory kind:

    chars   letters joined, words split at `<space>`    (h i <space> y o u -> hi you)
    bpe     sentencepiece pieces joined, a new word at each `▁`   (▁hi ▁y ou -> hi you)
    phones  the phones themselves (phone error rate: no words)
"""
import numpy as np

SPACE = "<space>"       # the chars inventories' word separator
WORD_START = "\u2581"   # sentencepiece's "▁": the piece begins a word


def greedy_search(logpost, blank=0):
    """(T', V) log-posteriors -> int64 token ids: each frame's best token (the first on a
    tie, NumPy's argmax), runs of one token merged, blanks dropped."""
    best = np.asarray(logpost).argmax(axis=1)
    keep = best != blank
    keep[1:] &= best[1:] != best[:-1]     # a token equal to the frame before continues it
    return best[keep].astype(np.int64)


def tokens_to_words(tokens, kind):
    """Token symbols (no blanks) -> the words they spell (chars, bpe) or the phones (phones)."""
    if kind == "phones":
        return list(tokens)
    if kind == "chars":
        return "".join(" " if t == SPACE else t for t in tokens).split()
    if kind == "bpe":
        return "".join(tokens).replace(WORD_START, " ").split()
    raise ValueError(f"token kind {kind!r}: not phones, chars or bpe")
