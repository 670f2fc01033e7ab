"""`hpcsgd bench kernels --small` runs end to end and writes sane JSON (CI smoke test)."""
import json
import subprocess
import sys


def test_bench_kernels_small(tmp_path):
    out = tmp_path / "k.json"
    p = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "bench", "kernels", "--small",
                        "--repeats", "1", "--codecs", "onebit,kbit4,dettmers,float16",
                        "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "triad" in p.stdout and "onebit" in p.stdout
    res = json.loads(out.read_text())
    assert res["triad_GBps"] > 0 and set(res["codecs"]) == {"onebit", "kbit4", "dettmers", "float16"}
    one = res["codecs"]["onebit"]
    assert one["encode_GBps"] > 0 and one["decode_acc_GBps"] > 0
    assert 1.0 < one["bits_per_value"] < 1.2
