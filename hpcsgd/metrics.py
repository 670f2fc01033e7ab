"""Logging: a rank-0 console line, one log file per rank, a JSON-lines metrics file.

Console and log lines say epoch, frames done/total, train CE and frame accuracy, learning
rate, frames/s and ETA. A live progress bar is drawn only when stdout is a TTY (never in
batch logs). Every record also goes to RUN/metrics.jsonl (rank 0) for `hpcsgd plot`.
"""
import json
import os
import sys
import time


class RunLog:
    def __init__(self, run_dir, rank, world):
        self.rank, self.world = rank, world
        os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
        self.log = open(os.path.join(run_dir, "logs", f"rank{rank:04d}.log"), "a", buffering=1)
        self.metrics = (open(os.path.join(run_dir, "metrics.jsonl"), "a", buffering=1)
                        if rank == 0 else None)
        self.tty = rank == 0 and sys.stdout.isatty()
        self.start = time.perf_counter()

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

    def progress(self, done, total, text):
        """A live bar on a TTY only; batch jobs get the periodic log lines instead."""
        if self.tty and total:
            width = 30
            filled = int(width * min(done, total) / total)
            sys.stdout.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
            sys.stdout.flush()

    def close(self):
        self.log.close()
        if self.metrics is not None:
            self.metrics.close()


def format_eta(seconds):
    if seconds != seconds or seconds == float("inf"):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
