"""Rebuild the bundled demo corpus from the full development corpora (run once; output committed).

    python data_prep/demo/make_demo.py ../shared/data data_prep/demo [LibriSpeech/train-clean-5]

so762/: 40 speakers x 5 utterances of so762_dev (every 3rd speaker in sorted order, first five
utterances of each in sorted order), FLAC copied byte for byte, phones.ctm filtered.
fsdd/:  4 speakers x 10 utterances of fsdd_dev (digits 0-9, repetition 0) plus two of the six
utterances whose forced alignment failed (no .phn file): a real missing-alignment case.
librispeech/: 6 of Mini LibriSpeech's 21 training speakers (../shared/data/librispeech_mini:
its train_speakers.txt; never a reserved speaker) x their 4 shortest utterances, in
LibriSpeech's own layout: FLAC byte for byte, each chapter's trans.txt and SPEAKERS.TXT
filtered, LICENSE.TXT copied. Only when the fetched subset's path is given.
"""
import os
import shutil
import sys


def read_map(path):
    with open(path) as f:
        return [line.rstrip("\n").split(maxsplit=1) for line in f if line.strip()]


def write_map(path, rows):
    with open(path, "w") as f:
        f.writelines(f"{k} {v}\n" for k, v in rows)


def copy_dir(src, dst, utts, speakers, per_utt_files, per_spk_files):
    os.makedirs(os.path.join(dst, "flac"), exist_ok=True)
    keep = set(utts)
    for name in per_utt_files:
        write_map(os.path.join(dst, name),
                  [r for r in read_map(os.path.join(src, name)) if r[0] in keep])
    for name in per_spk_files:
        write_map(os.path.join(dst, name),
                  [r for r in read_map(os.path.join(src, name)) if r[0] in speakers])
    for utt, path in read_map(os.path.join(src, "wav.scp")):
        if utt in keep:
            shutil.copyfile(os.path.join(src, path), os.path.join(dst, path))
    shutil.copyfile(os.path.join(src, "labels.txt"), os.path.join(dst, "labels.txt"))


def main(shared, out):
    src = os.path.join(shared, "so762_dev")
    utt2spk = read_map(os.path.join(src, "utt2spk"))
    speakers = sorted({s for _, s in utt2spk})[::3][:40]
    utts = []
    for spk in speakers:
        utts += sorted(u for u, s in utt2spk if s == spk)[:5]
    dst = os.path.join(out, "so762")
    copy_dir(src, dst, utts, set(speakers), ["wav.scp", "utt2spk", "text"],
             ["spk2gender", "spk2age"])
    keep = set(utts)
    with open(os.path.join(src, "phones.ctm")) as f, open(os.path.join(dst, "phones.ctm"), "w") as g:
        g.writelines(line for line in f if line.split()[0] in keep)

    src = os.path.join(shared, "fsdd_dev")
    speakers = ["george", "jackson", "lucas", "nicolas"]
    utts = [f"{d}_{s}_0" for s in speakers for d in range(10)] + ["6_george_19", "6_nicolas_5"]
    dst = os.path.join(out, "fsdd")
    copy_dir(src, dst, utts, set(speakers), ["wav.scp", "utt2spk", "text", "utt2digit"], [])
    os.makedirs(os.path.join(dst, "phn"), exist_ok=True)
    for utt in utts:
        phn = os.path.join(src, "phn", f"{utt}.phn")
        if os.path.exists(phn):
            shutil.copyfile(phn, os.path.join(dst, "phn", f"{utt}.phn"))


LIBRISPEECH_SPEAKERS = 6    # the training speakers with the shortest utterances
LIBRISPEECH_UTTS = 4        # per speaker, the shortest files


def make_librispeech(shared, subset, out):
    """The bundled LibriSpeech subset (see the module docstring)."""
    with open(os.path.join(shared, "librispeech_mini", "train_speakers.txt")) as f:
        train = [line.split()[0] for line in f if line.strip()]
    files = {}
    for spk in train:
        for chapter in sorted(os.listdir(os.path.join(subset, spk))):
            here = os.path.join(subset, spk, chapter)
            files.setdefault(spk, []).extend(os.path.join(here, n) for n in sorted(os.listdir(here))
                                             if n.endswith(".flac"))
    shortest = {spk: sorted(paths, key=lambda p: (os.path.getsize(p), p))[:LIBRISPEECH_UTTS]
                for spk, paths in files.items()}
    speakers = sorted(train, key=lambda s: (sum(map(os.path.getsize, shortest[s])), s))
    speakers = sorted(speakers[:LIBRISPEECH_SPEAKERS], key=int)
    root = os.path.join(out, "librispeech")
    dst_subset = os.path.join(root, os.path.basename(os.path.normpath(subset)))
    for spk in speakers:
        by_chapter = {}
        for path in shortest[spk]:
            by_chapter.setdefault(os.path.basename(os.path.dirname(path)), []).append(path)
        for chapter, paths in sorted(by_chapter.items()):
            dst = os.path.join(dst_subset, spk, chapter)
            os.makedirs(dst, exist_ok=True)
            keep = {os.path.basename(p)[:-len(".flac")] for p in paths}
            for path in paths:
                shutil.copyfile(path, os.path.join(dst, os.path.basename(path)))
            trans = f"{spk}-{chapter}.trans.txt"
            with open(os.path.join(subset, spk, chapter, trans)) as f, \
                    open(os.path.join(dst, trans), "w") as g:
                g.writelines(line for line in f if line.split() and line.split()[0] in keep)
    parent = os.path.dirname(os.path.abspath(subset))
    with open(os.path.join(parent, "SPEAKERS.TXT")) as f, \
            open(os.path.join(root, "SPEAKERS.TXT"), "w") as g:
        g.writelines(line for line in f if line.startswith(";") or line.split("|")[0].strip() in speakers)
    shutil.copyfile(os.path.join(parent, "LICENSE.TXT"), os.path.join(root, "LICENSE.TXT"))


if __name__ == "__main__":
    if len(sys.argv) > 3:
        make_librispeech(sys.argv[1], sys.argv[3], sys.argv[2])
    else:
        main(*sys.argv[1:3])
