"""Readers for a Kaldi-style data directory and the three alignment forms, and the frame-label rule.

Data directory (paths in wav.scp are relative to the directory, or absolute):
    wav.scp    `rec path`              WAV or FLAC files (soundfile); piped commands are rejected
    utt2spk    `utt spk`
    segments   `utt rec start end`     optional: utterances cut from recordings (seconds; end -1 = to the end)
    text       `utt words...`          optional: the transcripts (stored, and the source of the
                                       token sequences: data_prep/tokens.py); UTF-8

Alignments (--ali-format, detected when `auto`):
    frames     `utt l1 l2 ...`         one label per frame (ali-to-pdf, ali-to-phones --per-frame);
                                       all-integer files are ids, otherwise symbols
    ctm        `utt chan start dur label`
    segments   a directory of per-utterance files `<utt>.<ext>`, lines `start end label` (seconds)

Frame labels from segment timings (the convention, shared by ctm and segment files):
    frame t (snip_edges=true) starts at t * shift. A segment [start, end) covers frames
    round(start / shift) .. round(end / shift) - 1, rounding half up. This exactly inverts how Kaldi
    writes a CTM from a frame alignment (start = first_frame * shift, dur = num_frames * shift).
    Segments are sorted by start. A gap of g frames before a segment is filled with the previous
    segment's label (with this segment's label before the first one) when g <= tolerance, else the
    utterance is rejected; an overlap of g <= tolerance frames is resolved in favour of the earlier
    segment, a larger one rejects the utterance. Segments shorter than half a frame cover nothing.
"""
import math
import os

import numpy as np

from hpcsgd.errors import UserError


class BadUtterance(Exception):
    """One utterance cannot be used; `reason` is the short category counted in prep's report."""

    def __init__(self, reason, detail):
        super().__init__(detail)
        self.reason = reason


def read_table(path, min_fields, what, unique=True):
    """`key rest...` lines -> list of (key, fields, lineno). Duplicate keys are fatal when unique."""
    rows, seen = [], {}
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < min_fields:
                raise UserError(f"{path}:{lineno}: expected {what}, got {line.strip()!r}")
            if unique:
                if parts[0] in seen:
                    raise UserError(f"{path}:{lineno}: duplicate utterance/recording id {parts[0]!r} "
                                    f"(first on line {seen[parts[0]]})")
                seen[parts[0]] = lineno
            rows.append((parts[0], parts[1:], lineno))
    return rows


def read_data_dir(data_dir):
    """-> (utts, problems): utts maps utt -> dict(spk, path, start, end) in sorted utt order;
    problems lists (utt, reason, detail) for entries that cannot be used (e.g. no speaker)."""
    for name in ("wav.scp", "utt2spk"):
        if not os.path.isfile(os.path.join(data_dir, name)):
            raise UserError(f"{data_dir}: no {name} (not a Kaldi data directory?)")
    wav_path = os.path.join(data_dir, "wav.scp")
    recs = {}
    for rec, fields, lineno in read_table(wav_path, 2, "'rec path'"):
        if len(fields) != 1 or fields[-1].endswith("|") or fields[0].endswith("|"):
            raise UserError(f"{wav_path}:{lineno}: {rec}: piped command {' '.join(fields)!r} is not "
                            f"supported; write the audio to WAV/FLAC files first (e.g. with sox) "
                            f"and list the file paths")
        path = fields[0]
        recs[rec] = path if os.path.isabs(path) else os.path.join(data_dir, path)
    spk = {u: f[0] for u, f, _ in read_table(os.path.join(data_dir, "utt2spk"), 2, "'utt spk'")}
    seg_path = os.path.join(data_dir, "segments")
    if os.path.isfile(seg_path):
        cuts = {}
        for utt, f, lineno in read_table(seg_path, 4, "'utt rec start end'"):
            try:
                start, end = float(f[1]), float(f[2])
            except ValueError:
                raise UserError(f"{seg_path}:{lineno}: start/end must be seconds") from None
            cuts[utt] = (f[0], start, end)
    else:
        cuts = {r: (r, 0.0, -1.0) for r in recs}
    utts, problems = {}, []
    for utt in sorted(set(cuts) | set(spk)):
        if utt not in spk:
            problems.append((utt, "no speaker", f"{utt}: in wav.scp/segments but not in utt2spk"))
        elif utt not in cuts:
            problems.append((utt, "no audio entry", f"{utt}: in utt2spk but not in wav.scp/segments"))
        elif cuts[utt][0] not in recs:
            problems.append((utt, "no audio entry", f"{utt}: recording {cuts[utt][0]} not in wav.scp"))
        else:
            rec, start, end = cuts[utt]
            utts[utt] = {"spk": spk[utt], "path": recs[rec], "start": start, "end": end}
    return utts, problems


def read_text(data_dir):
    """The data directory's `text` as {utt: [words]} (a line with only the id: no words), or
    None when the directory has no `text`. Duplicate ids are fatal."""
    path = os.path.join(data_dir, "text")
    if not os.path.isfile(path):
        return None
    return {utt: words for utt, words, _ in read_table(path, 1, "'utt word word ...'")}


def read_genders(data_dir):
    """{speaker: 'm' | 'f'} from the directory's optional spk2gender ({} without one)."""
    path = os.path.join(data_dir, "spk2gender")
    if not os.path.isfile(path):
        return {}
    return {spk: f[0].lower() for spk, f, _ in read_table(path, 2, "'spk m|f'")
            if f[0].lower() in ("m", "f")}


# ---------------------------------------------------------------- alignments

def detect_format(path):
    if os.path.isdir(path):
        return "segments"
    with open(path) as f:
        for line in f:
            parts = line.split()
            if parts:
                if len(parts) == 5 and _is_float(parts[2]) and _is_float(parts[3]):
                    return "ctm"
                return "frames"
    raise UserError(f"{path}: empty alignment file")


