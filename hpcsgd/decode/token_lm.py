"""A token n-gram for shallow fusion in the RNN-T beam search (hpcsgd/decode/rnnt.py).

Shallow fusion (icefall's modified_beam_search_lm_shallow_fusion, with an n-gram in place of
its neural LM) adds `lm_weight * ln P_lm(k | history)` to the score of every non-blank token k
a hypothesis is extended by, and `lm_weight * ln P_lm(</s> | history)` when the final
hypotheses are ranked. The LM is an ARPA backoff n-gram over the model's own tokens (BPE
pieces, characters or phones): estimated from the training archive's token sequences
(hpcsgd/decode/lm.py's interpolated Kneser-Ney), or a user's ARPA file over the same symbols.

The search asks for a whole row at once, ln P(k | h) for every token k of the inventory, so a
history costs one vector, built by the backoff recursion

    row(h) = bow(h) + row(h without its first token), then the n-grams listed after h overwrite

and kept in a cache (a beam's hypotheses keep their histories over many frames). Tokens the
LM never saw get the smallest unigram log-probability; the blank (column 0) gets 0: a blank
extension is not scored by the LM.
"""
import math
import os

import numpy as np

from hpcsgd.data import archive
from hpcsgd.decode.lm import BOS, EOS
from hpcsgd.errors import UserError

LN10 = math.log(10.0)
CACHE_ROWS = 200_000     # histories kept (x V float64 each): cleared when full
START = -1               # <s> in a history of token ids


def load(arpa_path, order, meta):
    """The fusion LM of `decode`: an ARPA file over the model's tokens, or an n-gram of `order`
    estimated from the token sequences of the model's training archive (its data.train)."""
    from hpcsgd.decode import lm, mkgraph
    tokens = meta["tokens"]
    if arpa_path:
        return TokenLM(lm.read_arpa(arpa_path), tokens["symbols"], arpa_path)
    train = (meta.get("config") or {}).get("data.train")
    if not train or not os.path.isfile(os.path.join(train, archive.INDEX_NAME)):
        raise UserError(f"--lm-order {order}: the model's training archive ({train}) is not "
                        f"readable here; give an ARPA n-gram over its tokens with --lm")
    symbols, utts = mkgraph.archive_tokens(train, tokens["kind"])
    if archive.inventory_hash(symbols) != tokens["inventory_hash"]:
        raise UserError(f"{train}: its {tokens['kind']} tokens are not the model's (inventory "
                        f"{archive.inventory_hash(symbols)}, the model's "
                        f"{tokens['inventory_hash']})")
    model = lm.estimate([[symbols[i] for i in ids] for _, ids in utts], order)
    return TokenLM(model, tokens["symbols"],
                   f"a {order}-gram of the {tokens['kind']} tokens of {train}")


class TokenLM:
    def __init__(self, model, symbols, source="the LM"):
        """model: lm.estimate()'s or lm.read_arpa()'s dict over token symbols; symbols: the
        acoustic model's inventory, the blank first."""
        ngrams, self.order = model["ngrams"], model["order"]
        col = {s: i for i, s in enumerate(symbols)}
        col[BOS] = START
        known = [s for s in symbols[1:] if (s,) in ngrams[1]]
        if not known:
            raise UserError(f"{source}: none of the model's tokens is in its vocabulary "
                            f"({', '.join(model['vocab'][:5])} ...): an LM over other symbols")
        self.source, self.vocab_size = source, len(symbols)
        self.unigram = np.zeros(len(symbols))
        floor = min(p for (w,), (p, _) in ngrams[1].items() if w in col and w != BOS) * LN10
        self.unigram[1:] = floor
        self.bow, self.listed, self.eos = {}, {}, {}
        for n in sorted(ngrams):
            for g, (p, b) in ngrams[n].items():
                if any(w not in col for w in g[:-1]) or (g[-1] not in col and g[-1] != EOS):
                    continue     # an n-gram over symbols the model cannot output
                ids = tuple(col[w] for w in g[:-1])
                if n < self.order and g[-1] != EOS:     # </s> is never a history
                    self.bow[ids + (col[g[-1]],)] = b * LN10
                if g[-1] == EOS:
                    self.eos[ids] = p * LN10
                elif n == 1:
                    if g[0] != BOS:      # <s> is never predicted
                        self.unigram[col[g[0]]] = p * LN10
                else:
                    self.listed.setdefault(ids, []).append((col[g[-1]], p * LN10))
        self.listed = {h: (np.array([k for k, _ in e]), np.array([p for _, p in e]))
                       for h, e in self.listed.items()}
        self.eos_floor = min(self.eos.values(), default=floor)
        self._rows = {}

    def context(self, tokens):
        """The history the next token is scored after: <s> and the last order-1 tokens."""
        h = (START, *tokens)
        return h[len(h) - (self.order - 1):] if self.order > 1 else ()

    def row(self, history):
        """(V,) ln P(k | history) for every token k (history: a context())."""
        got = self._rows.get(history)
        if got is not None:
            return got
        if not history:
            return self.unigram
        v = self.bow.get(history, 0.0) + self.row(history[1:])    # a new array
        v[0] = 0.0                                                 # the blank: not scored
        entries = self.listed.get(history)
        if entries is not None:
            v[entries[0]] = entries[1]
        if len(self._rows) >= CACHE_ROWS:
            self._rows.clear()
        self._rows[history] = v
        return v

    def final(self, history):
        """ln P(</s> | history)."""
        cost = 0.0
        while True:
            if history in self.eos:
                return cost + self.eos[history]
            if not history:
                return cost + self.eos_floor
            cost += self.bow.get(history, 0.0)
            history = history[1:]
