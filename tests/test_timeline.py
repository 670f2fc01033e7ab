"""The per-rank Chrome-trace timeline and the achieved-overlap metric, from a real 2-rank run."""
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO, make_archive, run_mpi
from hpcsgd import timeline

STEPS = 6


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    archive = str(tmp_path_factory.mktemp("synth"))
    make_archive(archive, num_shards=2, utts_per_shard=10)
    run = str(tmp_path_factory.mktemp("run"))
    proc = run_mpi(2, ["-m", "mpi4py", "-m", "hpcsgd.cli", "train", f"data.train={archive}",
                       f"train.run_dir={run}", "data.context=2", "model.hidden=[16, 16]",
                       "train.minibatch=64", "train.epochs=1", "train.log_every_frames=500",
                       "exchange.aggregation=striped", "exchange.codec=onebit",
                       "exchange.double_buffering=true", "train.timeline=true",
                       f"train.timeline_steps={STEPS}", "train.checkpoint_every_frames=100000"],
                   timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run


def test_each_rank_writes_a_valid_chrome_trace_of_the_first_steps(traced_run):
    for rank in (0, 1):
        path = os.path.join(traced_run, "timeline", f"rank{rank:04d}.json")
        raw = json.load(open(path))   # closed properly: strict JSON
        assert any(e["ph"] == "M" and e["args"]["name"] == f"rank {rank}" for e in raw)
        events = [e for e in raw if e["ph"] == "X"]
        assert {e["pid"] for e in events} == {rank}
        assert {e["cat"] for e in events} <= set(timeline.CATEGORIES)
        names = [e["name"] for e in events]
        # double buffering: two halves per step, each a batch, a gradient and an exchange
        assert names.count("forward_backward") == 2 * STEPS
        for phase in ("batch", "pre_exchange", "encode", "alltoallv", "owner", "allgatherv",
                      "decode_apply"):
            assert phase in names, phase
        # one thread: spans follow each other, never overlap
        events.sort(key=lambda e: e["ts"])
        for a, b in zip(events, events[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1.0, (a, b)
        assert all(e["dur"] >= 0 for e in events)


def test_metrics_report_exposed_communication_and_achieved_overlap(traced_run):
    records = [json.loads(line) for line in open(os.path.join(traced_run, "metrics.jsonl"))]
    train = [r for r in records if r["kind"] == "train"]
    assert train
    for r in train:
        assert 0.0 <= r["overlap"] <= 1.0
        assert r["comm_blocking_s"] > 0
        comm = r["exchange_s"]["alltoallv"] + r["exchange_s"]["allgatherv"]
        assert r["comm_exposed_s"] == pytest.approx(comm)
        assert r["overlap"] == pytest.approx(
            min(max(1 - r["comm_exposed_s"] / r["comm_blocking_s"], 0), 1))


def test_plot_summarises_where_the_time_goes_and_merges_the_ranks(traced_run):
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "plot", traced_run], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "where the time goes" in proc.stdout
    lines = [l.split() for l in proc.stdout.splitlines() if l.strip()[:1].isdigit()]
    assert [l[0] for l in lines] == ["0", "1"]
    merged = json.load(open(os.path.join(traced_run, "timeline", "all.json")))
    assert {e["pid"] for e in merged} == {0, 1}
    assert os.path.getsize(os.path.join(traced_run, "plots", "time_breakdown.png")) > 5000


def test_a_truncated_trace_from_a_killed_run_is_still_read(tmp_path):
    path = str(tmp_path / "rank0003.json")
    t = timeline.Timeline(path, 3, max_steps=2)
    for step in range(4):
        t.span("forward_backward", step, step + 0.5, "compute")
        t.span("alltoallv", step + 0.5, step + 0.75, "communicate")
        t.end_step()
    t.file.flush()   # killed here: no closing bracket
    events = timeline.read_events(path)
    assert len(events) == 4   # max_steps: only the first two steps
    totals, span = timeline.summarize(events)
    assert totals["compute"] == pytest.approx(1.0) and totals["communicate"] == pytest.approx(0.5)
    assert span == pytest.approx(1.75)
