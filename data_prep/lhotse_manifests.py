"""lhotse manifests as a corpus, read as JSON lines (lhotse itself is not needed).

    DATA = a supervisions manifest, e.g. data/manifests/librispeech_supervisions_train-clean-5.jsonl.gz,
           the recordings manifest beside it under the same name with `recordings`
           (librispeech_recordings_train-clean-5.jsonl.gz), as icefall's recipes write them;
           or a directory holding exactly one `*supervisions*.jsonl[.gz]` and its recordings.

A recording line: {"id", "sources": [{"type": "file", "channels": [0], "source": PATH}],
"sampling_rate", "num_samples", "duration"}; a supervision line: {"id", "recording_id",
"start", "duration", "channel", "text", "speaker", "gender"?}. Each supervision is an
utterance (id, speaker, the recording's file from start for duration seconds, the words of
its text). Relative source paths are relative to the current directory, as lhotse reads them.
What hpcsgd cannot read is named: a source that is not a file (a URL, a command, bytes in
memory), a recording of several sources or channels. A supervision without its recording or
speaker is skipped and counted like any bad utterance; a malformed line or a repeated id is
fatal (the file is not a manifest).
"""
import glob
import gzip
import json
import os

from hpcsgd.errors import UserError

SUPERVISIONS, RECORDINGS = "supervisions", "recordings"


def manifest_pair(path):
    """(supervisions file, recordings file) when `path` names lhotse manifests, else None."""
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(path, f"*{SUPERVISIONS}*.jsonl")) +
                       glob.glob(os.path.join(path, f"*{SUPERVISIONS}*.jsonl.gz")))
        if not found:
            return None
        if len(found) > 1:
            raise UserError(f"{path}: {len(found)} lhotse supervision manifests "
                            f"({', '.join(map(os.path.basename, found))}): name the one to "
                            f"prep (DATA = its path)")
        path = found[0]
    name = os.path.basename(path)
    if SUPERVISIONS not in name or not name.endswith((".jsonl", ".jsonl.gz")):
        return None
    recordings = os.path.join(os.path.dirname(path), name.replace(SUPERVISIONS, RECORDINGS, 1))
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such lhotse supervision manifest")
    if not os.path.isfile(recordings):
        raise UserError(f"{path}: its recordings manifest {recordings} is not there (lhotse "
                        f"writes the pair: <corpus>_recordings_<part> beside "
                        f"<corpus>_supervisions_<part>)")
    return path, recordings


def _lines(path):
    """(line number, JSON object) of a JSON-lines file, gzipped or not."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    item = json.loads(line)
                except json.JSONDecodeError as err:
                    raise UserError(f"{path}:{lineno}: not a JSON line ({err.msg})") from None
                if not isinstance(item, dict) or "id" not in item:
                    raise UserError(f"{path}:{lineno}: a manifest line is an object with an id")
                yield lineno, item
    except (OSError, EOFError) as err:
        raise UserError(f"{path}: cannot read ({err})") from None


def _recording_file(path, lineno, rec):
    """The one file a recording reads, or a UserError saying why hpcsgd cannot read it."""
    sources = rec.get("sources") or []
    where = f"{path}:{lineno}: recording {rec['id']}"
    if len(sources) != 1:
        raise UserError(f"{where}: {len(sources)} audio sources; hpcsgd reads recordings of "
                        f"one single-channel file")
    source = sources[0]
    if source.get("type") != "file":
        raise UserError(f"{where}: a {source.get('type')!r} source; hpcsgd reads files (write "
                        f"the audio to WAV/FLAC files and list them)")
    channels = source.get("channels", [0])
    if len(channels) != 1:
        raise UserError(f"{where}: channels {channels}; hpcsgd reads single-channel files")
    return source["source"]


def read_manifests(pair, speakers=None):
    """-> (utts, problems, text, gender) as the other corpus readers give them: utts maps
    utt -> dict(spk, path, start, end) in sorted order, problems lists (utt, reason, detail).
    speakers: the speaker ids to keep (None: all); one the manifests lack is an error."""
    sup_path, rec_path = pair
    files = {}
    for lineno, rec in _lines(rec_path):
        if rec["id"] in files:
            raise UserError(f"{rec_path}:{lineno}: recording {rec['id']} repeated")
        files[rec["id"]] = (lineno, rec)
    utts, problems, text, gender, seen, every = {}, [], {}, {}, set(), set()
    for lineno, sup in _lines(sup_path):
        utt = sup["id"]
        if utt in seen:
            raise UserError(f"{sup_path}:{lineno}: supervision {utt} repeated")
        seen.add(utt)
        spk = sup.get("speaker")
        every.add(str(spk))
        if speakers is not None and str(spk) not in speakers:
            continue
        if not spk:
            problems.append((utt, "no speaker", f"{sup_path}:{lineno}: {utt} has no speaker"))
            continue
        if sup.get("recording_id") not in files:
            problems.append((utt, "no audio entry", f"{sup_path}:{lineno}: {utt}: recording "
                                                    f"{sup.get('recording_id')} is not in {rec_path}"))
            continue
        try:
            start, duration = float(sup["start"]), float(sup["duration"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{sup_path}:{lineno}: {utt}: start and duration must be "
                            f"seconds") from None
        rec_line, rec = files[sup["recording_id"]]
        utts[utt] = {"spk": str(spk), "path": _recording_file(rec_path, rec_line, rec),
                     "start": start, "end": start + duration}
        if sup.get("text") is not None:
            text[utt] = str(sup["text"]).split()
        if str(sup.get("gender", "")).lower()[:1] in ("m", "f"):
            gender[str(spk)] = str(sup["gender"]).lower()[:1]
    lacking = sorted(set(speakers or ()) - every)
    if lacking:
        raise UserError(f"--speakers: {len(lacking)} speakers are not in {sup_path}: "
                        f"{' '.join(lacking[:10])}{' ...' if len(lacking) > 10 else ''}")
    if not utts and not problems:
        raise UserError(f"{sup_path}: no supervisions")
    return dict(sorted(utts.items())), problems, text or None, gender
