"""Logging: a rank-0 console line, one log file per rank, a JSON-lines metrics file.

Console and log lines say epoch, frames done/total, train CE and frame accuracy, learning
rate, frames/s and ETA. A live progress bar is drawn only when stdout is a TTY (never in
batch logs). Every record also goes to RUN/metrics.jsonl (rank 0) for `hpcsgd plot`, and its
scalars to TensorBoard event files in RUN/tensorboard/ (hpcsgd/tensorboard.py).

A run directory holds one run: prepare_run_dir() gives a fresh start a clean one and a
resumed run the metrics of its own past only (see there).
"""
import json
import os
import shutil
import sys
import time

from hpcsgd.errors import UserError

METRICS = "metrics.jsonl"
LEFTOVERS = (METRICS, "logs", "timeline", "plots", "tensorboard")   # a run's, besides checkpoints
WRITABLE = "name a directory this job can write"   # the hint of make_run_dir's errors


def make_run_dir(run_dir):
    """Create the run directory (and its parents) and check that a file can be written in it:
    None, or why not in one line naming the path and the cause (an existing file, a
    read-only file system, no permission), instead of the OSError's traceback."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        return f"train.run_dir {run_dir}: an existing file, not a directory; name a directory"
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as err:   # the parent where it failed, when not run_dir itself
        where = f" ({err.filename})" if err.filename not in (None, run_dir) else ""
        return f"train.run_dir {run_dir}: cannot create it: {err.strerror}{where}; {WRITABLE}"
    probe = os.path.join(run_dir, f".write-test.{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as err:
        return f"train.run_dir {run_dir}: cannot write in it: {err.strerror}; {WRITABLE}"
    return None


def prepare_run_dir(run_dir, resume_frames, has_checkpoints, modify):
    """Before a run opens its logs. Resuming (resume_frames: the checkpoint's frames): the
    metrics records of frames after the checkpoint are dropped -- they belong to the
    interrupted attempt, which the resumed run trains again. A fresh start in a directory with
    checkpoints is refused (it would mix two runs; the checkpoints are not deleted); one in a
    directory with only logs and metrics (an earlier run that never reached a checkpoint)
    removes them. Returns what was done, for the log. Only the rank with `modify` writes."""
    metrics = os.path.join(run_dir, METRICS)
    if resume_frames is not None:
        if modify and os.path.exists(metrics):
            keep = []
            with open(metrics) as f:
                for line in f:
                    try:
                        record = json.loads(line)
                    except ValueError:    # a line cut by a killed run
                        continue
                    if record.get("frames", 0) <= resume_frames:
                        keep.append(line if line.endswith("\n") else line + "\n")
            with open(metrics + ".tmp", "w") as f:
                f.writelines(keep)
            os.replace(metrics + ".tmp", metrics)
        return None
    if has_checkpoints:
        raise UserError(f"{run_dir} holds checkpoints of another run and train.resume does not "
                        f"resume them: use a new train.run_dir, delete {run_dir}, or resume "
                        f"(train.resume=auto)")
    found = [name for name in LEFTOVERS if os.path.exists(os.path.join(run_dir, name))]
    if found and modify:
        for name in found:
            path = os.path.join(run_dir, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.unlink(path)
    return (f"{run_dir} held an earlier run that never reached a checkpoint: removed its "
            f"{', '.join(found)}") if found else None


class RunLog:
    def __init__(self, run_dir, rank, world):
        self.rank, self.world = rank, world
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        self.log = open(os.path.join(run_dir, "logs", f"rank{rank:04d}.log"), "a", buffering=1)
        self.metrics = (open(os.path.join(run_dir, METRICS), "a", buffering=1)
                        if rank == 0 else None)
        self.tty = rank == 0 and sys.stdout.isatty()
        self.start = time.perf_counter()
        self.board = None   # rank 0's TensorBoard writer (hpcsgd/tensorboard.py), if any

    def info(self, message):
        """All ranks to their log file; rank 0 also to the console."""
        line = f"[{time.strftime('%H:%M:%S')} rank {self.rank}/{self.world}] {message}"
        self.log.write(line + "\n")
        if self.rank == 0:
            if self.tty:
                sys.stdout.write("\r\033[K")
            print(line, flush=True)

    def record(self, kind, **fields):
        """One JSON line in metrics.jsonl (rank 0 only): {"kind": ..., "time": s, ...}."""
        if self.metrics is not None:
            fields = {"kind": kind, "time": round(time.perf_counter() - self.start, 3), **fields}
            self.metrics.write(json.dumps(fields) + "\n")
            if self.board is not None:   # the same record's scalars, to TensorBoard
                self.board.record(fields)

    def progress(self, done, total, text):
        """A live bar on a TTY only; batch jobs get the periodic log lines instead."""
        if self.tty and total:
            width = 30
            filled = int(width * min(done, total) / total)
            sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            sys.stdout.flush()

    def close(self):
        if self.board is not None:
            self.board.close()
        self.log.close()
        if self.metrics is not None:
            self.metrics.close()


def format_eta(seconds):
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
