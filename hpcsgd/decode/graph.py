"""Decoding graphs, built with OpenFst (kaldifst): HLG for hybrid models, TLG for CTC models.

    G  an n-gram over words or phones (ARPA -> FST by Kaldi's arpa2fst, the `kaldilm`
       package; backoff arcs read #0), or a grammar of isolated words (digits)
    L  phones (or CTC tokens) -> words, Kaldi's lexicon FST: optional silence between words,
       #1, #2, ... after a pronunciation that is another's prefix or homophone, so that L o G
       determinizes
    H  HMM states -> phones: each phone is `states` states in a row, each with a self-loop,
       all states of a phone scored by the phone's one network output (a minimum duration of
       `states` frames); the loop probability from the phone's mean duration in training
    T  CTC frames -> tokens: k2/icefall's standard (not the modified) CTC topology

    HLG = H o min(det(L o G))   (Kaldi's fsttablecompose | fstdeterminizestar --use-log=true
    TLG = T o min(det(L o G))    | fstminimizeencoded, then composed with H or T on the left)

H's input labels are HMM states, 1-based: state s of phone p is p * states + s + 1, so that
every input label names one state (the best path gives a state alignment), and the decoder's
score matrix is the network's (T, P) scaled log-likelihoods with each column repeated `states`
times (hpcsgd/decode/search.py). H reads nothing and writes each disambiguation symbol at its
hub, between phones, where L and G put them: that consumes them in H o LG. HLG is not
determinized at the H level (Kaldi does so before adding the self-loops, which needs its
transition model); the beam search takes a non-deterministic graph as it is.

T's input labels are token id + 1 for every token, the blank (id 0) included, so that input
label i is column i - 1 of the CTC model's (T', V) matrix as kaldi-decoder reads it; its output
labels are the token ids (the blank writes nothing). T writes the disambiguation symbols on
self-loops that read nothing at every state: a word boundary can fall after any token without
a frame of its own, and they are consumed in T o LG as in H o LG.

Symbol tables are Kaldi's: phones.txt (<eps> 0, the labels 1.., #0, #1, ...) or, for CTC,
tokens.txt (<eps> 0 in the blank's place, the tokens 1.. with their archive ids, #0, #1, ...),
and words.txt (<eps> 0, the words 1.., #0, <s>, </s>). For phone error rates the "words" are
the phones themselves (L maps each phone to itself, SIL included in HLG: the phone n-gram
places the silences).
"""
import contextlib
import math
import os
import sys

from hpcsgd.errors import UserError

EPS = "<eps>"
DETERMINIZE_MAX_STATES = 5_000_000
LOOP_MAX = 0.95     # a phone's self-loop probability at most (a 60-frame mean at 3 states)


def _fst():
    try:
        import kaldifst
    except ImportError:
        raise UserError("decoding graphs need the `kaldifst` package (pip install kaldifst)") \
            from None
    return kaldifst


def disambiguate(lexicon):
    """Kaldi's add_lex_disambig: -> ([(word, phones, k)], number of #k symbols needed), k = 0
    for a pronunciation that needs none, else 1.. numbering the words that share it (and one
    more when it is a proper prefix of another pronunciation)."""
    prons = [(w, p) for w in sorted(lexicon) for p in lexicon[w]]
    count = {}
    for _, p in prons:
        count[p] = count.get(p, 0) + 1
    prefixes = {p[:i] for _, p in prons for i in range(1, len(p))}
    entries, used, most = [], {}, 0
    for w, p in prons:
        k = 0
        if count[p] > 1 or p in prefixes:
            used[p] = used.get(p, 0) + 1
            k = used[p]
            most = max(most, k)
        entries.append((w, p, k))
    return entries, most


