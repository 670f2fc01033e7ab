"""`hpcsgd eval`, `infer` and `decode`'s forward on GPU ranks (--device cuda) against the CPU
path: a DNN, a BLSTM and an INT4-exported model, eval under a real `mpiexec -n 2`, in Numba's
CUDA simulator (conftest.CUDA_ENV: NUMBA_ENABLE_CUDASIM=1 in each rank; with
HPCSGD_TEST_GPU=1 on a machine with a GPU, the real device and cuBLAS). Every CLI run is a
subprocess given that environment, as in tests/test_gpu_ranks.py, so this pytest process
never loads numba.cuda itself. Models and archives are tiny: the simulator runs every CUDA
thread as Python.

The tolerance, from float32 (u = 2^-24, the unit roundoff). The two paths read the same
float32 weights and the same host-made input frames; they differ in

- exp: the CPU kernels' Cephes polynomial (within 1 ulp, hpcsgd/model/kernels.py) against
  CUDA's expf (within 2 ulp; the simulator's math.exp rounds correctly), so two exps of the
  same argument are at most 3 ulp apart. A sigmoid 1 / (1 + e) passes e's relative error on
  times (1 - a) <= 1, and each side rounds its add and its divide (0.5 ulp each): a layer's
  own kernel differs by at most 5u relative. tanh and an LSTM cell's products are alike.
- what a layer is given: the layer below's difference, carried through W (sum |W| |da|)
  and the next nonlinearity (sigmoid' <= 1/4): relative to the layer's outputs, a few more
  ulps per layer in these small models (|W| entries below 1, fan-ins of tens). So each
  layer adds at most ULPS_PER_LAYER = 16 ulps of (1 + |value|) (5 of its own, the rest for
  what it carries); a recurrent layer counts once per direction and its chunk's steps add
  nothing more, as the cell's difference decays through the forget gate (< 1).
- the log-softmax: the CPU adds the M exps of a row in float32 (relative error of the sum
  at most (M - 1)u), CUDA in float64, and the exps are 3 ulp apart: log-sum-exp moves by at
  most (M + 2)u, and every log-posterior with it.
- on a real GPU, cuBLAS adds each GEMM's fan-in k in another order than the CPU BLAS: at
  most k ulps of sum |W| |a| more per layer (gamma_k); the simulator's GEMMs are NumPy's, as
  the CPU's are.

So |logp_gpu - logp_cpu| <= (16 L + M + 3 + (L k_max on a GPU)) u (1 + |logp|) per value
(bound() below): 56 ulps of (1 + |logp|) for the DNN here (3.3e-6 at logp = 0), 72 for the
BLSTM; measured in the simulator: at most 2.0 ulps (DNN, INT4) and 1.4 (BLSTM). A wrong
weight, a stale buffer or a dropped row is 1e-2 or more. Posteriors: p = exp(logp), so
|dp| <= p (bound + 3u). A frame's argmax may then differ only where its top two
log-posteriors are within twice the bound (near_ties()); eval's correct-frame count and
confusions by at most those frames; its CE by at most the mean bound at the labels.
"""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import CUDA_ENV, REAL_GPU, REPO, make_archive, run_mpi, run_train

U = 2.0 ** -24
ULPS_PER_LAYER = 16
EVAL = ["-m", "mpi4py", "-m", "hpcsgd.cli", "eval"]


def cli(*args, env=None, timeout=300):
    """One process of `hpcsgd ARGS` (a single rank: no mpiexec)."""
    full = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                NUMBA_NUM_THREADS="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "hpcsgd.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=full, cwd=REPO)


def ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("eval_cuda_archive"))
    make_archive(out, num_shards=2, utts_per_shard=3, min_len=5, max_len=60)
    return out


COMMON = ("train.epochs=2", "data.block_frames=100", "data.buffer_frames=400",
          "train.log_every_frames=1000", "schedule.type=constant")
