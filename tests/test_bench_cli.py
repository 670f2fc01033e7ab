"""Every `hpcsgd bench` subcommand as a CI smoke test: --small, --json, then a comparison with
that JSON (its floats scaled by 1000, so a figure stored as such shows a -99.9% change), in
process for every subcommand and through the CLI's --compare for two.
The subcommands with an MPI part launch their own mpiexec (hpcsgd/bench/launch.py)."""
import importlib
import json
import math
import os
import subprocess
import sys

import pytest

from conftest import REPO
from hpcsgd.bench import BENCHES, report

EXTRA = {   # per subcommand: what keeps its --small run to seconds, and what it must print
    "ctc": (["--repeats", "1"], "torch/ours"),
    "cuda": (["--launches", "{tmp}/launches.json"], "spills: 0 of"),
    "decode": ([], "search RTF <= 0.02 per core"),
    "exchange": (["--ranks", "2", "--codecs", "onebit,onebit_unfused,float32", "--repeats", "1"],
                 "x = / float32 in-place Allreduce"),
    "int4": ([], "one utterance-second of the model's LSTM products"),
    "kernels": (["--repeats", "1", "--codecs", "onebit,kbit4,dettmers,float16"], "triad"),
    "loader": ([], "raw HDF5 read (limit)"),
    "machine": ([], "bus bandwidth"),
    "plan": (["--plot", "{tmp}/plan.png"], "Validation"),
    "rnnt": (["--repeats", "1"], "ta/ours"),
    "train": ([], "Table 4"),
}


def bench(name, *args, timeout=180):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "bench", name, "--small", *args],
                          capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def scaled(obj, factor):
    """Every float of the result times factor (ints -- K, N, sizes -- stay: labels keep)."""
    if isinstance(obj, dict):
        return {k: scaled(v, factor) for k, v in obj.items()}
    if isinstance(obj, list):
        return [scaled(v, factor) for v in obj]
    return obj * factor if isinstance(obj, float) else obj


