"""`hpcsgd bench exchange --small` as a smoke test: it launches its own mpiexec, times every
phase, and reports 1-bit's bytes on the wire far below float32's."""
import json
import os
import subprocess
import sys

from conftest import REPO


def test_bench_exchange_small_runs_under_its_own_mpiexec(tmp_path):
    out = str(tmp_path / "bench.json")
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "bench", "exchange", "--small",
                           "--ranks", "2", "--codecs", "onebit,float32", "--repeats", "1",
                           "--json", out], capture_output=True, text=True, timeout=180, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run = json.load(open(out))["runs"][0]
    res = run["results"]
    assert run["ranks"] == 2 and res["allreduce_f32_inplace"]["total"] > 0
    onebit = res["striped_onebit"]
    for phase in ("encode", "alltoallv", "decode_sum", "post_process", "reencode", "allgatherv",
                  "decode_apply"):
        assert onebit[phase] >= 0
    assert onebit["bytes_per_rank"] * 20 < res["striped_float32"]["bytes_per_rank"]
    assert "striped_onebit" in proc.stdout and "x = / float32 in-place Allreduce" in proc.stdout
