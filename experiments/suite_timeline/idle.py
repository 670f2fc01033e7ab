"""From timelog.py's logs and `vmstat -n -t 1`: when each worker ended, the order its files
started in, and the idle core-seconds charged to the file each worker was running then
(half of the machine's idle to each of 2 workers)."""
import collections
import datetime
import glob
import os

OUT = "/tmp/suite_timeline"
ev = {}
for path in sorted(glob.glob(os.path.join(OUT, "tl-gw*.log"))):
    w = os.path.basename(path)[3:-4]
    ev[w] = [(float(t), k, nid.strip()) for t, k, nid in (ln.split(" ", 2) for ln in open(path))]
t0 = min(rows[0][0] for rows in ev.values())
t1 = max(rows[-1][0] for rows in ev.values())
spans = {w: [] for w in ev}
for w, rows in ev.items():
    start = None
    for t, k, nid in rows:
        if k == "S":
            start = (t, nid)
        elif start:
            spans[w].append((start[0], t, nid.split("::")[0]))
            start = None
    files = list(dict.fromkeys(f for _, _, f in spans[w]))
    print(f"{w}: ended at {rows[-1][0] - t0:.1f} s; files in order: {' '.join(files)}")


def running(w, t):
    return next((f for a, b, f in spans[w] if a <= t <= b), "-")


idle_by, total = collections.Counter(), 0.0
for line in open(os.path.join(OUT, "vmstat.log")):
    p = line.split()
    if not p or not p[0].isdigit():
        continue
    ts = datetime.datetime.strptime(p[-2] + " " + p[-1], "%Y-%m-%d %H:%M:%S").replace(
        tzinfo=datetime.timezone.utc).timestamp()
    if t0 <= ts <= t1:
        idle = (int(p[14]) + int(p[15])) / 100 * len(ev)   # id + wa, in cores
        total += idle
        for w in ev:
            idle_by[running(w, ts)] += idle / len(ev)
print(f"idle core-seconds over the {t1 - t0:.0f} s of tests: {total:.1f}")
for f, v in idle_by.most_common(10):
    print(f"{v:7.1f} {f}")