def check_ctc(res):
    """Each shape's loss-and-gradient time, the bytes it must move (logits in, gradient out,
    the alpha/beta workspace) and their share of the triad measured in the same run."""
    assert res["triad_GBps"] > 0 and len(res["rows"]) == 2
    for r in res["rows"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["frac_triad"] > 0
        B, T, _, V = r["B"], r["T"], r["U"], r["V"]
        assert r["bytes"] == 8 * B * T * V + r["workspace_bytes"]


def check_rnnt(res):
    """Each shape's loss-and-gradient time, its bytes (logits read and written twice, alpha
    and beta) and share of the triad, ours' exact memory (packed logits, alpha, beta)."""
    assert len(res["rows"]) == 2
    for r in res["rows"]:
        assert r["ms"] > 0 and r["GBps"] > 0 and r["frac_triad"] > 0
        assert r["bytes"] == (16 * r["V"] + 8) * r["nodes"]
        assert r["memory_bytes"] == (4 * r["V"] + 8) * r["nodes"]


def check_int4(res):
    """Each LSTM product of the small RNN-T (two BLSTM layers' input and step products, the
    prediction network's beam step) timed in float32 against the GEMM rate of the same run;
    the integer columns where PyTorch is installed (a benchmark peer), null otherwise."""
    assert [r["product"] for r in res["rows"]] == ["enc0 input", "enc0 step", "enc1 input",
                                                   "enc1 step", "pred0 step"]
    first = res["rows"][0]
    assert (first["m"], first["k"], first["n"]) == (2 * 10, 3 * 40, 2 * 4 * 16)  # 0.3 s / 3
    assert res["f32_peak_gflops"] > 0 and all(r["f32_ms"] > 0 for r in res["rows"])
    with_int = res["torch"] is not None
    assert all((r["int8_ms"] is not None) == with_int for r in res["rows"])
    assert (res["model"]["int4_ms"] is not None) == with_int
    want = sum(r["f32_ms"] * r["calls_per_second"] for r in res["rows"])
    assert abs(res["model"]["f32_ms"] - want) <= 1e-9 * want


def check_cuda(res):
    """Every module-level CUDA kernel, compiled by NVVM for both targets with the signatures
    the trainer launched in the simulator; ptxas's register count for each."""
    from hpcsgd.bench.cuda import project_kernels
    assert set(res["kernels"]) == set(project_kernels()) and len(res["kernels"]) >= 20
    assert res["ccs"] == [80, 90]
    for name in res["kernels"]:
        assert {r["cc"] for r in res["compilations"] if r["kernel"] == name} == {80, 90}
    assert all(0 < r["registers"] <= 255 and r["cubin_bytes"] > 0 for r in res["compilations"])
    # the Dettmers codec's values must be the CPU's bits: no multiply ptxas could fuse into an
    # FMA (on the H100 they were, 2026-11-26: residuals up to 2.4e-7 apart); the counter counts
    dettmers = [r for r in res["compilations"] if ".dettmers." in r["kernel"]]
    assert len(dettmers) == 6 and all(r["fusable_muls"] == 0 for r in dettmers)
    # nor the 1-bit decode, whose SUB_LR mode is the weight update (w - lr * x, as the CPU)
    assert all(r["fusable_muls"] == 0 for r in res["compilations"]
               if r["kernel"].endswith("onebit.decode_cuda"))
    assert max(r["fusable_muls"] for r in res["compilations"]) > 0


def check_exchange(res):
    r = res["runs"][0]["results"]
    assert res["runs"][0]["ranks"] == 2 and r["allreduce_f32_inplace"]["total"] > 0
    for phase in ("encode", "alltoallv", "owner", "allgatherv", "decode_apply"):
        assert r["striped_onebit"][phase] > 0
    for phase in ("decode_sum", "post_process", "reencode"):
        assert r["striped_onebit_unfused"][phase] > 0 and phase not in r["striped_onebit"]
    assert r["striped_onebit"]["bytes_per_rank"] * 20 < r["striped_float32"]["bytes_per_rank"]


def check_kernels(res):
    assert res["triad_GBps"] > 0 and set(res["codecs"]) == {"onebit", "kbit4", "dettmers",
                                                             "float16"}
    one = res["codecs"]["onebit"]
    assert one["encode_GBps"] > 0 and one["decode_acc_GBps"] > 0
    assert 1.0 < one["bits_per_value"] < 1.2
    # the bound: bytes counted over bytes moved at least. --small's largest matrix (930 x 256
    # values) is more than a task, so Dettmers' whole-matrix abs-max reads it a second time
    assert one["encode_bound_frac_triad"] == 1.0
    det = res["codecs"]["dettmers"]
    counted = 12 * det["values"] + det["packed_bytes"]
    reread = 8 * sum(a * b for a, b in res["shapes"] if a * b > 16384)
    assert det["encode_bound_frac_triad"] == pytest.approx(counted / (counted + reread), rel=1e-12)
    assert 0.55 < det["encode_bound_frac_triad"] < 0.7


def check_decode(res):
    """The demo's word graph: one row (--small), the search timed beside the network."""
    (row,) = res["rows"]
    assert res["kind"] == "words" and res["utterances"] > 0 and res["audio_seconds"] > 0
    assert row["rtf_search"] > 0 and res["rtf_forward"] > 0 and 0 <= row["error_rate"]
    assert row["search_of_forward"] == pytest.approx(row["search_seconds"] / res["forward_seconds"])


def check_loader(res):
    assert res["raw_read_fps"] > 0 and res["loader_sync_fps"] > 0 and res["loader_prefetch_fps"] > 0
    assert res["loader"] == "frames"   # the demo corpus has frame labels
    assert res["peak_rss_mb"] >= res["rss_before_loaders_mb"] > 0


def test_bench_loader_takes_a_text_only_archive_through_the_utterance_loader(tmp_path):
    """An archive without frame labels (LibriSpeech's) is what the CTC and RNN-T models read
    whole utterances of: the frame loader cannot read it, the utterance loader is timed."""
    from conftest import make_archive
    make_archive(str(tmp_path / "a"), token_kinds=("chars",), frame_labels=False)
    out = bench("loader", str(tmp_path / "a"), "--json", str(tmp_path / "l.json"))
    assert "utterance loader, 1 core, no prefetch (4-dim)" in out and "peak resident" in out
    res = json.loads((tmp_path / "l.json").read_text())
    assert res["loader"] == "utterances" and res["batch"] == 8000 and res["context"] == 0
    check = dict(res, loader="frames")
    check_loader(check)


def check_machine(res):
    for m in res["memory"].values():
        assert m["copy_GBps"] > 0 and m["triad_GBps"] > 0
    assert all(g > 0 for g in res["gemm"]["shapes"].values())
    assert all(g > 0 for g in res["gemm"]["square_gflops"].values())
    (run,) = res["mpi"]["runs"]
    assert run["ranks"] == 2 and len(run["rows"]) == 3
    for row in run["rows"]:
        for c in ("allreduce", "alltoall", "allgather"):
            assert row[c]["time_s"] > 0 and row[c]["busbw_GBps"] > 0
            # bus bandwidth = bytes / time x share crossing a link: (K-1)/K, 2(K-1)/K at K = 2
            share = 1.0 if c == "allreduce" else 0.5
            assert row[c]["busbw_GBps"] == pytest.approx(row[c]["algbw_GBps"] * share)


def check_plan(res):
    assert {r["codec"] for r in res["rows"]} == {"float32-allreduce", "onebit"}
    for r in res["rows"]:
        assert len(r["speedup_db"]) == len(r["speedup_nodb"]) == 16
        assert r["speedup_db"][0] == pytest.approx(1.0) == r["speedup_nodb"][0]
        assert r["Z"] == pytest.approx(32 / r["bits"])


def check_train(res):
    assert [r["ranks"] for r in res["runs"]] == [1, 2]
    for run in res["runs"]:
        rows = {(r["exchange"], r["double_buffering"]): r for r in run["rows"]}
        assert set(rows) == {(e, d) for e in ("none", "allreduce", "onebit") for d in (False, True)}
        for (ex, db), r in rows.items():
            assert r["minibatch"] == 256 and r["frames_per_s"] > 0
            assert r["roofline_frames_per_s"] > 0 and r["skip_frames_per_s"] > 0
            assert math.isfinite(r["roofline_fraction"]) and r["roofline_fraction"] > 0
            assert math.isfinite(r["roofline_fraction_paired"]) and r["roofline_fraction_paired"] > 0
            assert r["frames_per_s"] == pytest.approx(256 / r["step_s"])
            assert sum(r["fractions"].values()) == pytest.approx(1.0)
            assert r["fractions"]["compute"] > 0
            if ex != "none":
                assert math.isfinite(r["comm_overhead"]) and r["comm_overhead"] < 1
                assert r["comm_overhead"] == pytest.approx(
                    1 - r["frames_per_s"] / r["skip_frames_per_s"])
                assert r["exchanges_per_step"] == (2 if db else 1)
                if run["ranks"] > 1:
                    assert r["fractions"]["communicate"] > 0
        assert rows[("onebit", False)]["bits_per_value"] < 1.5   # + 2 floats per column
        assert rows[("allreduce", False)]["bits_per_value"] == 32
    assert res["frames_per_s"] > 0 and res["batch"] == 256


# a second run through the CLI's --compare for these (the wiring is one implementation for
# all, hpcsgd/bench/report.py); every bench's figures go through report.compare in-process
CLI_COMPARE = {"plan": [], "cuda": ["--kernels", "codecs.onebit"]}


def compare_table(module, new, old, old_path, capsys):
    report.compare(module, new, old, old_path)
    out = capsys.readouterr().out
    return out[out.index(f"compare with {old_path}"):].splitlines()


def check_changes(table, figs, keep=lambda label: True):
    """Every float figure named with its change; the scaled ones show about -99.9%."""
    changed = [lab for lab, v in figs.items() if isinstance(v, float) and keep(lab)]
    assert changed
    ends = {}
    for label in changed:
        line = next((ln for ln in table if ln.startswith(label + " ")), None)
        assert line is not None and line.rstrip().endswith("%"), f"--compare: {label!r}"
        # a figure scaled by 1000 in the old file shows about -99.9%: anything below -99%
        # (a timing that moved by half between the two runs on a loaded machine still does)
        ends[label] = float(line.split()[-1].rstrip("%")) < -99.0
    return ends


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_small_json_and_compare(name, tmp_path, capsys):
    extra, must_print = EXTRA[name]
    extra = [a.format(tmp=tmp_path) for a in extra]
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    # bench cuda records every kernel in the simulator first: two minutes on 2 busy cores
    out = bench(name, *extra, "--json", str(first), timeout=420 if name == "cuda" else 180)
    assert must_print in out
    if name == "plan":
        assert (tmp_path / "plan.png").stat().st_size > 1000
    res = json.loads(first.read_text())
    assert res["bench"] == name and res["command"].startswith(f"hpcsgd bench {name}")
    assert res["load_average_start"] >= 0 and res["git_revision"]
    globals()[f"check_{name}"](res)
    module = importlib.import_module(BENCHES[name][0])
    figs = report.headline(module, res)
    assert figs
    for label, value in figs.items():
        if isinstance(value, str):      # plan: K-hat is 'inf' where Eq. 4 has no bound (§2.3)
            assert value == "inf", label
        else:
            assert math.isfinite(value), label
    old = tmp_path / "old.json"
    old.write_text(json.dumps(scaled(res, 1000.0)))
    ends = check_changes(compare_table(module, res, json.loads(old.read_text()), str(old),
                                       capsys), figs)
    # (cuda's figures are register counts, integers in the JSON, which the scaling leaves)
    assert any(ends.values()) or name == "cuda"
    if name not in CLI_COMPARE:
        return
    out = bench(name, *extra, *CLI_COMPARE[name], "--json", str(again), "--compare", str(old))
    assert f"compare with {old}" in out
    table = out[out.index(f"compare with {old}"):].splitlines()
    ends = check_changes(table, figs, lambda label: name != "cuda" or "codecs.onebit" in label)
    assert any(ends.values()) or name == "cuda"
    res = json.loads(again.read_text())
    assert res["bench"] == name
    if name == "cuda":   # --kernels: only the named kernels compiled
        assert res["kernels"] and all("codecs.onebit" in k for k in res["kernels"])
        assert {r["kernel"] for r in res["compilations"]} == set(res["kernels"])


def test_bench_exchange_parameters_sizes_the_gradient(tmp_path):
    """--parameters M: a 440-2048-n gradient of about M values (another model's, for bench
    plan), whatever --small says."""
    bench("exchange", "--parameters", "1500000", "--ranks", "2", "--codecs", "onebit",
          "--repeats", "1", "--json", str(tmp_path / "e.json"))
    run = json.loads((tmp_path / "e.json").read_text())["runs"][0]
    assert abs(run["parameters"] - 1_500_000) <= 2049 and "striped_onebit" in run["results"]


def test_compare_names_each_link_of_an_emulated_run(capsys):
    from hpcsgd.bench import loader
    one = {"raw_read_fps": 100.0, "loader_sync_fps": 10.0, "loader_prefetch_fps": 10.0,
           "target_fps": 5.0}
    new = {"links": [{"link_gbps": 1, **one}, {"link_gbps": 10, **one}]}
    old = {"links": [{"link_gbps": 1, **one, "raw_read_fps": 50.0}]}
    rows = report.compare(loader, new, old, "old.json")
    out = capsys.readouterr().out
    assert ("1 Gbit/s raw HDF5 read frames/s", 50.0, 100.0, 100.0) in rows
    assert "+100.0%" in out and "only in this run: 10 Gbit/s raw HDF5 read frames/s" in out


def test_json_is_strict_and_keeps_infinity_readable():
    assert report.clean({"k": float("inf"), "n": [float("nan"), 1.5]}) == \
        {"k": "inf", "n": ["nan", 1.5]}


def test_bench_train_times_both_precisions_in_the_same_rounds(tmp_path):
    out = tmp_path / "mixed.json"
    text = bench("train", "--small", "--ranks", "1", "--exchange", "onebit",
                 "--double-buffering", "off", "--precision", "float32,mixed", "--json", str(out))
    assert "activation memory per rank at N = 256" in text
    run = json.loads(out.read_text())["runs"][0]
    rows = {(r["exchange"], r["precision"]): r for r in run["rows"]}
    assert set(rows) == {(e, p) for e in ("none", "onebit") for p in ("float32", "mixed")}
    for (ex, p), r in rows.items():
        assert r["frames_per_s"] > 0 and math.isfinite(r["roofline_fraction"])
        if ex != "none":   # each precision's overhead against its own no-exchange step
            none = rows[("none", p)]
            assert r["comm_overhead"] == pytest.approx(1 - r["frames_per_s"]
                                                       / none["frames_per_s"])
    # activations of the 440-256x3-500 model at N = 256: outputs of every layer + delta
    assert run["activation_bytes"]["256"] == 256 * (3 * 256 + 500 + 256) * 4


def test_bench_train_grid_measures_the_activation_traffic(tmp_path):
    """--grid 1x1,1x2: the split model's rows carry the bytes its model group moved per step,
    exactly the traffic formula of model/parallel.py for the 440-256x3-500 model at N = 256
    (float32: each rank receives the other's half of every hidden output and of every input
    gradient but the first layer's, and 4 softmax numbers per frame), 8-bit activations
    about a quarter of it, and the share of the step that traffic took."""
    out = tmp_path / "grid.json"
    text = bench("train", "--small", "--grid", "1x1,1x2", "--exchange", "allreduce",
                 "--activation-codec", "float32,dettmers", "--double-buffering", "off",
                 "--json", str(out))
    assert "vs 1x1" in text
    runs = json.loads(out.read_text())["runs"]
    assert [r["grid"] for r in runs] == ["1x1", "1x2"]
    rows = {(r["exchange"], r["activation_codec"]): r for r in runs[1]["rows"]}
    assert set(rows) == {(e, c) for e in ("none", "allreduce") for c in ("float32", "dettmers")}
    n, hidden = 256, 256
    f32 = 4 * (3 * n * hidden // 2 + 3 * n * hidden // 2 + 4 * n)
    for ex in ("none", "allreduce"):
        assert rows[(ex, "float32")]["activation_bytes_per_step"] == f32
        coded = rows[(ex, "dettmers")]["activation_bytes_per_step"]
        assert 0.25 * f32 < coded < 0.3 * f32     # 1 byte a value + a scale per row
        for codec in ("float32", "dettmers"):
            assert 0 < rows[(ex, codec)]["activation_share"] < 1


def test_the_paired_roofline_fraction_divides_within_each_round():
    """Rounds that ran slower and slower (a drifting VM): each round's GEMM time over the
    median of its own steps, then the median of those ratios."""
    from hpcsgd.bench.train import paired_fraction
    gemm = [1.0, 2.0, 3.0]
    steps = [1.0, 1.25, 2.0, 2.5, 2.4, 3.0, 3.75, 3.6, 4.5]   # rounds of 2, 3 and 4 steps
    # medians per round 1.125, 2.4, 3.675 -> ratios 0.889, 0.833, 0.816
    assert paired_fraction(gemm, steps, [2, 3, 4]) == pytest.approx(2.0 / 2.4)
    with pytest.raises(ValueError):   # the rounds must cover the steps
        paired_fraction(gemm, steps, [2, 3, 3])


def test_the_train_table_prints_both_roofline_fractions(capsys):
    """The table shows the ratio of medians and, beside it, the paired median of ratios."""
    from hpcsgd.bench.train import print_table
    row = dict(minibatch=256, exchange="allreduce", precision="float32", double_buffering=False,
               frames_per_s=900.0, roofline_frames_per_s=1000.0, roofline_fraction=0.9,
               roofline_fraction_paired=0.973, skip_frames_per_s=950.0, comm_overhead=0.05,
               exchange_s=0.01, fractions=dict(compute=0.8, encode=0.05, communicate=0.05,
                                               update=0.05, other=0.05))
    print_table(dict(ranks=1, threads_per_rank=2, params=10, rounds=3, steps=4, rows=[row]))
    lines = capsys.readouterr().out.splitlines()
    header = next(line.split() for line in lines if line.split()[:2] == ["N", "exchange"])
    assert header[header.index("roof") + 1] == "paired"
    assert lines[-1].split()[5:7] == ["90.0%", "97.3%"]


def bench_train_simulated(tmp_path, *args):
    """`bench train --device cuda` in Numba's simulator on a 4-5-5-3 DNN, N = 8, one round of
    2 steps after 1: (stdout, the run's JSON)."""
    from conftest import make_archive
    make_archive(str(tmp_path / "arch"), num_shards=1, utts_per_shard=4, dim=4, num_labels=3,
                 max_len=40)
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"data:\n  train: {tmp_path / 'arch'}\n  context: 0\nmodel:\n  hidden: [5, 5]\n"
                   "train:\n  minibatch: 8\n")
    out = tmp_path / "cuda.json"
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "bench", "train", "--device",
                           "cuda", "--config", str(cfg), "--double-buffering", "off", "--rounds",
                           "1", "--steps", "2", "--warmup", "1", "--json", str(out), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())["runs"][0]