MODELS = {
    "dnn": ("data.context=1", "model.hidden=[8, 8]", "train.minibatch=16", "optim.lr=0.05"),
    "blstm": ("model.type=lstm", "model.cells=[6, 5]", "model.bottleneck=[7]", "data.chunk=8",
              "data.left_context=2", "data.right_context=3", "train.minibatch=32",
              "optim.lr=0.01"),
    # INT4 weights (SAWB), exported; the activations stay float here: a quantized activation
    # within float32 rounding of a grid midpoint may take the neighbouring code on the other
    # path, one grid step apart (1/15 at 4 bits), which no float tolerance covers. Such a
    # model runs on GPU ranks too (one run of PACT 4-bit inputs: within 1.3 ulps, no flip)
    "int4": ("data.context=1", "model.hidden=[8, 8]", "train.minibatch=16", "optim.lr=0.05",
             "qat.weights=sawb", "qat.weight_bits=4"),
}
_runs = {}


def trained(kind, arch, tmp_path_factory):
    """A run directory (or, for int4, the exported model file) of a tiny model on arch."""
    if kind not in _runs:
        run = str(tmp_path_factory.mktemp(f"run_{kind}"))
        proc = run_train(1, [f"data.train={arch}", f"train.run_dir={run}", *COMMON,
                             *MODELS[kind]], timeout=180)
        ok(proc)
        if kind == "int4":
            out = os.path.join(run, "model_int4.h5")
            ok(cli("export", run, "--int4", "--out", out))
            run = out
        _runs[kind] = run
    return _runs[kind]


def shape(model_path):
    """(layers, labels, widest fan-in) of a model, from its file (host, no CUDA)."""
    from hpcsgd.model_io import load_model
    model, _, _ = load_model(model_path, max_batch=64)
    return len(model.layers), model.num_labels, max(layer.n_in for layer in model.layers)


def bound(logp, model_path):
    """The largest |logp_gpu - logp_cpu| float32 allows (module docstring), per value."""
    layers, labels, fan_in = shape(model_path)
    ulps = (ULPS_PER_LAYER + (fan_in if REAL_GPU else 0)) * layers + labels + 3
    return ulps * U * (1.0 + np.abs(logp))


def near_ties(logp, tol):
    """Frames whose top two log-posteriors are within the two values' bounds."""
    order = np.argsort(logp, axis=1)
    rows = np.arange(len(logp))
    top, second = order[:, -1], order[:, -2]
    return logp[rows, top] - logp[rows, second] <= tol[rows, top] + tol[rows, second]


def infer(model, arch, out, *extra, env=None):
    ok(cli("infer", model, "--data", arch, "--out", out, *extra, env=env))
    with h5py.File(out + ".h5") as f:
        return (f["values"][()], f["utt_offsets"][()],
                [u.decode() for u in f["utt_ids"][()]])


def evaluate(model, arch, js, ranks=1, device="cpu", env=None):
    """The report (stdout) and the JSON of `eval` under mpiexec -n ranks."""
    proc = ok(run_mpi(ranks, [*EVAL, model, "--data", arch, "--json", js, "--device", device],
                      env=env, timeout=300))
    return proc.stdout, json.load(open(js))


def assert_reports_agree(cpu, gpu, logp_cpu, tol, labels):
    """eval's figures: frames and per-class counts exact; CE within the mean bound at the
    labels; confusions apart by at most the near-tie frames (each moves one count)."""
    (cpu_text, a), (gpu_text, b) = cpu, gpu
    assert a["frames"] == b["frames"] == len(labels)
    conf_a, conf_b = np.asarray(a["confusion"]), np.asarray(b["confusion"])
    np.testing.assert_array_equal(conf_a.sum(axis=1), conf_b.sum(axis=1))
    assert a["majority_baseline"] == b["majority_baseline"]
    rows = np.arange(len(labels))
    assert abs(a["ce"] - b["ce"]) <= tol[rows, labels].mean() + 1e-12, (a["ce"], b["ce"])
    ties = int(near_ties(logp_cpu, tol).sum())
    assert np.abs(conf_a - conf_b).sum() <= 2 * ties
    assert abs(a["frame_accuracy"] - b["frame_accuracy"]) * a["frames"] <= ties + 1e-9
    if ties == 0:   # the same report but for CE's last printed digit
        differ = [(x, y) for x, y in zip(cpu_text.splitlines(), gpu_text.splitlines())
                  if x != y and not x.startswith("cross-entropy")]
        assert not differ and len(cpu_text.splitlines()) == len(gpu_text.splitlines())
        assert f"frame accuracy {100 * a['frame_accuracy']:.2f}%" in gpu_text