def make_lexicon_fst(entries, phone_id, word_id, sil_prob, sil_phone, backoff):
    """Kaldi's make_lexicon_fst.py with silence: a start state, a loop state (between words,
    final) and a silence state. The start goes to the loop state reading nothing (1 -
    sil_prob) or one silence (sil_prob). A word leaves the loop state with its first phone
    (the word on that arc) and returns to it directly (1 - sil_prob) or through the silence
    state, which reads one silence (sil_prob). sil_prob None: no optional silence (the phone
    "lexicon" of PER graphs, where SIL is a token of the n-gram, and of CTC graphs without a
    word separator token). For a chars CTC graph the silence is the `<space>` token: a model
    trained on `a <space> b` emits one between words. backoff = (phone #0, word #0): the
    self-loops that let G's backoff symbol through L (Kaldi's fstaddselfloops)."""
    kf = _fst()
    L = kf.StdVectorFst()
    start, loop = L.add_state(), L.add_state()
    L.start = start
    L.set_final(loop, 0.0)
    if sil_prob is None:
        L.add_arc(start, kf.StdArc(0, 0, 0.0, loop))
        no_sil, sil_cost = 0.0, None
    else:
        sil = L.add_state()
        no_sil, sil_cost = -math.log(1.0 - sil_prob), -math.log(sil_prob)
        L.add_arc(start, kf.StdArc(0, 0, no_sil, loop))
        L.add_arc(start, kf.StdArc(phone_id[sil_phone], 0, sil_cost, loop))
        # the silence after a word is read here (it once read nothing, so that no silence
        # between words could be recognized: its frames went to the neighbouring phones)
        L.add_arc(sil, kf.StdArc(phone_id[sil_phone], 0, 0.0, loop))
    for word, phones, k in entries:
        labels = [phone_id[p] for p in phones] + ([phone_id[f"#{k}"]] if k else [])
        src, out = loop, word_id[word]
        for i, label in enumerate(labels):
            last = i == len(labels) - 1
            if not last:
                nxt = L.add_state()
                L.add_arc(src, kf.StdArc(label, out, 0.0, nxt))
            elif sil_cost is None:
                L.add_arc(src, kf.StdArc(label, out, 0.0, loop))
            else:
                L.add_arc(src, kf.StdArc(label, out, no_sil, loop))
                L.add_arc(src, kf.StdArc(label, out, sil_cost, sil))
            src, out = (nxt if not last else None), 0
    kf.add_self_loops(L, [backoff[0]], [backoff[1]])
    return L


def make_hmm_fst(num_phones, states, loop_probs, self_loop_scale, disambig_ids):
    """H: a hub state (start, final); phone p enters its first HMM state reading state label
    p*states+1 and writing phone id p+1, each state loops on its label with weight
    -log(a_p) and advances with -log(1 - a_p) (both times self_loop_scale, Kaldi's
    --self-loop-scale), the last state returns to the hub. The hub reads nothing and writes
    each disambiguation symbol (consumed here)."""
    kf = _fst()
    H = kf.StdVectorFst()
    hub = H.add_state()
    H.start = hub
    H.set_final(hub, 0.0)
    for p in range(num_phones):
        a = loop_probs[p]
        stay = self_loop_scale * -math.log(a) if a > 0 else math.inf
        go = self_loop_scale * -math.log(1.0 - a)
        prev = None
        for s in range(states):
            label = p * states + s + 1
            q = H.add_state()
            if prev is None:
                H.add_arc(hub, kf.StdArc(label, p + 1, 0.0, q))
            else:
                H.add_arc(prev, kf.StdArc(label, 0, go, q))
            if math.isfinite(stay):
                H.add_arc(q, kf.StdArc(label, 0, stay, q))
            prev = q
        H.add_arc(prev, kf.StdArc(0, 0, go, hub))
    for d in disambig_ids:
        H.add_arc(hub, kf.StdArc(0, d, 0.0, hub))
    return H


def make_ctc_topo_fst(num_tokens, disambig_ids):
    """T, k2/icefall's standard CTC topology (ctc_topo, modified=False) over tokens 0..V-1, 0
    the blank: state 0 the blank's (start), state k token k's; every state final. From any
    state, token k (input label k + 1) goes to state k and writes k, except from state k
    itself, where it loops and writes nothing (a repeat continues the token); the blank
    (input label 1) goes to state 0 and writes nothing. So a token sequence is read by
    exactly its CTC alignments: repeats merged, blanks anywhere, a blank needed between two
    equal tokens. Each state loops reading nothing and writing each disambiguation symbol
    (consumed here, as H does at its hub): a word boundary of L o G falls between two tokens
    without a frame of its own. V^2 + V * (disambiguation symbols) arcs: 250k for 500 tokens."""
    kf = _fst()
    T = kf.StdVectorFst()
    for _ in range(num_tokens):
        T.add_state()
    T.start = 0
    for src in range(num_tokens):
        T.set_final(src, 0.0)
        for k in range(num_tokens):
            write = 0 if k == src or k == 0 else k
            T.add_arc(src, kf.StdArc(k + 1, write, 0.0, k))
        for d in disambig_ids:
            T.add_arc(src, kf.StdArc(0, d, 0.0, src))
    return T


