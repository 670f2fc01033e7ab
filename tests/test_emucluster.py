"""The emulated cluster (bin/emucluster): one MPI rank per network namespace over a shaped
link, torn down afterwards, also when interrupted. Needs root and working `ip netns`; skipped
with the reason otherwise."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from hpcsgd.bench import emucluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "bin", "emucluster")


def _netns_works():
    if os.geteuid() != 0:
        return "not root (ip netns and tc need root)"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "ip or tc not installed"
    # a name of this process's own: every pytest-xdist worker imports this module at once
    name = f"hpeprobe{os.getpid()}"
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns add fails here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


REASON = _netns_works()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"emulated cluster: {REASON}")


def _skip_if_busy(proc_returncode, err):
    """Another run's emulated cluster is up (bin/emucluster exits 75): nothing to test now."""
    if proc_returncode == emucluster.EXIT_BUSY:
        pytest.skip(f"emulated cluster in use by another run: {err.strip()}")


def _leftovers_when_free():
    """Our leftovers, looked at while holding the cluster's lock (so not another run's)."""
    try:
        with emucluster.exclusive(wait=30):
            return _leftovers()
    except emucluster.Busy as e:
        pytest.skip(f"cannot check the teardown: {e}")


def _leftovers():
    ns = [l.split()[0] for l in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                text=True).stdout.splitlines() if l.strip()]
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return [n for n in ns if n.startswith("hpe")] + (["hpebr"] if " hpebr:" in links else [])


def test_refuses_without_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert emucluster.run(2, 1, 0, ["-n", "2", "true"]) == 2
    assert "needs root" in capsys.readouterr().err


PROBE = ("import os, numpy as np; from mpi4py import MPI; c = MPI.COMM_WORLD; "
         "ns = os.popen('ip netns identify').read().strip(); "
         "names = c.allgather(ns); b = np.ones(1 << 18, np.float32); "
         "c.Allreduce(MPI.IN_PLACE, b); assert b[0] == c.size; "
         "print('RANKS', c.size, 'NS', ','.join(names)) if c.rank == 0 else None")


@needs_netns
def test_one_rank_per_namespace_and_teardown():
    proc = subprocess.run([BIN, "--hosts", "2", "--gbps", "1", "--timeout", "50", "--",
                           "-n", "2", sys.executable, "-c", PROBE],
                          capture_output=True, text=True, timeout=58)
    _skip_if_busy(proc.returncode, proc.stderr)
    assert proc.returncode == 0, proc.stderr
    assert "RANKS 2 NS hpe0,hpe1" in proc.stdout, proc.stdout + proc.stderr
    assert _leftovers_when_free() == []


@needs_netns
def test_interrupt_tears_down():
    p = subprocess.Popen([BIN, "--hosts", "2", "--gbps", "10", "--", "-n", "2", "sleep", "100"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(100):                      # wait until the namespaces exist
            if p.poll() is not None or len(_leftovers()) >= 2:
                break
            time.sleep(0.1)
        if p.poll() is not None:
            _skip_if_busy(p.returncode, p.communicate()[1])
        assert len(_leftovers()) >= 2
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
        assert p.returncode == 130, err
        assert "tearing down" in err
        assert _leftovers_when_free() == []
        stray = subprocess.run(["pgrep", "-f", "hydra_pmi_proxy.*emucluster-launch"],
                               capture_output=True, text=True).stdout.split()
        assert stray == [], f"MPI proxies outlived the teardown: {stray}"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@needs_netns
def test_bench_machine_across_the_emulated_link(tmp_path):
    """`hpcsgd bench machine --emulate 1` (the shared --emulate of MPI benchmarks): the ranks'
    collectives see the 1 Gbit/s link, not shared memory, and the cluster is gone after."""
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "bench", "machine", "--small",
                           "--emulate", "1", "--sizes", "65536,1048576", "--json", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    _skip_if_busy(proc.returncode, proc.stderr)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (link,) = json.loads(out.read_text())["links"]
    assert link["link_gbps"] == 1 and link["mpi"]["limit"] == "link 1 Gbit/s"
    big = link["mpi"]["runs"][0]["rows"][-1]            # 1 MiB
    for c in ("allreduce", "alltoall", "allgather"):
        # at most the link's 0.125 GB/s (+ the 1 ms bucket's burst); shared memory: > 1 GB/s
        assert 0 < big[c]["busbw_GBps"] < 0.125 * 1.3, (c, big[c])
    assert _leftovers_when_free() == []


@needs_netns
def test_one_cluster_at_a_time():
    """A second cluster while one is up would tear the first down (fixed names): refused."""
    try:
        with emucluster.exclusive(wait=30):
            proc = subprocess.run([BIN, "--hosts", "2", "--", "-n", "2", "true"],
                                  capture_output=True, text=True, timeout=30)
            down = subprocess.run([BIN, "--down"], capture_output=True, text=True, timeout=30)
    except emucluster.Busy as e:
        pytest.skip(str(e))
    assert proc.returncode == emucluster.EXIT_BUSY and "in use by pid" in proc.stderr
    assert down.returncode == emucluster.EXIT_BUSY