def archive_labels(arch):
    """The archive's labels in archive order (what infer's rows follow)."""
    from hpcsgd.data import archive
    index = archive.read_index(arch)
    out = []
    for shard in index["shards"]:
        with archive.open_shard(os.path.join(index["dir"], shard["file"])) as f:
            out.append(f["labels"][:])
    return np.concatenate(out)


@pytest.mark.parametrize("kind", ["dnn", "blstm", "int4"])
def test_eval_and_infer_on_gpu_ranks_equal_the_cpu_path_to_float32(kind, arch, tmp_path,
                                                                   tmp_path_factory):
    """infer --device cuda: the same utterances, and log-posteriors within bound(); argmax
    the same except near ties. eval --device cuda on 2 ranks: the 1-process CPU report within
    the same bound (a BLSTM's eval runs its chunks, infer's default gives the same rows)."""
    model = trained(kind, arch, tmp_path_factory)
    logp_cpu, off_cpu, utts_cpu = infer(model, arch, str(tmp_path / "cpu"), "--output",
                                        "logpost", "--format", "hdf5")
    logp_gpu, off_gpu, utts_gpu = infer(model, arch, str(tmp_path / "gpu"), "--output",
                                        "logpost", "--format", "hdf5", "--device", "cuda",
                                        env=CUDA_ENV)
    assert utts_gpu == utts_cpu and np.array_equal(off_gpu, off_cpu)
    tol = bound(logp_cpu, model)
    err = np.abs(logp_gpu - logp_cpu)
    assert (err <= tol).all(), f"{(err / (U * (1 + np.abs(logp_cpu)))).max():.1f} ulps"
    moved = logp_gpu.argmax(axis=1) != logp_cpu.argmax(axis=1)
    assert not (moved & ~near_ties(logp_cpu, tol)).any()

    cpu = evaluate(model, arch, str(tmp_path / "cpu.json"))
    gpu = evaluate(model, arch, str(tmp_path / "gpu.json"), ranks=2, device="cuda",
                   env=CUDA_ENV)
    assert_reports_agree(cpu, gpu, logp_cpu, tol, archive_labels(arch))


def test_infer_on_a_gpu_writes_the_cpu_posteriors_archive(arch, tmp_path, tmp_path_factory):
    """--output posteriors --format both: OUT.h5 and the Kaldi OUT.ark/OUT.scp of the GPU
    path hold the CPU's posteriors to |dp| <= p (bound + 3u)."""
    import kaldiio
    model = trained("dnn", arch, tmp_path_factory)
    logp, _, _ = infer(model, arch, str(tmp_path / "logp"), "--output", "logpost",
                       "--format", "hdf5")
    cpu, offsets, utts = infer(model, arch, str(tmp_path / "cpu"), "--output", "posteriors")
    gpu, _, _ = infer(model, arch, str(tmp_path / "gpu"), "--output", "posteriors",
                      "--device", "cuda", env=CUDA_ENV)
    tol = cpu * (bound(logp, model) + 3 * U)
    assert (np.abs(gpu - cpu) <= tol).all()
    ark = dict(kaldiio.load_scp(str(tmp_path / "gpu.scp")))
    assert list(ark) == utts
    for u, utt in enumerate(utts):
        np.testing.assert_array_equal(ark[utt], gpu[offsets[u]:offsets[u + 1]])


