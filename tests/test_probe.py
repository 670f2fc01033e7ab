"""Automatic minibatch-size selection (train.probe_every_frames) under a real mpiexec:
probing restores the whole state (the run continues bit-identically to one started with the
chosen size at that point); where large minibatches are harmless the size grows, where they
hurt it does not."""
import json
import os

import numpy as np
import pytest

from conftest import make_archive, run_train
from hpcsgd import checkpoint


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("probe_archive"))
    make_archive(out, num_shards=2, utts_per_shard=8, max_len=200)
    return out


def options(arch, run, *extra):
    return [f"data.train={arch}", "data.context=2", "model.hidden=[24, 16]",
            "train.minibatch=128", "train.epochs=1", "data.block_frames=300",
            "data.buffer_frames=900", "train.log_every_frames=500", "optim.lr=0.005",
            "optim.momentum_tc=300", "schedule.type=constant", "train.check_every_steps=1",
            "train.probe_frames=300", f"train.run_dir={run}", *extra]


def train(K, arch, run, *extra):
    proc = run_train(K, options(arch, run, *extra), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return checkpoint.load(checkpoint.latest(run))[0]


def probes(run):
    return [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))
            if r["kind"] == "probe"]


def test_probing_restores_the_state_exactly(arch, tmp_path):
    """Probes at frame 0 and after 1000 frames; a second run probes at 0 too, stops at the
    second probe's frame (checkpoint), and resumes WITHOUT probing at the size the first run
    chose there: both end with the same bits in every array."""
    K = 2
    extra = ("exchange.aggregation=striped", "exchange.codec=onebit", "optim.adagrad=aggregate",
             "train.probe_every_frames=1000")
    full_run = str(tmp_path / "full")
    full = train(K, arch, full_run, *extra)
    done = probes(full_run)
    assert len(done) == 2 and done[1]["frames"] >= 1000
    assert len(set(done[1]["criteria"].values())) > 1   # the candidates really trained
    cut = str(tmp_path / "cut")
    train(K, arch, cut, *extra, f"train.stop_after_frames={done[1]['frames']}")
    assert probes(cut)[0]["criteria"] == done[0]["criteria"]
    resumed = train(K, arch, cut, "exchange.aggregation=striped", "exchange.codec=onebit",
                    "optim.adagrad=aggregate", "train.stop_after_frames=0",
                    f"train.minibatch={done[1]['chosen']}")
    assert len(probes(cut)) == 1
    assert set(full) == set(resumed)
    for name in full:
        np.testing.assert_array_equal(full[name], resumed[name], err_msg=name)


def test_where_large_minibatches_are_harmless_the_size_grows(arch, tmp_path):
    """With a tiny learning rate every candidate's criterion is the same to well within the
    margin, so each probe keeps the largest candidate: 128 -> 256 -> 512 (2x per probe)."""
    run = str(tmp_path / "grow")
    train(2, arch, run, "optim.lr=0.000000001", "train.probe_every_frames=600")
    chosen = [p["chosen"] for p in probes(run)]
    assert chosen[:2] == [256, 512], probes(run)
    assert all(p["candidates"][-1] == p["chosen"] for p in probes(run))


def test_where_large_minibatches_hurt_the_size_does_not_grow(arch, tmp_path):
    """With a per-sample learning rate too high for large steps, a larger minibatch takes a
    larger step (lr x summed gradient) and overshoots: the criterion rises with the size, so
    the probe shrinks the size to 64 and keeps it there."""
    run = str(tmp_path / "hurt")
    train(2, arch, run, "optim.lr=0.05", "train.probe_every_frames=600")
    done = probes(run)
    first = [done[0]["criteria"][str(c)] for c in done[0]["candidates"]]
    assert first == sorted(first) and first[-1] > first[0] * 1.2, done[0]
    assert [p["chosen"] for p in done[:2]] == [64, 64], done


def test_probing_with_double_buffering_drains_the_exchange_first(arch, tmp_path):
    """Probes run without double buffering: the exchange in flight is completed first (replicas
    are checked every step), and the run continues double-buffered at the chosen size."""
    run = str(tmp_path / "db")
    params = train(2, arch, run, "exchange.double_buffering=true",
                   "train.probe_every_frames=1000")["params"]
    assert len(probes(run)) == 2 and np.isfinite(params).all()
