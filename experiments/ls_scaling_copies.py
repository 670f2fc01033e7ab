"""A Kaldi data directory listing Mini LibriSpeech's training speakers COPIES times (utterance
and speaker ids prefixed r0-, r1-, ...; the same FLAC files, no audio copied) and the dev
speakers once, for experiments/ls_scaling.sh: `hpcsgd prep` on it (with --speed-perturb for
more) makes an archive COPIES times the size from the same 4.3 h.

    python experiments/ls_scaling_copies.py LibriSpeech/train-clean-5 TRAIN_SPK DEV_SPK COPIES OUT
Writes OUT/{wav.scp,utt2spk,text,spk2gender} and OUT/cv_speakers.txt (the dev speakers' ids).
"""
import os
import sys

from data_prep import librispeech


def main(subset, train_list, dev_list, copies, out):
    def ids(path):
        with open(path, encoding="utf-8") as f:
            return [line.split()[0] for line in f if line.strip()]
    train, dev = ids(train_list), ids(dev_list)
    utts, problems, text = librispeech.read_subset(subset, set(train) | set(dev))
    assert not problems, problems[:3]
    gender = librispeech.read_genders(subset)
    rows = []   # (utt, spk, path, words)
    for u, info in utts.items():
        prefixes = [f"r{i}-" for i in range(copies)] if info["spk"] in train else [""]
        rows += [(p + u, p + info["spk"], info["path"], text[u]) for p in prefixes]
    rows.sort()
    os.makedirs(out, exist_ok=True)
    with open(f"{out}/wav.scp", "w") as w, open(f"{out}/utt2spk", "w") as s, \
            open(f"{out}/text", "w") as t:
        for utt, spk, path, words in rows:
            w.write(f"{utt} {os.path.abspath(path)}\n")
            s.write(f"{utt} {spk}\n")
            t.write(f"{utt} {' '.join(words)}\n")
    with open(f"{out}/spk2gender", "w") as g:
        for spk in sorted({r[1] for r in rows}):
            g.write(f"{spk} {gender[spk.split('-')[-1]]}\n")
    with open(f"{out}/cv_speakers.txt", "w") as c:
        c.write("".join(f"{s}\n" for s in dev))
    print(f"{out}: {len(rows)} utterances ({copies} copies of {len(train)} training speakers, "
          f"{len(dev)} dev speakers once)")


if __name__ == "__main__":
    main(*sys.argv[1:4], int(sys.argv[4]), sys.argv[5])
