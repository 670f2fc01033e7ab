"""A per-rank timeline of every training step, as a Chrome trace (the format of Horovod's
timeline), viewable in https://ui.perfetto.dev or chrome://tracing.

`train.timeline: true` writes RUN/timeline/rankNNNN.json for the first `train.timeline_steps`
steps of the run (0 = all; a 46M-model step is ~12 events, so a long run's full trace is big).
Each phase is one complete event ("ph": "X") on the rank's own track (pid = rank), named after
the phase, with its category one of CATEGORIES -- the split `hpcsgd plot` summarises:

    batch        the loader hands over the spliced, normalised frames
    compute      forward + backward (GEMMs and fused kernels), local post-processing
    encode       the codec's quantization (both passes of the striped exchange)
    communicate  the MPI collectives, or the wait for a nonblocking one (double buffering)
    decode       decode-and-sum of the K contributions (striped), float16 widening
    post_process weight decay, aggregate AdaGrad, momentum (the striped owner's fused pass,
                 decode-sum + post-process + re-encode, counts here)
    update       W -= lr * update (fused with the final decode for onebit)
    checkpoint, cross_validation, probe   the occasional work between steps

Timestamps are wall-clock microseconds, so the files of all ranks can be loaded together
(`hpcsgd plot RUN` writes RUN/timeline/all.json) and line up to the hosts' clock sync.
The file is a JSON array written as events happen; a killed run leaves it without the final
"]", which both viewers accept.
"""
import json
import os
import time

CATEGORIES = ("batch", "compute", "encode", "communicate", "decode", "post_process", "update",
              "checkpoint", "cross_validation", "probe")

# exchange phase (hpcsgd/comm/exchange.py PHASES) -> category
EXCHANGE_CATEGORY = {"encode": "encode", "reencode": "encode",
                     "allreduce": "communicate", "alltoallv": "communicate",
                     "allgatherv": "communicate", "decode": "decode", "decode_sum": "decode",
                     "post_process": "post_process", "owner": "post_process", "apply": "update",
                     "decode_apply": "update"}


class Timeline:
    """Records spans given as time.perf_counter() pairs; a no-op when path is None."""

    def __init__(self, path, rank, max_steps=0):
        self.rank, self.max_steps, self.step = rank, max_steps, 0
        self.file = None
        # perf_counter -> microseconds since the epoch, fixed once (monotonic within a rank)
        self._offset = time.time() - time.perf_counter()
        if path:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.file = open(path, "w", buffering=1 << 16)
            self.file.write("[\n")
            self._event({"name": "process_name", "ph": "M", "pid": rank,
                         "args": {"name": f"rank {rank}"}})

    @property
    def on(self):
        return self.file is not None and (not self.max_steps or self.step < self.max_steps)

    def _event(self, event):
        self.file.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def span(self, name, t0, t1, category=None, **args):
        """One phase from t0 to t1 (perf_counter seconds) on this rank's track."""
        if not self.on:
            return
        event = {"name": name, "cat": category or name, "ph": "X", "pid": self.rank, "tid": 0,
                 "ts": round((t0 + self._offset) * 1e6, 1), "dur": round((t1 - t0) * 1e6, 1)}
        if args:
            event["args"] = args
        self._event(event)

    def end_step(self):
        self.step += 1

    def close(self):
        if self.file is not None:
            # a last metadata event carries no trailing comma, so the array is valid JSON
            self.file.write(json.dumps({"name": "thread_name", "ph": "M", "pid": self.rank,
                                        "tid": 0, "args": {"name": "training"}}) + "\n]\n")
            self.file.close()
            self.file = None


def read_events(path):
    """The complete events of one rank's trace (a truncated file, from a killed run, too)."""
    text = open(path).read().rstrip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    return [e for e in json.loads(text) if e.get("ph") == "X"]


def summarize(events):
    """{category: total seconds}, and the wall time the events span, for one rank."""
    totals = dict.fromkeys(CATEGORIES, 0.0)
    for e in events:
        totals[e["cat"]] = totals.get(e["cat"], 0.0) + e["dur"] / 1e6
    if not events:
        return totals, 0.0
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)) / 1e6
    return totals, span
