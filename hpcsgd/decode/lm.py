"""N-gram language models from training transcripts: interpolated Kneser-Ney, as ARPA text.

The decoding graph's grammar G is an n-gram over words (WER) or phones (PER), estimated from
the training speakers' transcripts or alignments only. The estimate is written as an ARPA
file, the field's exchange format, and turned into an FST by Kaldi's own arpa2fst (the
`kaldilm` package, hpcsgd/decode/graph.py); a user can instead bring an ARPA file made by
SRILM or KenLM (`hpcsgd mkgraph --lm`).

Interpolated Kneser-Ney (Chen & Goodman 1998, one discount per order):

    p_n(w | h) = max(a_n(h w) - D_n, 0) / a_n(h .)  +  gamma(h) p_{n-1}(w | h')
    gamma(h)   = D_n N1+(h .) / a_n(h .)            (h' = h without its first word)

a_n is the raw count at the highest order and for n-grams that begin with <s>, else the
continuation count N1+(. h w) (how many distinct words precede it); D_n = n1 / (n1 + 2 n2)
from the counts of counts; p_0 is uniform over the vocabulary. In ARPA terms every n-gram
seen in training is listed with log10 p_n(w | h), and gamma(h) is exactly h's backoff
weight (an unlisted h w gets gamma(h) p_{n-1}(w | h') either way).
"""
import math
from collections import defaultdict

from hpcsgd.errors import UserError

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
LOG10_ZERO = -99.0   # ARPA's log10 probability of <s> (never predicted)


def estimate(sentences, order=2):
    """-> {"order": N, "vocab": sorted words (</s> included, <s> not), "ngrams": {n: {ngram
    tuple: (log10 p, log10 backoff)}}} from lists of tokens (words or phones)."""
    if order < 1:
        raise UserError(f"n-gram order {order}: need >= 1")
    raw = [defaultdict(int) for _ in range(order + 1)]     # raw[n][ngram]
    for tokens in sentences:
        padded = [BOS, *tokens, EOS]
        for n in range(1, order + 1):
            for i in range(len(padded) - n + 1):
                raw[n][tuple(padded[i:i + n])] += 1
    vocab = sorted({g[0] for g in raw[1]} - {BOS})
    if vocab == [EOS]:
        raise UserError("no tokens to estimate an n-gram model from (empty transcripts)")
    adjusted = _adjusted_counts(raw, order)
    ngrams = {n: {} for n in range(1, order + 1)}
    # p_{n-1} of every n-gram the next order needs, as plain probabilities
    uniform = 1.0 / len(vocab)
    lower = {}
    for n in range(1, order + 1):
        counts = adjusted[n]
        discount = _discount(counts)
        totals, types = defaultdict(float), defaultdict(int)
        for g, c in counts.items():
            totals[g[:-1]] += c
            types[g[:-1]] += 1
        probs = {}
        for g, c in counts.items():
            h = g[:-1]
            gamma = discount * types[h] / totals[h]
            # g[1:] is always listed one order down: it was seen, after g's first word
            below = uniform if n == 1 else lower[g[1:]]
            probs[g] = max(c - discount, 0.0) / totals[h] + gamma * below
        if n == 1:    # every vocabulary word is a unigram, seen or not (p_0 gives it mass)
            gamma = discount * types[()] / totals[()]
            for w in vocab:
                probs.setdefault((w,), gamma * uniform)
        for g, p in probs.items():
            ngrams[n][g] = (math.log10(p), 0.0)
        if n == 1:
            ngrams[1][(BOS,)] = (LOG10_ZERO, 0.0)
        else:         # gamma(h) is the backoff weight of the (n-1)-gram h
            for h, total in totals.items():
                ngrams[n - 1][h] = (ngrams[n - 1][h][0], math.log10(discount * types[h] / total))
        lower = probs
    return {"order": order, "vocab": vocab, "ngrams": ngrams}


