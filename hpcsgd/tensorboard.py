"""TensorBoard event files beside metrics.jsonl (train.tensorboard, on by default).

Rank 0 only, as metrics.jsonl: every record RunLog.record writes there also comes here, and the
fields of it that TAGS lists become TensorBoard scalars, their step the record's `frames` (the
trainer's own unit, so runs with other minibatch sizes overlay). Nothing is computed here: a
value in TensorBoard is the metrics.jsonl value rounded to float32, what an event stores. The
`start` record's resolved config becomes the run's HParams. docs/tensorboard.md lists the tags.

The events are made and framed by tensorboardX (its summary protobufs, its TFRecord writer),
imported here at the first use, so that a rank other than 0 never imports it and a missing
library costs one log line. They are written from the training thread, not through
tensorboardX's SummaryWriter: that one writes from a thread fed by a bounded queue, and when
the thread dies on a write error (a full disk) the next event blocks forever -- rank 0 would
hang the job. Here a failed write is one log line, and the run goes on without events.

Resume (train.resume): the events after the checkpoint's frames belong to the interrupted
attempt, which the resumed run trains again, so every event file is rewritten without them
(under a temporary name, then renamed), as metrics.prepare_run_dir does for metrics.jsonl;
the resumed run then writes a new file. Not TensorBoard's own purge (a SessionLog START at the
purge step): only some readers apply it, while a file holding only the kept steps reads the
same in all of them. A fresh start in a used directory starts clean (metrics.LEFTOVERS).
"""
import os
import socket
import struct
import time
import types

DIR = "tensorboard"
# metrics.jsonl record kind -> (field, tag) of each scalar it carries; a field a record lacks
# (no CV, no adaptive bits, no loss scaling, no double buffering) is no point
TAGS = {
    "train": (("ce", "train/ce"), ("frame_accuracy", "train/accuracy"), ("lr", "lr"),
              ("ctc_per_token", "train/ctc_per_token"),
              ("rnnt_per_token", "train/rnnt_per_token"),
              ("skipped_utterances", "train/no_alignment_utterances"),
              ("frames_per_s", "throughput/frames_per_s"),
              ("comm_exposed_s", "comm/exposed_s"),   # per exchange
              ("comm_bytes_per_step", "comm/bytes_per_step"), ("overlap", "comm/overlap"),
              ("bits", "exchange/bits"), ("loss_scale", "precision/loss_scale"),
              ("skipped_steps", "precision/skipped_steps")),
    "epoch": (("cv_ce", "cv/ce"), ("cv_frame_accuracy", "cv/accuracy"),
              ("cv_majority", "cv/majority_accuracy"),
              ("cv_ctc_per_token", "cv/ctc_per_token"),
              ("cv_rnnt_per_token", "cv/rnnt_per_token"),
              ("cv_token_error_rate", "cv/token_error_rate")),
    "bits": (("bits", "exchange/bits"),),   # each change of the adaptive width, where it is
    "probe": (("chosen", "probe/minibatch"), ("seconds", "probe/seconds"),
              ("criteria", "probe/ce")),    # {size: CE} -> probe/ce/<size>
}
FLUSH_AFTER = ("train", "epoch", "probe")   # a live TensorBoard sees each log line
HPARAMS = "_hparams_/session_start_info"    # the HParams dashboard's tag for a run's values
TEMPORARY = ".rewrite.tmp"                  # no "tfevents" in it: readers skip it


def scalars(record):
    """[(tag, value)] of a metrics record, as TAGS maps it."""
    out = []
    for field, tag in TAGS.get(record["kind"], ()):
        value = record.get(field)
        if isinstance(value, dict):
            out += [(f"{tag}/{key}", v) for key, v in value.items()]
        elif value is not None:
            out.append((tag, value))
    return out


def hparams(record):
    """The HParams of a `start` record: the resolved config, dotted keys, strings, numbers
    and booleans (a list as its text), and the number of ranks."""
    values = {key: value if isinstance(value, (str, int, float, bool)) else str(value)
              for key, value in record["config"].items()}
    values["run.ranks"] = record["world"]
    return values


def library():
    """tensorboardX's parts this module uses (ImportError when it is not installed)."""
    from google.protobuf.message import DecodeError
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import RecordWriter, masked_crc32c
    from tensorboardX.summary import hparams as hparams_summaries, scalar
    return types.SimpleNamespace(DecodeError=DecodeError, Event=Event, Summary=Summary,
                                 RecordWriter=RecordWriter, masked_crc32c=masked_crc32c,
                                 hparams=hparams_summaries, scalar=scalar)