def loop_probabilities(mean_frames, states):
    """Each phone's self-loop probability a from its mean duration d in training frames: a
    left-to-right chain of `states` states with geometric stays lasts states / (1 - a) frames
    on average, so a = 1 - states / d (0 for a phone shorter than the minimum on average, at
    most LOOP_MAX)."""
    return [min(max(1.0 - states / d, 0.0), LOOP_MAX) if d > 0 else 0.5 for d in mean_frames]


def grammar_from_arpa(arpa_path, words_txt):
    """G from an ARPA file through Kaldi's arpa2fst (kaldilm): <s>/</s> become epsilons,
    backoff arcs read #0, n-grams with a word outside words.txt are dropped."""
    kf = _fst()
    try:
        import kaldilm
    except ImportError:
        raise UserError("n-gram graphs need the `kaldilm` package (pip install kaldilm)") from None
    with _stderr_to(os.path.join(os.path.dirname(os.path.abspath(words_txt)),
                             "arpa2fst.log")) as log:
        try:   # arpa2fst logs every section it reads on stderr: to a file, shown on failure
            text = kaldilm.arpa2fst(arpa_path, read_symbol_table=words_txt,
                                    disambig_symbol="#0", max_arpa_warnings=0)
        except Exception as err:
            raise UserError(f"{arpa_path}: arpa2fst failed ({err}); its log: {log}") from None
    if not text.strip():
        raise UserError(f"{arpa_path}: arpa2fst made an empty grammar")
    return kf.compile(text)


@contextlib.contextmanager
def _stderr_to(path):
    """File descriptor 2 (where C++ code writes) into `path` for the duration; the file is
    removed when the block succeeds."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield path
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    os.unlink(path)


def grammar_of_words(word_ids):
    """G for one word per utterance (isolated digits): start -> any word, equally likely ->
    final."""
    kf = _fst()
    G = kf.StdVectorFst()
    start, end = G.add_state(), G.add_state()
    G.start = start
    G.set_final(end, 0.0)
    cost = math.log(len(word_ids))
    for w in word_ids:
        G.add_arc(start, kf.StdArc(w, w, cost, end))
    return G


def compose_hlg(H, L, G):
    """HLG = H o min(det(L o G)) (or TLG with T for H); each step connected (trimmed)."""
    kf = _fst()
    kf.arcsort(L, sort_type="olabel")
    kf.arcsort(G, sort_type="ilabel")
    LG = kf.compose(L, G)
    kf.connect(LG)
    # True means "stopped at max_states": a non-determinizable L o G grows without bound
    if kf.determinize_star(LG, use_log=True, max_states=DETERMINIZE_MAX_STATES):
        raise UserError(f"L o G did not determinize within {DETERMINIZE_MAX_STATES} states (a "
                        f"homophone or prefix pronunciation without a disambiguation symbol?)")
    kf.minimize_encoded(LG)
    kf.arcsort(H, sort_type="olabel")
    kf.arcsort(LG, sort_type="ilabel")
    HLG = kf.compose(H, LG)
    kf.connect(HLG)
    if HLG.num_states == 0:
        raise UserError("the decoding graph is empty: no word of the grammar has a pronunciation")
    kf.arcsort(HLG, sort_type="ilabel")
    return HLG


def with_insertion_penalty(fst, penalty):
    """A copy of `fst` with `penalty` added to the cost of every arc that outputs a word (a
    phone graph's phone): Kaldi's word insertion penalty (lattice-add-penalty), here on the
    graph so that one search applies it. Negative: a bonus, for a model that drops tokens."""
    kf = _fst()
    out = kf.StdVectorFst()
    for _ in range(fst.num_states):
        out.add_state()
    out.start = fst.start
    for s in range(fst.num_states):
        final = fst.final(s).value
        if final != math.inf:
            out.set_final(s, final)
        for arc in kf.ArcIterator(fst, s):
            cost = arc.weight.value + (penalty if arc.olabel else 0.0)
            out.add_arc(s, kf.StdArc(arc.ilabel, arc.olabel, cost, arc.nextstate))
    kf.arcsort(out, sort_type="ilabel")
    return out


def fst_size(fst):
    """(states, arcs) of a vector FST."""
    kf = _fst()
    states = fst.num_states
    arcs = sum(fst.num_arcs(s) for s in kf.StateIterator(fst))
    return states, arcs


def write_fst(fst, path):
    """Write under a temporary name in the same directory, then rename."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        fst.write(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_fst(path):
    kf = _fst()
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such graph (make it with `hpcsgd mkgraph`)")
    fst = kf.StdVectorFst.read(path)
    if fst is None:
        raise UserError(f"{path}: not a readable OpenFst file")
    return fst
