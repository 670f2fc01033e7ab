"""Rebuild the bundled demo corpus from the full development corpora (run once; output committed).

    python data_prep/demo/make_demo.py ../shared/data data_prep/demo

so762/: 40 speakers x 5 utterances of so762_dev (every 3rd speaker in sorted order, first five
utterances of each in sorted order), FLAC copied byte for byte, phones.ctm filtered.
fsdd/:  4 speakers x 10 utterances of fsdd_dev (digits 0-9, repetition 0) plus two of the six
utterances whose forced alignment failed (no .phn file): a real missing-alignment case.
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


if __name__ == "__main__":
    main(*sys.argv[1:3])
