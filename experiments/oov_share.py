"""How much of a word error rate the out-of-vocabulary words make: the reference words the
training transcripts never had, aligned against a decode's hypotheses (kaldialign).

    python experiments/oov_share.py DECODE_DIR TRAIN_ARCHIVE

DECODE_DIR is `hpcsgd decode`'s output (ref.txt, hyp.txt). Prints the OOV rate, the errors
on OOV reference words (each substitution or deletion of one), the share of all errors they
are, and the WER the in-vocabulary words alone would have (errors outside OOV words over the
in-vocabulary reference words; insertions counted there).
"""
import os
import sys

import kaldialign

from hpcsgd.decode import mkgraph


def read(path):
    with open(path, encoding="utf-8") as f:
        return {p[0]: p[1:] for p in (line.split() for line in f) if p}


def main(decode_dir, train_archive):
    vocab = {w for words in mkgraph.archive_text(train_archive).values() for w in words}
    refs, hyps = read(os.path.join(decode_dir, "ref.txt")), read(os.path.join(decode_dir, "hyp.txt"))
    words = oov = oov_err = errors = ins = 0
    for utt, ref in refs.items():
        for a, b in kaldialign.align(ref, hyps.get(utt, []), "*"):
            if a == "*":
                ins += 1
                errors += 1
                continue
            words += 1
            wrong = a != b
            errors += wrong
            if a not in vocab:
                oov += 1
                oov_err += wrong
    print(f"{decode_dir}: {words} reference words, {oov} OOV ({100 * oov / words:.2f}%); "
          f"WER {100 * errors / words:.2f}; errors on OOV words {oov_err} of {errors} "
          f"({100 * oov_err / max(errors, 1):.1f}% of the errors; {100 * oov_err / max(oov, 1):.1f}% "
          f"of the OOV words wrong); in-vocabulary WER {100 * (errors - oov_err) / (words - oov):.2f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
