"""A pytest plugin: each test's start and end, per xdist worker, in /tmp/suite_timeline/tl-WORKER.log
(epoch seconds), to see what ran when. With vmstat beside it:
    mkdir -p /tmp/suite_timeline; vmstat -n -t 1 > /tmp/suite_timeline/vmstat.log &
    CI=true PYTHONPATH=$PWD/experiments/suite_timeline bin/test -p timelog; kill %1
    python experiments/suite_timeline/idle.py
"""
import os
import time

OUT = "/tmp/suite_timeline"
_f = None


def _out():
    global _f
    if _f is None:
        os.makedirs(OUT, exist_ok=True)
        _f = open(os.path.join(OUT, f"tl-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}.log"),
                  "a", buffering=1)
    return _f


def pytest_runtest_logstart(nodeid, location):
    _out().write(f"{time.time():.3f} S {nodeid}\n")


def pytest_runtest_logfinish(nodeid, location):
    _out().write(f"{time.time():.3f} E {nodeid}\n")