def test_bench_train_cuda_counts_what_the_host_does_per_step(tmp_path):
    """`bench train --device cuda` in Numba's simulator (the same launch, copy and allocation
    entry points as a GPU): per step, no device allocation; the host waits only where it must
    -- the loss and hit counts (one copy), and for each MPI collective its staging (a sync and
    a copy) -- plus one read of the codec's fault flags at each of the striped exchange's two
    collectives; the bytes to the device are the minibatch's (and the staged receive buffers)."""
    stdout, run = bench_train_simulated(tmp_path, "--ranks", "2", "--exchange",
                                        "allreduce,onebit,dettmers")
    assert "host syncs" in stdout
    rows = {r["exchange"]: r for r in run["rows"]}
    host = {name: r["host_per_step"] for name, r in rows.items()}
    frames = 4 * (4 * 4 + 4)          # 4 frames per rank: 4 float32 features and an int32 label
    assert host["none"]["h2d_bytes"] == frames and host["none"]["h2d_copies"] == 2
    assert host["none"]["d2h_copies"] == 1 and host["none"]["syncs"] == 1
    assert host["none"]["d2h_bytes"] == 4 * 2 * 8                # CE and hit per row, float64
    assert host["allreduce"]["syncs"] == 1 + 2          # + the staged Allreduce
    for codec in ("onebit", "dettmers"):
        assert host[codec]["syncs"] == 1 + 2 * 2 + 2, codec   # Alltoallv, Allgatherv, flags
        assert host[codec]["launches"] > host["none"]["launches"]
    assert all(h["allocations"] == 0 for h in host.values())
    # the phases timed by events on the stream, not by a sync at every mark
    assert set(rows["onebit"]["phases_s"]) >= {"encode", "alltoallv", "decode_sum", "reencode",
                                               "allgatherv", "decode_apply"}
    assert all(v > 0 for v in rows["onebit"]["phases_s"].values())