def open_board(run_dir, resume_frames, say):
    """Rank 0 at a run's start (resume_frames: the checkpoint's frames, None for a fresh
    start): the Board that writes this start's events, or None after one line to `say`."""
    try:
        tbx = library()
    except ImportError as err:
        say("tensorboard: tensorboardX is not installed (pip install tensorboardX); no event "
            "files written" if err.name == "tensorboardX" else
            f"tensorboard: tensorboardX does not import ({err}); no event files written")
        return None
    directory = os.path.join(run_dir, DIR)
    try:
        os.makedirs(directory, exist_ok=True)
        last = keep_until(directory, resume_frames, tbx) if resume_frames is not None else {}
        return Board(os.path.join(directory, new_name(directory)), tbx, last,
                     resume_frames or 0, say)
    except OSError as err:
        say(f"tensorboard: {directory}: {err}; no event files written")
        return None


def event_files(directory):
    """The event files of a run directory's tensorboard/, in the order readers take them."""
    return sorted(name for name in os.listdir(directory) if "tfevents" in name)


def new_name(directory):
    """This start's file name. Readers take a run's files in name order (a live TensorBoard
    never goes back to a name before the file it reads), so the new file must sort after
    every older one, or its steps would come before theirs: also when this node's clock is
    behind the one that wrote them (a job requeued elsewhere) or it is the same second. So
    its time field is past theirs."""
    stamps = [int(field) for name in event_files(directory)
              if (field := name.partition("tfevents.")[2].split(".", 1)[0]).isdigit()]
    stamp = max([int(time.time())] + [s + 1 for s in stamps])
    return f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}"


def records(data, tbx):
    """(the record's bytes, its Event) for each whole record of an event file's bytes (the
    TFRecord framing: length, its masked CRC-32C, the data, the data's CRC); it stops at a
    record cut short by a killed run."""
    at = 0
    while at + 12 <= len(data):
        header = data[at:at + 8]
        (n,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[at + 8:at + 12])[0] != tbx.masked_crc32c(header) \
                or at + 16 + n > len(data):
            return
        try:
            event = tbx.Event.FromString(data[at + 12:at + 12 + n])
        except tbx.DecodeError:
            return
        yield data[at:at + 16 + n], event
        at += 16 + n


def keep_until(directory, frames, tbx):
    """Resume: rewrite each event file without its events after `frames` (a file left
    unchanged when it has none). Returns {tag: the last step kept}."""
    last = {}
    for name in event_files(directory):
        path = os.path.join(directory, name)
        with open(path, "rb") as f:
            data = f.read()
        kept = []
        for raw, event in records(data, tbx):
            if event.step <= frames:
                kept.append(raw)
                for value in event.summary.value:
                    last[value.tag] = max(last.get(value.tag, -1), event.step)
        if sum(map(len, kept)) != len(data):
            temporary = os.path.join(directory, TEMPORARY)
            with open(temporary, "wb") as f:
                f.writelines(kept)
            os.replace(temporary, path)
    return last


class Board:
    """One start's event file: record() writes a metrics record's scalars (the step of each
    tag strictly increasing: a value at a step its tag has reached is not written again), and
    the HParams once; close() ends it. A write that fails turns the board off after one line
    to `say`: training goes on, and metrics.jsonl keeps every record."""

    def __init__(self, path, tbx, last, start, say):
        self.path, self.tbx, self.last, self.start, self.say = path, tbx, last, start, say
        self.file = tbx.RecordWriter(path)
        self._write(0, [], "brain.Event:2")   # a file's first event, as TensorFlow's

    def record(self, record):
        if self.file is None:
            return
        step = int(record.get("frames", self.start))   # `start` has no frames: this start's
        values = [(tag, self.tbx.scalar(tag, value).value)
                  for tag, value in scalars(record) if step > self.last.get(tag, -1)]
        if record["kind"] == "start" and HPARAMS not in self.last:   # the first start's
            values.append((HPARAMS, self.tbx.hparams(hparams(record), {})[1].value))
        if values and self._write(step, values):
            self.last.update((tag, step) for tag, _ in values)
        if record["kind"] in FLUSH_AFTER and self.file is not None:
            self._do(self.file.flush)

    def _write(self, step, values, file_version=""):
        """One event: the values (a tag and its Summary values each) at `step`."""
        summary = self.tbx.Summary()
        for _, value in values:
            summary.value.extend(value)
        event = self.tbx.Event(wall_time=time.time(), step=step, file_version=file_version,
                               **({"summary": summary} if values else {}))
        return self._do(self.file.write, event.SerializeToString())

    def _do(self, action, *args):
        try:
            action(*args)
            return True
        except (OSError, ValueError) as err:   # ValueError: the file was closed meanwhile
            self.say(f"tensorboard: writing {self.path} failed ({err}); no more events this "
                     f"run (metrics.jsonl goes on)")
            file, self.file = self.file, None
            try:
                file.close()
            except (OSError, ValueError):   # what it still buffered cannot be written either
                pass
            return False

    def close(self):
        if self.file is not None and self._do(self.file.flush):
            self._do(self.file.close)
        self.file = None