def test_a_bad_device_or_no_gpu_is_a_clear_error(arch, tmp_path, tmp_path_factory):
    """--device tpu: argparse's usage error (exit 2). --device cuda where there is no GPU and
    no simulator: exit 2 naming the reason, on one process and on both ranks of a job (the
    ranks agree before either exits: no rank left waiting in a collective, none aborted
    before it has said why)."""
    model = trained("dnn", arch, tmp_path_factory)
    for command in ("eval", "infer"):
        proc = cli(command, model, "--data", arch, "--out", str(tmp_path / "x"),
                   "--device", "tpu") if command == "infer" else \
            cli(command, model, "--data", arch, "--device", "tpu")
        assert proc.returncode == 2 and "argument --device: invalid choice: 'tpu'" in proc.stderr
    if REAL_GPU:
        pytest.skip("a GPU is here: the no-GPU error cannot be provoked")
    no_sim = {"NUMBA_ENABLE_CUDASIM": "0"}
    proc = cli("infer", model, "--data", arch, "--out", str(tmp_path / "x"), "--device",
               "cuda", env=no_sim)
    if proc.returncode == 0:
        pytest.skip("numba.cuda finds a GPU here")
    assert proc.returncode == 2 and "--device cuda: no CUDA GPU is available" in proc.stderr
    proc = run_mpi(2, [*EVAL, model, "--data", arch, "--device", "cuda"], env=no_sim)
    assert proc.returncode != 0
    assert proc.stderr.count("hpcsgd eval: error: --device cuda: no CUDA GPU") == 2
    assert not os.path.exists(str(tmp_path / "x.h5"))


def test_eval_graph_and_decode_on_two_gpu_ranks_give_the_one_process_hypotheses(tmp_path):
    """eval --graph under mpiexec -n 2: each rank decodes its utterances, rank 0 scores them
    all; on GPU ranks the same PER line as one CPU process, and `decode --device cuda` on 2
    ranks the same hypotheses (on a spelled phone archive the model has learned by heart, 83%
    of its frames: no hypothesis hangs on a float32 tie)."""
    from test_decode import TRAIN as SPELLED, write_spelled_archive
    from hpcsgd import cli as hpcsgd_cli
    arch = write_spelled_archive(str(tmp_path / "archive"), SPELLED)
    run, graph = str(tmp_path / "run"), str(tmp_path / "graph")
    ok(run_train(1, [f"data.train={arch}", f"train.run_dir={run}", "data.context=1",
                     "model.hidden=[16]", "train.minibatch=16", "train.epochs=20",
                     "optim.lr=0.2", *COMMON[1:]], timeout=180))
    assert hpcsgd_cli.main(["mkgraph", arch, graph, "--kind", "phones"]) == 0
    args = [*EVAL, run, "--data", arch, "--graph", graph, "--json"]
    one = ok(run_mpi(1, [*args, str(tmp_path / "one.json")]))
    two = ok(run_mpi(2, [*args, str(tmp_path / "two.json"), "--device", "cuda"], env=CUDA_ENV,
                     timeout=300))
    per = [line for line in one.stdout.splitlines() if line.startswith("%PER")]
    assert per and per == [line for line in two.stdout.splitlines() if line.startswith("%PER")]
    a, b = (json.load(open(tmp_path / f"{n}.json")) for n in ("one", "two"))
    assert a["frame_accuracy"] == b["frame_accuracy"] > 0.6   # 0.83: learned, not tied
    assert a["frames"] == b["frames"] == sum(sum(lengths) for _, _, lengths in SPELLED.values())
    assert a["decode"]["utterances"] == b["decode"]["utterances"] == len(SPELLED)
    assert a["decode"]["errors"] == b["decode"]["errors"]
    decode = ["-m", "mpi4py", "-m", "hpcsgd.cli", "decode", run, "--data", arch, "--graph",
              graph, "--out"]
    ok(run_mpi(1, [*decode, str(tmp_path / "dcpu")]))
    ok(run_mpi(2, [*decode, str(tmp_path / "dgpu"), "--device", "cuda"], env=CUDA_ENV,
               timeout=300))
    hyps = [open(tmp_path / d / "hyp.txt").read() for d in ("dcpu", "dgpu")]
    assert hyps[0] == hyps[1] and hyps[0].count("\n") == len(SPELLED)