def test_bench_train_cuda_mixed_stores_half_the_activation_bytes(tmp_path):
    """`bench train --device cuda --precision float32,mixed,bf16` in the simulator: GPU
    ranks' mixed precision stores activations, their gradients and the input copy in float16,
    bf16 in uint16 arrays of bfloat16 bits (docs/precision.md), so their activation bytes are
    exactly half of float32's, and the memory line says so per precision."""
    stdout, run = bench_train_simulated(tmp_path, "--ranks", "1", "--exchange", "allreduce",
                                        "--precision", "float32,mixed,bf16")
    mem = run["activation_bytes_by_precision"]
    assert mem["float32"]["8"] == run["activation_bytes"]["8"] == 8 * (5 + 5 + 3 + 5) * 4
    assert mem["mixed"]["8"] * 2 == mem["bf16"]["8"] * 2 == mem["float32"]["8"]
    assert run["storage"] == {"float32": "float32", "mixed": "float16", "bf16": "uint16"}
    # the 16-bit copies: w16 (2 bytes a weight) and x16 (2 bytes a feature)
    assert run["copy_bytes_by_precision"]["mixed"]["8"] == 2 * run["params"] + 2 * 8 * 4
    assert run["copy_bytes_by_precision"]["bf16"]["8"] == 2 * run["params"] + 2 * 8 * 4
    assert "activation memory per rank at N = 8: float32 " in stdout
    assert "(float32); mixed " in stdout and "(float16)" in stdout and "(bfloat16)" in stdout
    assert all(r["host_per_step"]["allocations"] == 0 for r in run["rows"]), \
        [(r["precision"], r["exchange"], r["host_per_step"]) for r in run["rows"]]