def _adjusted_counts(raw, order):
    """Kneser-Ney's counts: raw at the top order and for n-grams starting with <s>, else the
    number of distinct words seen before the n-gram."""
    adjusted = {order: dict(raw[order])}
    adjusted[order].pop((BOS,), None)    # a unigram model: <s> is context, never predicted
    for n in range(1, order):
        preceded = defaultdict(int)
        for g in raw[n + 1]:
            preceded[g[1:]] += 1
        adjusted[n] = {g: (c if g[0] == BOS else preceded[g]) for g, c in raw[n].items()
                       if g[0] == BOS or preceded[g] > 0}
        adjusted[n].pop((BOS,), None)
    return adjusted


def _discount(counts):
    """Ney's absolute discount n1 / (n1 + 2 n2), kept inside (0.1, 0.9): a tiny corpus can have
    no n-gram seen twice."""
    n1 = sum(1 for c in counts.values() if c == 1)
    n2 = sum(1 for c in counts.values() if c == 2)
    return min(max(n1 / (n1 + 2 * n2) if n1 + n2 else 0.5, 0.1), 0.9)


def logprob(ngrams, g):
    """log10 p(g[-1] | g[:-1]) of an ARPA model (ngrams as estimate() gives them)."""
    n = len(g)
    while n not in ngrams:
        g, n = g[1:], n - 1
    if g in ngrams[n]:
        return ngrams[n][g][0]
    if n == 1:
        raise KeyError(g[0])
    h = g[:-1]
    bow = ngrams[n - 1][h][1] if h in ngrams[n - 1] else 0.0
    return bow + logprob(ngrams, g[1:])


def perplexity(model, sentences):
    """-> (perplexity over the words and </s> of sentences, number of OOV tokens skipped).
    An OOV token (not in the model's vocabulary; <unk> when the model has it) is not scored
    and the history restarts after it, as SRILM's ngram -ppl does."""
    vocab = set(model["vocab"])
    has_unk = UNK in vocab
    total, scored, oov = 0.0, 0, 0
    for tokens in sentences:
        history = [BOS]
        for w in [*tokens, EOS]:
            if w not in vocab:
                if not has_unk:
                    oov += 1
                    history = [BOS]
                    continue
                w = UNK
            g = tuple(history[-(model["order"] - 1):] + [w]) if model["order"] > 1 else (w,)
            total += logprob(model["ngrams"], g)
            scored += 1
            history.append(w)
    return 10.0 ** (-total / max(scored, 1)), oov


def arpa_text(model):
    """The model as an ARPA file's text (\\data\\ header, one section per order)."""
    ngrams = model["ngrams"]
    lines = ["", "\\data\\"]
    lines += [f"ngram {n}={len(ngrams[n])}" for n in sorted(ngrams)]
    for n in sorted(ngrams):
        lines += ["", f"\\{n}-grams:"]
        top = n == model["order"]
        for g in sorted(ngrams[n]):
            p, bow = ngrams[n][g]
            words = " ".join(g)
            lines.append(f"{p:.7f}\t{words}" if top else f"{p:.7f}\t{words}\t{bow:.7f}")
    lines += ["", "\\end\\", ""]
    return "\n".join(lines)


def read_arpa(path):
    """An ARPA file -> the model dict estimate() returns (for perplexity and the vocabulary of
    a user's own LM). Errors name the file and line."""
    ngrams, order, section = {}, 0, None
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("ngram ") or line == "\\data\\":
                continue
            if line == "\\end\\":
                break
            if line.startswith("\\") and line.endswith("-grams:"):
                section = int(line[1:-len("-grams:")])
                ngrams[section] = {}
                order = max(order, section)
                continue
            parts = line.split()
            if section is None or len(parts) not in (section + 1, section + 2):
                raise UserError(f"{path}:{lineno}: not an ARPA n-gram line: {line!r}")
            try:
                p = float(parts[0])
                bow = float(parts[section + 1]) if len(parts) == section + 2 else 0.0
            except ValueError:
                raise UserError(f"{path}:{lineno}: not an ARPA n-gram line: {line!r}") from None
            ngrams[section][tuple(parts[1:section + 1])] = (p, bow)
    if not ngrams.get(1):
        raise UserError(f"{path}: no \\1-grams: section (not an ARPA file?)")
    vocab = sorted({g[0] for g in ngrams[1]} - {BOS})
    return {"order": order, "vocab": vocab, "ngrams": ngrams}