def read_alignments(path, fmt="auto"):
    """-> (fmt, ali): ali maps utt -> list of frame tokens (frames) or [(start, end, label)] (seconds)."""
    if not os.path.exists(path):
        raise UserError(f"{path}: alignment file/directory does not exist")
    fmt = detect_format(path) if fmt == "auto" else fmt
    ali = {}
    if fmt == "frames":
        for utt, fields, _ in read_table(path, 1, "'utt label label ...'"):
            ali[utt] = fields
    elif fmt == "ctm":
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                p = line.split()
                if not p:
                    continue
                if len(p) < 5 or not (_is_float(p[2]) and _is_float(p[3])):
                    raise UserError(f"{path}:{lineno}: expected 'utt chan start dur label', "
                                    f"got {line.strip()!r}")
                start, dur = float(p[2]), float(p[3])
                ali.setdefault(p[0], []).append((start, start + dur, p[4]))
    elif fmt == "segments":
        if not os.path.isdir(path):
            raise UserError(f"{path}: --ali-format segments needs a directory of <utt>.<ext> files")
        for name in sorted(os.listdir(path)):
            utt = name.rsplit(".", 1)[0] if "." in name else name
            file = os.path.join(path, name)
            if utt in ali:
                raise UserError(f"{file}: second alignment file for utterance {utt}")
            segs = []
            with open(file) as f:
                for lineno, line in enumerate(f, 1):
                    p = line.split()
                    if not p:
                        continue
                    if len(p) != 3 or not (_is_float(p[0]) and _is_float(p[1])):
                        raise UserError(f"{file}:{lineno}: expected 'start end label', got {line.strip()!r}")
                    segs.append((float(p[0]), float(p[1]), p[2]))
            ali[utt] = segs
    else:
        raise UserError(f"unknown alignment format {fmt!r} (frames, ctm, segments)")
    return fmt, ali


def build_inventory(fmt, ali):
    """Label symbols (index = id) from the alignments: all-integer frame labels give ids 0..max,
    anything else the sorted set of symbols. Deterministic, so every array task agrees."""
    if fmt == "frames":
        tokens = {t for labels in ali.values() for t in labels}
        if tokens and all(t.isdigit() for t in tokens):
            return [str(i) for i in range(max(int(t) for t in tokens) + 1)]
    else:
        tokens = {seg[2] for segs in ali.values() for seg in segs}
    if not tokens:
        raise UserError("the alignments hold no labels")
    return sorted(tokens)


def alignment_length(fmt, entry, shift_s):
    """Frames an alignment spans (cheap; used to balance shards before any audio is read)."""
    if fmt == "frames":
        return len(entry)
    return max((_frame(e, shift_s) for _, e, _ in entry), default=0)


def time_segments(fmt, entry, shift_s):
    """The alignment as [(start, end, label)] in seconds: ctm and segment entries as they are,
    frame labels as their runs (frame t spans [t * shift, (t + 1) * shift)), which the segment
    convention maps back to the same frames."""
    if fmt != "frames" or not entry:
        return list(entry)
    labels = np.asarray(entry)
    starts = np.flatnonzero(np.concatenate([[True], labels[1:] != labels[:-1]]))
    ends = np.append(starts[1:], len(labels))
    return [(a * shift_s, b * shift_s, entry[a]) for a, b in zip(starts.tolist(), ends.tolist())]


def frame_labels(utt, fmt, entry, label_ids, num_frames, shift_s, tolerance):
    """The int32 label of each of the utterance's num_frames feature frames (see module docstring)."""
    if fmt == "frames":
        ids = [_label_id(utt, t, label_ids) for t in entry]
    else:
        ids = []
        for start, end, label in sorted(entry, key=lambda s: (s[0], s[1])):
            lid = _label_id(utt, label, label_ids)
            a, b = _frame(start, shift_s), _frame(end, shift_s)
            if b <= a:
                continue  # shorter than half a frame: covers no frame
            if a > len(ids):
                gap = a - len(ids)
                if gap > tolerance:
                    raise BadUtterance("alignment gap/overlap",
                                       f"{utt}: gap of {gap} frames before {label} at {start:.3f}s "
                                       f"(more than --length-tolerance {tolerance})")
                ids += [ids[-1] if ids else lid] * gap
            elif a < len(ids):
                overlap = len(ids) - a
                if overlap > tolerance:
                    raise BadUtterance("alignment gap/overlap",
                                       f"{utt}: {label} at {start:.3f}s overlaps the previous segment "
                                       f"by {overlap} frames (more than --length-tolerance {tolerance})")
                a = len(ids)
            ids += [lid] * max(0, b - a)
    if abs(len(ids) - num_frames) > tolerance or not ids:
        raise BadUtterance("length mismatch",
                           f"{utt}: features have {num_frames} frames, alignment has {len(ids)} "
                           f"(more than --length-tolerance {tolerance} apart)")
    ids = ids[:num_frames] + [ids[-1]] * (num_frames - len(ids))  # truncate, or pad with the last label
    return np.asarray(ids, dtype=np.int32)


def _label_id(utt, token, label_ids):
    try:
        return label_ids[token]
    except KeyError:
        raise BadUtterance("unknown label", f"{utt}: label {token!r} is not in the label inventory") \
            from None


def _frame(seconds, shift_s):
    # Round half up (Python's round() is half-even); the 1e-6 frame slack makes decimal seconds
    # such as 0.035 (3.4999999999999996 shifts in binary floating point) round as written.
    return int(math.floor(seconds / shift_s + 0.5 + 1e-6))


def _is_float(s):
    try:
        float(s)
        return True
    except ValueError:
        return False