def test_pytorch_variants_and_the_side_by_side_line(capsys):
    """--pytorch times float32 eager always, AMP beside each precision that has one (float16
    AMP on a GPU only), torch.compile on request on one rank; each is printed beside hpcsgd's
    fastest row of its precision, N and ranks (PyTorch itself is not needed here)."""
    from hpcsgd.bench.pytorch import variants_for
    from hpcsgd.bench.train import print_beside_pytorch
    assert variants_for(["float32"], "cpu", False, 2) == ["pytorch"]
    assert variants_for(["float32", "mixed", "bf16"], "cuda", True, 1) == [
        "pytorch", "pytorch_amp16", "pytorch_bf16", "pytorch_compiled"]
    assert variants_for(["float32", "mixed"], "cpu", True, 2) == ["pytorch"]

    def row(exchange, precision, fps, db=False):
        return {"exchange": exchange, "precision": precision, "frames_per_s": fps,
                "minibatch": 256, "double_buffering": db}
    run = {"ranks": 2, "rows": [row("none", "float32", 900.0), row("allreduce", "float32", 300.0),
                                row("onebit", "float32", 400.0), row("onebit", "float32", 800.0, True),
                                row("allreduce", "mixed", 600.0), row("pytorch", "float32", 200.0),
                                row("pytorch_amp16", "mixed", 150.0)]}
    print_beside_pytorch(run)
    out = capsys.readouterr().out.splitlines()
    assert out == ["  K=2 N=256 float32: hpcsgd onebit 400 frames/s = 2.00x pytorch (200)",
                   "  K=2 N=256 mixed: hpcsgd allreduce+mixed 600 frames/s = 4.00x "
                   "pytorch_amp16 (150)"]


