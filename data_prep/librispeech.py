"""LibriSpeech's own layout as a corpus, read as it is on disk (no Kaldi data directory needed).

    SUBSET/<speaker>/<chapter>/<speaker>-<chapter>-<n>.flac
    SUBSET/<speaker>/<chapter>/<speaker>-<chapter>.trans.txt     `<utt-id> WORDS ...` per line
    SPEAKERS.TXT (in SUBSET or its parent)                       `ID | SEX | SUBSET | MINUTES | NAME`

SUBSET is e.g. LibriSpeech/train-clean-5 or LibriSpeech/dev-clean. Utterance ids are the file
names (`19-198-0001`), speakers the directory names. What cannot be used is named, per
utterance, and counted against prep's --max-bad-fraction like any skipped utterance: a chapter
without its trans.txt (each of its files), a transcript line without its audio, audio without
its line. A malformed transcript line (an id of another chapter, a repeated id) is fatal: the
file is not LibriSpeech's.
"""
import glob
import os

from data_prep import kaldi_dir
from hpcsgd.errors import UserError

TRANS_SUFFIX = ".trans.txt"
SPEAKERS_NAME = "SPEAKERS.TXT"


def is_subset(path):
    """True when `path` looks like a LibriSpeech subset: no wav.scp, and some <speaker>/<chapter>/
    directory holding FLAC files or a trans.txt."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "wav.scp")):
        return False
    for spk in _numbered(path):
        for chapter in _numbered(os.path.join(path, spk)):
            here = os.path.join(path, spk, chapter)
            if glob.glob(os.path.join(here, "*.flac")) or glob.glob(os.path.join(here, "*" + TRANS_SUFFIX)):
                return True
    return False


def read_subset(subset_dir, speakers=None):
    """-> (utts, problems, text): utts maps utt -> dict(spk, path, start, end) in sorted order,
    text maps utt -> [words], problems lists (utt, reason, detail) as kaldi_dir.read_data_dir's.
    speakers: the speaker ids to keep (None: all); one the subset lacks is an error."""
    present = _numbered(subset_dir)
    if speakers is not None:
        lacking = sorted(set(speakers) - set(present))
        if lacking:
            raise UserError(f"--speakers: {len(lacking)} speakers are not in {subset_dir}: "
                            f"{' '.join(lacking[:10])}{' ...' if len(lacking) > 10 else ''}")
        present = [s for s in present if s in set(speakers)]
    utts, problems, text = {}, [], {}
    for spk in present:
        for chapter in _numbered(os.path.join(subset_dir, spk)):
            here = os.path.join(subset_dir, spk, chapter)
            audio = {os.path.basename(p)[:-len(".flac")]: p
                     for p in glob.glob(os.path.join(here, "*.flac"))}
            trans = os.path.join(here, f"{spk}-{chapter}{TRANS_SUFFIX}")
            lines = _read_trans(trans, f"{spk}-{chapter}-") if os.path.isfile(trans) else None
            for utt in sorted(audio):
                if lines is None:
                    problems.append((utt, "no transcript", f"{audio[utt]}: chapter {here} has no "
                                                           f"{os.path.basename(trans)}"))
                elif utt not in lines:
                    problems.append((utt, "no transcript", f"{audio[utt]}: no line in {trans}"))
                else:
                    utts[utt] = {"spk": spk, "path": audio[utt], "start": 0.0, "end": -1.0}
                    text[utt] = lines[utt]
            for utt in sorted(set(lines or ()) - set(audio)):
                problems.append((utt, "no audio entry", f"{utt}: in {trans} but {here} has no "
                                                        f"{utt}.flac"))
    if not utts and not problems:
        raise UserError(f"{subset_dir}: no <speaker>/<chapter>/*.flac files")
    return dict(sorted(utts.items())), problems, text


def read_genders(subset_dir):
    """{speaker: 'm' | 'f'} from SPEAKERS.TXT in the subset or its parent ({} when neither has one)."""
    for where in (subset_dir, os.path.dirname(os.path.abspath(subset_dir))):
        path = os.path.join(where, SPEAKERS_NAME)
        if os.path.isfile(path):
            out = {}
            with open(path, encoding="utf-8") as f:
                for line in f:
                    fields = [x.strip() for x in line.split("|")]
                    if line.startswith(";") or len(fields) < 2 or not fields[0].isdigit():
                        continue
                    if fields[1].upper() in ("M", "F"):
                        out[fields[0]] = fields[1].lower()
            return out
    return {}


def _read_trans(path, prefix):
    """A chapter's trans.txt -> {utt: [words]} (kaldi_dir's table reader: a repeated id is fatal)."""
    lines = {}
    for utt, words, lineno in kaldi_dir.read_table(path, 1, "'<utt-id> WORDS ...'"):
        if not utt.startswith(prefix):
            raise UserError(f"{path}:{lineno}: utterance id {utt!r} is not of this chapter "
                            f"(expected {prefix}<n>)")
        lines[utt] = words
    return lines


def _numbered(path):
    """Sorted names of the sub-directories whose names are numbers (speakers, chapters)."""
    try:
        names = os.listdir(path)
    except OSError as e:
        raise UserError(f"{path}: cannot list ({e.strerror})") from None
    return sorted((n for n in names if n.isdigit() and os.path.isdir(os.path.join(path, n))), key=int)