def test_bench_exchange_cuda_holds_each_pass_to_the_device_copy(tmp_path):
    """bench exchange --device cuda's limit: the GPU's device-to-device copy rate measured in
    the same run, and the bytes each striped pass must move (pass_bytes) over the phase's
    time; in the simulator on a tiny model (the real figures need a GPU)."""
    script = tmp_path / "ex.py"
    script.write_text(
        "import json, numpy as np\nfrom mpi4py import MPI\n"
        "from hpcsgd import optim\nfrom hpcsgd.codecs import make_codec\n"
        "from hpcsgd.comm.exchange import Striped\nfrom hpcsgd.model.flat import FlatParams\n"
        "from hpcsgd.bench.exchange_worker import device_copy_gbps, layout, pass_bytes, timed\n"
        "params = FlatParams(layout(6, [5, 5], 3), device='cuda')\n"
        "grad = FlatParams(params.layout, device='cuda').flat\n"
        "ex = Striped(MPI.COMM_WORLD, params.matrices, make_codec('onebit', 'cuda'), device='cuda')\n"
        "opt = optim.Optimizer(params.size, post_size=ex.state_size, device='cuda')\n"
        "src = np.ones(params.size, np.float32)\n"
        "res = timed(MPI.COMM_WORLD, ex, grad, params.flat, opt, src, 1)\n"
        "print(json.dumps({'copy': device_copy_gbps(grad, 1), 'bytes': pass_bytes(ex),\n"
        "                  'phases': sorted(res), 'n': ex.size, 'packed': int(ex.counts.sum())}))\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["copy"] > 0 and set(got["bytes"]) <= set(got["phases"])
    n, packed = got["n"], got["packed"]   # one rank: its stripe is the whole gradient
    assert got["bytes"] == {"encode": 12 * n + packed, "decode_sum": packed + 4 * n,
                            "reencode": 12 * n + packed, "decode_apply": packed + 8 * n}


def test_bench_train_cuda_graphs_make_a_step_a_few_launches(tmp_path):
    """--cuda-graphs in the simulator: the forward+backward is one launch (its graph), so a
    step without exchange is 2 (the graph and the optimizer's update), and the striped 1-bit
    step one more per exchange phase whatever the number of matrices (encode, decode-sum,
    post-processing, re-encode, decode-apply): 6. (Warm-up: a pass runs eagerly, then is
    captured, per gradient buffer; the bench's Step alternates two.)"""
    _, run = bench_train_simulated(tmp_path, "--ranks", "2", "--exchange", "onebit",
                                   "--cuda-graphs", "--warmup", "4")
    launches = {r["exchange"]: r["host_per_step"]["launches"] for r in run["rows"]}
    assert launches == {"none": 2, "onebit": 6}
