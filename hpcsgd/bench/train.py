"""`hpcsgd bench train`: training frames/s at K ranks, each figure beside its limit from the
same run: the GEMM roofline and the same loop with the exchange skipped.

    hpcsgd bench train [--small] [--ranks 1,2,4] [--minibatch 256,512,1024,2048]
                       [--exchange allreduce,onebit] [--double-buffering off|on|both]
                       [--progress test|none,test,thread]
                       [--rounds 3] [--json FILE] [--compare OLD.json] [--emulate 1,10,25]

For each K, `mpiexec -n K` (hpcsgd/bench/launch.py: cores split evenly over the ranks) runs the
rank side below. It runs the trainer's own step (hpcsgd/step.py, the one hpcsgd/train.py runs)
on this rank's share of the global minibatch N (loader.batch_split) with the exchange
make_exchange builds from the config, with or without double buffering, the exchange in
flight driven as exchange.progress says (--progress: test = MPI_Test after each GEMM of the
next half; thread = a thread calling MPI_Test every ms; none). Frames are random (the
loader's limit is `bench loader`); the model is the paper's 46M DNN (440-7x2048-9304, sigmoid)
or, with --small, a 0.4M one. Exchanges: allreduce (float32 in place, each layer's gradient
summed while the layers below run their backward: exchange.overlap), allreduce_serial (one
Allreduce after the backward pass), allreduce16, or a striped codec (onebit, kbit2/4/8,
dettmers, float16, float32).

Per (K, N, exchange, double buffering):
  frames/s       N / step time; a step's time is the slowest rank's, the median over
                 --rounds rounds of --steps steps after --warmup (the pipeline of double
                 buffering runs through them). The rounds go through the GEMMs alone, the
                 loop without exchange and with each exchange in turn, so that a figure and
                 its limits see the same neighbours on a shared machine.
  roofline       the step's matmuls alone (the same forward and backward with every
                 element-wise kernel skipped, model.ops.GemmOnly, on every rank at once,
                 sharing the cores as the step does; per half with double buffering):
                 frames/s ÷ that ("of roof", a ratio of medians over all rounds).
  paired         the same ratio taken in each round, median over rounds, which a drifting
                 VM disturbs less (roofline_fraction_paired in the JSON).
  overhead       communication overhead, 1 - frames/s ÷ frames/s with the exchange skipped
                 (the same step, each rank applying its local gradient in the optimizer's
                 fused pass: compute + a local update, no codec, no MPI; Local below).
  fractions      of the step time: compute (forward + backward), encode (codec passes:
                 encode, decode-sum, re-encode, float16 casts), communicate (MPI calls,
                 including waiting for the slowest rank), update (post-processing, apply,
                 fused decode-apply), other (the rest: Python, begin_step).
With --double-buffering both, a Table 4 (the paper's: frames/s over N without and with
double buffering) is printed per K and exchange; --progress none,test,thread gives a
double-buffered row per progress mode, measured in the same rounds.
"""
import argparse
import os
import statistics
import sys
import time

import numpy as np

from hpcsgd import census
from hpcsgd.bench import launch, report
from hpcsgd.device import synchronize
from hpcsgd.families import family, of_model
from hpcsgd.model.ops import GemmOnly
from hpcsgd.step import Step, gradient_buffers, halves

PAPER = dict(input_dim=440, hidden=[2048] * 7, num_labels=9304)
SMALL = dict(input_dim=440, hidden=[256] * 3, num_labels=500)
# --model lstm: a BLSTM on 40 log-mel features, chunks of 40 frames, 64 chunks per step (the
# issue's 3 x 320; --cells 512,512,512,512 is IBM's 4 x 512); --small: a tiny one
LSTM = dict(type="lstm", input_dim=40, cells=[320] * 3, num_labels=40, bidirectional=True,
            bottleneck=[], steps=40)
LSTM_SMALL = dict(LSTM, cells=[32, 32], steps=10)
# --model ctc: jobs/configs/so762_ctc.yaml's DeepSpeech2-like encoder on 40 log-mel features
# (frames stacked by 3, 3 BLSTM layers of 256), CTC over 40 phone tokens; every utterance of
# `steps` frames (so762's mean, 4.1 s) with a token per 20 frames; --small: a tiny one with a
# strided convolution
CTC = dict(type="ctc", input_dim=40, encoder=["stack 3", "blstm 256", "blstm 256", "blstm 256"],
           num_tokens=40, steps=400)
CTC_SMALL = dict(CTC, encoder=["conv 16 k3 s2", "blstm 16"], steps=40)
FRAMES_PER_TOKEN = 20
USES_MPI = True
LR = 1e-6                       # per sample: small, so random labels do not blow weights up
MOMENTUM_TC = 9719.0            # samples: momentum 0.9 per 1024-frame minibatch (CNTK's usual)
MOMENTUM = 0.9                  # the same, as PyTorch's per-step coefficient (--pytorch)
# exchange phases (hpcsgd/comm/exchange.py) -> the four categories reported
CATEGORIES = {"encode": ("encode", "decode_sum", "reencode", "decode"),
              "communicate": ("alltoallv", "allgatherv", "allreduce"),
              "update": ("post_process", "owner", "apply", "decode_apply")}


def add_arguments(parser):
    parser.add_argument("--small", action="store_true",
                        help="a 0.4M-parameter model (lstm: 2 x 32 cells, chunks of 10), K = 1,2, "
                             "N = 256 (lstm 160): a CI smoke test (seconds)")
    parser.add_argument("--config", metavar="YAML",
                        help="the model of a training config instead of the paper's 46M one: "
                             "its model.hidden, model.activation and train.minibatch, the "
                             "input and label sizes from its archive (e.g. "
                             "jobs/configs/so762.yaml)")
    parser.add_argument("--model", default="dnn", choices=("dnn", "lstm", "ctc"),
                        help="dnn: the paper's 46M DNN (or --config's); lstm: a BLSTM, 3 x 320 "
                             "cells on 40 features, chunks of 40 frames, N = 2560 (64 chunks); "
                             "ctc: so762_ctc.yaml's CTC model (frames stacked by 3, BLSTM 256 x "
                             "3) without its archive, utterances of 400 frames, N = 4000")
    parser.add_argument("--cells", default=None,
                        help="lstm: cells per direction of each layer, e.g. 512,512,512,512")
    parser.add_argument("--unidirectional", action="store_true", help="lstm: an LSTM, not a BLSTM")
    parser.add_argument("--chunk", type=int, default=None,
                        help="lstm: frames per sequence (40); ctc: frames per utterance (400)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: GPU ranks, one GPU per local rank, as train.device=cuda")
    parser.add_argument("--ranks", default=None, help="K values (default 1,2,4; --small 1,2)")
    parser.add_argument("--minibatch", "--batch", default=None,
                        help="global minibatch sizes N, comma-separated (default 1024; "
                             "--small 256)")
    parser.add_argument("--exchange", default="allreduce,onebit",
                        help="allreduce (overlapped with the backward pass where it applies), "
                             "allreduce_serial (after it), allreduce16, or striped codecs "
                             "onebit,kbit4,float32,...")
    parser.add_argument("--double-buffering", default=None, choices=["off", "on", "both"],
                        help="half-batch double buffering (default off; --small both)")
    parser.add_argument("--progress", default="test",
                        help="double buffering: how the exchange in flight is driven, one or "
                             "more of none,test,thread (exchange.progress; default test)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds over the configurations (GEMMs, no exchange, each exchange; "
                             "default 3, --small 2)")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per round (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--activation", default=None, choices=["sigmoid", "relu"],
                        help="hidden nonlinearity (default: the config's, else sigmoid)")
    parser.add_argument("--threads", type=int, default=None,
                        help="threads per rank (default: the trainer's rule, hpcsgd/threads.py: "
                             "OMP_NUM_THREADS, SLURM_CPUS_PER_TASK, else cores // K)")
    parser.add_argument("--pytorch", action="store_true",
                        help="also time the same model trained by PyTorch in the same rounds "
                             "(DistributedDataParallel over gloo at K > 1; needs torch "
                             "installed: hpcsgd/bench/pytorch.py), without double buffering")
    parser.add_argument("--pytorch-compile", action="store_true",
                        help="with --pytorch on one rank: also torch.compile(mode="
                             "'reduce-overhead') (CUDA graphs on a GPU), the stronger peer for "
                             "small models")
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="--device cuda: each forward+backward as a CUDA Graph "
                             "(train.cuda_graphs; hpcsgd/graphs.py)")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per mpiexec run")
    parser.add_argument("--precision", default="float32",
                        help="float32, mixed, bf16, or a list (float32,mixed,bf16): the step in "
                             "each precision (train.precision; mixed with a static loss scale "
                             "of 1: the overflow vote runs, no step may be skipped; bf16 without "
                             "a scale), in the same rounds")
    parser.add_argument("--grid", default=None,
                        help="data x model grids instead of --ranks, e.g. 1x1,1x2,2x1,2x2: "
                             "D data ranks, each model split over M ranks (model.parallel); "
                             "adds the activation traffic per step and its share of the step")
    parser.add_argument("--activation-codec", default="float32",
                        help="--grid with M > 1: activations between model ranks, one or "
                             "more of float32,float16,dettmers,dettmers_linear "
                             "(model.activation_codec), measured in the same rounds")
    parser.add_argument("--model-parallel", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--qat", default="",
                        help="quantization-aware variants of the step, measured in the same "
                             "rounds against the float one: WEIGHTS[/ACTIVATIONS] rule+bits, "
                             "comma-separated, e.g. sawb4/bac4,pact4/pact4,max8/max8")


def parse_qat(spec):
    """'sawb4/bac4' -> the model's qat description (hpcsgd.model.quantize): weights SAWB at 4
    bits, activations BAC at 4 bits; 'max8' quantizes the weights only."""
    out = {}
    for what, part in zip(("weight", "activation"), spec.split("/")):
        rule = part.rstrip("0123456789")
        if not part or rule == part:
            raise SystemExit(f"--qat {spec}: expected rule+bits[/rule+bits], e.g. sawb4/bac4")
        out[what + "s"], out[what + "_bits"] = rule, int(part[len(rule):])
    return out


def model_of(args):
    """(name, shape, activation, default minibatch) of the benchmarked model; shape is the
    builder's description (hpcsgd.model.build) without the activation."""
    lstm_config = ctc_config = None
    if args.config:
        from hpcsgd import config
        lstm_config = config.load(args.config, [])
        if family(lstm_config["model.type"]).UTTERANCES:   # whole utterances, tokens
            ctc_config = lstm_config
        if lstm_config["model.type"] != "lstm":
            lstm_config = None
    if getattr(args, "model", "dnn") == "ctc" or ctc_config:
        shape = dict(CTC_SMALL if args.small else CTC)
        n = 800 if args.small else 4000
        name = "small ctc" if args.small else "ctc"
        if ctc_config:   # the config's encoder; the token count from its archive
            from hpcsgd.data import archive
            index = archive.read_index(ctc_config["data.train"])
            shape.update(input_dim=index["feature_dim"], encoder=ctc_config["model.encoder"],
                         num_tokens=index["tokens"][ctc_config["data.tokens"]]["num_tokens"])
            if ctc_config["model.type"] == "rnnt":   # the transducer after the same encoder
                shape.update(type="rnnt", predictor=ctc_config["model.predictor"],
                             embed=ctc_config["model.embed"], joint=ctc_config["model.joint"],
                             joint_mode=ctc_config["model.joint_mode"])
            n, name = ctc_config["train.minibatch"], os.path.basename(args.config)
            if ctc_config["model.dropout"]:   # the Rank sets it; PyTorch's peer drops too
                shape["dropout"] = ctc_config["model.dropout"]
        if args.chunk:
            shape["steps"] = args.chunk
        return name, shape, args.activation or "relu", n
    if getattr(args, "model", "dnn") == "lstm" or lstm_config:
        shape = dict(LSTM_SMALL if args.small else LSTM)
        n = 160 if args.small else 2560
        name = "small lstm" if args.small else "lstm"
        if lstm_config:   # the config's model; the bench feeds no context (steps = chunk)
            from hpcsgd.data import archive
            index = archive.read_index(lstm_config["data.train"])
            shape.update(input_dim=index["feature_dim"], num_labels=index["num_labels"],
                         cells=lstm_config["model.cells"],
                         bidirectional=lstm_config["model.bidirectional"],
                         bottleneck=lstm_config["model.bottleneck"],
                         steps=lstm_config["data.chunk"])
            n, name = lstm_config["train.minibatch"], os.path.basename(args.config)
        if args.cells:
            shape["cells"] = [int(c) for c in args.cells.split(",")]
        if args.unidirectional:
            shape["bidirectional"] = False
        if args.chunk:
            shape["steps"] = args.chunk
        return name, shape, args.activation or "relu", n
    if args.config:
        from hpcsgd import config
        from hpcsgd.data import archive
        cfg = config.load(args.config, [])
        index = archive.read_index(cfg["data.train"])   # the input and label sizes
        shape = dict(input_dim=(2 * cfg["data.context"] + 1) * index["feature_dim"],
                     hidden=cfg["model.hidden"], num_labels=index["num_labels"])
        return (os.path.basename(args.config), shape,
                args.activation or cfg["model.activation"], cfg["train.minibatch"])
    if args.small:
        return "small", SMALL, args.activation or "sigmoid", 256
    return "paper 46M", PAPER, args.activation or "sigmoid", 1024


def _settings(args):
    """(ranks, minibatches, modes) with the --small defaults filled in. A mode is
    (double buffering, progress): (False, None), or (True, "none" | "test")."""
    ranks = [int(k) for k in (args.ranks or ("1,2" if args.small else "1,2,4")).split(",")]
    ns = [int(n) for n in str(args.minibatch or model_of(args)[3]).split(",")]
    db = args.double_buffering or ("both" if args.small else "off")
    progress = args.progress.split(",")
    if not set(progress) <= {"none", "test", "thread"}:
        raise SystemExit(f"--progress {args.progress}: expected none, test and/or thread")
    on = [(True, p) for p in progress]
    return ranks, ns, {"off": [(False, None)], "on": on, "both": [(False, None)] + on}[db]


def describe(shape):
    """The benchmarked model in one line."""
    if of_model(shape).UTTERANCES:
        from hpcsgd.model.encoder import describe as encoder
        out = (f"CTC {shape['num_tokens']}" if shape["type"] == "ctc" else
               f"RNN-T[{encoder(shape['predictor'])}, embed {shape['embed']}, joint "
               f"{shape['joint']} {shape['joint_mode']}] {shape['num_tokens']}")
        return (f"{shape['input_dim']}-[{encoder(shape['encoder'])}]-{out}, "
                f"utterances of {shape['steps']} frames"
                + (f", dropout {shape['dropout']:g}" if shape.get("dropout") else ""))
    if shape.get("type") == "lstm":
        kind = "BLSTM" if shape["bidirectional"] else "LSTM"
        return (f"{shape['input_dim']}-{kind} {'x'.join(map(str, shape['cells']))}"
                f"{''.join(f'-{b}' for b in shape['bottleneck'])}-{shape['num_labels']}, "
                f"chunks of {shape['steps']} frames")
    return f"{shape['input_dim']}-{'x'.join(map(str, shape['hidden']))}-{shape['num_labels']}"


def unit_of(shape):
    """Frames of the indivisible part of a minibatch: one chunk for an LSTM (whole sequences
    on every rank, hpcsgd.data.loader.batch_split), one utterance for a CTC model, one frame
    for a DNN."""
    return shape.get("steps", 1) if of_model(shape).SEQUENCES else 1


def builder_shape(shape):
    """The builder's description of the benchmarked model (without the bench's own keys: a
    CTC model's utterance length, its dropout: a training setting, Network.set_dropout)."""
    return {k: v for k, v in shape.items()
            if not (of_model(shape).UTTERANCES and k in ("steps", "dropout"))}


def utterance_targets(shape, n, rng):
    """A CTC batch of n frames: n / steps utterances of `steps` frames, each with a random
    token per FRAMES_PER_TOKEN frames (ids 1..V-1): the hpcsgd.data.utterances.Targets."""
    from hpcsgd.data.utterances import Targets
    steps = shape["steps"]
    nb, per = n // steps, max(steps // FRAMES_PER_TOKEN, 1)
    ids = rng.integers(1, shape["num_tokens"], nb * per).astype(np.int32)
    return Targets(np.full(nb, steps, np.int64), ids, np.arange(nb + 1, dtype=np.int64) * per,
                   np.arange(nb, dtype=np.uint64))   # dropout's keys: one per utterance


def ctc_minibatch(n, seed=0):
    """bench train's CTC model (CPU, float32) for n frames, initialised from seed, with its
    gradient buffers and a minibatch of n frames (x, utterance_targets): the pass the
    experiments time (experiments/lstm_whole_sequences.py ...)."""
    from hpcsgd.model import build
    from hpcsgd.step import gradient_buffers
    model = build(dict(builder_shape(CTC), activation="relu"), max_batch=n, device="cpu",
                  precision="float32")
    params = model.new_params()
    model.init(params, np.random.default_rng(seed))
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((n, CTC["input_dim"]), dtype=np.float32)
    return model, params, gradient_buffers(model, True)[0], x, utterance_targets(CTC, n, rng)


def run(args):
    ranks, ns, modes = _settings(args)
    name, shape, activation, _ = model_of(args)
    print(f"hpcsgd bench train: {name} model {describe(shape)}, "
          f"N = {','.join(map(str, ns))}, exchanges {args.exchange}, double buffering "
          f"{'/'.join(_db_name(*m) for m in modes)}; {launch.cores()} cores, load average "
          f"{report.load_average():.2f}" + (f"; emulated link {launch.link_gbps():g} Gbit/s"
                                            if launch.link_gbps() else ""), flush=True)
    worker = ["--ranks", "0", "--minibatch", ",".join(map(str, ns)), "--exchange", args.exchange,
              "--double-buffering", args.double_buffering or ("both" if args.small else "off"),
              "--progress", args.progress,
              "--steps", args.steps, "--rounds", args.rounds or (2 if args.small else 3),
              "--warmup", args.warmup,
              "--activation", activation, "--device", args.device]
    worker += ["--pytorch"] if args.pytorch else []
    worker += ["--pytorch-compile"] if args.pytorch_compile else []
    worker += ["--cuda-graphs"] if args.cuda_graphs else []
    worker += ["--precision", args.precision] + (["--qat", args.qat] if args.qat else [])
    worker += ["--small"] if args.small else []
    worker += ["--config", args.config] if args.config else []
    worker += ["--model", args.model] + (["--cells", args.cells] if args.cells else []) \
        + (["--chunk", str(args.chunk)] if args.chunk else []) \
        + (["--unidirectional"] if args.unidirectional else [])
    runs = []
    grids = [(k, 1) for k in ranks] if not args.grid else parse_grid(args.grid)
    if args.grid:
        worker += ["--activation-codec", args.activation_codec]
    for d, m in grids:
        # --small: 1 thread per rank; a 2-thread Numba kernel on a tiny model mostly waits for
        # its second thread on 2 shared cores
        res = launch.mpirun(d * m, "hpcsgd.bench.train", worker + ["--model-parallel", m],
                            args.timeout, args.threads or (1 if args.small else None), m)
        gbps = launch.link_gbps()
        for row in res["rows"]:    # the link's limit: the bytes of a step at the link rate
            row["comm_s"] = row["seconds"]["communicate"]
            if gbps and row["exchange"] != "none":
                row["wire_s"] = row["exchanges_per_step"] * row["bytes_per_rank"] * 8 / (gbps * 1e9)
        runs.append(res)
        print_table(res)
        print_beside_pytorch(res)
        print_qat_overhead(res)
        print_activation_memory(res)
    if args.grid:
        print_grid(runs)
    out = {"model": name, "shape": shape, "activation": activation, "device": args.device,
           "params": runs[0]["params"], "minibatches": ns, "exchanges": args.exchange.split(","),
           "link_gbps": launch.link_gbps(), "runs": runs}
    if len({db for db, _ in modes}) == 2:
        print_table4(out)
    # issue 3's figure, kept at the top: one rank's step (exchange skipped: forward + backward
    # + momentum update) against its GEMM roofline
    one = next(r for r in runs[0]["rows"] if r["exchange"] == "none")
    out.update(batch=one["minibatch"], frames_per_s=one["frames_per_s"],
               roofline_fraction=one["roofline_fraction"],
               roofline_fraction_paired=one["roofline_fraction_paired"])
    print(f"one rank's step at N = {one['minibatch']} (K = {runs[0]['ranks']}): "
          f"{one['frames_per_s']:.0f} frames/s, fraction of the GEMM roofline "
          f"{one['roofline_fraction']:.1%} (round by round, median: "
          f"{one['roofline_fraction_paired']:.1%})")
    return out


def print_beside_pytorch(run):
    """--pytorch: each PyTorch variant beside hpcsgd's step of the same precision, N and
    ranks, double buffering off: its fastest exchange row (at K = 1 the exchange skipped)."""
    torch_rows = [r for r in run["rows"] if r["exchange"].startswith("pytorch")]
    for t in torch_rows:
        ours = [r for r in run["rows"] if not r["exchange"].startswith("pytorch")
                and r["minibatch"] == t["minibatch"] and r["precision"] == t["precision"]
                and not r["double_buffering"]
                and (run["ranks"] == 1 or r["exchange"] != "none")]
        if not ours:
            continue
        best = max(ours, key=lambda r: r["frames_per_s"])
        print(f"  K={run['ranks']} N={t['minibatch']} {t['precision']}: hpcsgd "
              f"{_run_name(best['exchange'], best['precision'])} {best['frames_per_s']:.0f} "
              f"frames/s = {best['frames_per_s'] / t['frames_per_s']:.2f}x {t['exchange']} "
              f"({t['frames_per_s']:.0f})")


def parse_grid(spec):
    """'1x1,1x2,2x2' -> [(1, 1), (1, 2), (2, 2)] (data ranks, model ranks)."""
    try:
        grids = [tuple(int(v) for v in part.lower().split("x")) for part in spec.split(",")]
    except ValueError:
        grids = [()]
    if not all(len(g) == 2 and min(g) >= 1 for g in grids):
        raise SystemExit(f"--grid {spec}: expected DxM pairs, e.g. 1x1,1x2,2x1,2x2")
    return grids


def print_grid(runs):
    """Frames/s per grid against 1 x 1 (the same N, exchange and activation codec), with the
    model-parallel activation traffic of a step and its share of the step's time."""
    base = {(r["minibatch"], r["exchange"]): r["frames_per_s"] for run in runs
            if run["grid"] == "1x1" for r in run["rows"] if r["precision"] == "float32"}
    print(f"\n{'grid':>5s} {'N':>6s} {'exchange':>10s} {'activations':>15s} {'frames/s':>9s} "
          f"{'vs 1x1':>7s} {'act MB/step':>11s} {'act share':>9s}")
    for run in runs:
        for r in run["rows"]:
            one = base.get((r["minibatch"], r["exchange"]))
            print(f"{run['grid']:>5s} {r['minibatch']:>6d} {r['exchange']:>10s} "
                  f"{r.get('activation_codec', '-'):>15s} {r['frames_per_s']:>9.1f} "
                  f"{format(r['frames_per_s'] / one - 1, '+.1%') if one else '':>7s} "
                  f"{r.get('activation_bytes_per_step', 0) / 1e6:>11.2f} "
                  f"{r.get('activation_share', 0.0):>9.1%}")


def _db_name(db, progress):
    """off, on (no MPI call during compute), on+test (MPI_Test after each GEMM) or on+thread
    (a thread calling MPI_Test)."""
    return "off" if not db else ("on" if progress in (None, "none") else f"on+{progress}")


def _mode(row):
    """A row's (double buffering, progress); JSON written before --progress had no key."""
    return row["double_buffering"], row.get("progress")


def _label(row):
    return (f"N={row['minibatch']} {_run_name(row['exchange'], row.get('precision', 'float32'))}"
            f" DB {_db_name(*_mode(row))}")


def _run_name(exchange, precision):
    """A row's exchange name, +mixed for mixed precision (float32 rows keep their names)."""
    return exchange if precision == "float32" else f"{exchange}+{precision}"


def _ranks_name(run):
    """K=2, or a data x model grid (--grid) with M > 1: grid 1x2."""
    m = run.get("model_parallel", 1)
    return f"grid {run['ranks']}x{m}" if m > 1 else f"K={run['ranks']}"


def figures(res):
    out = {}
    for run in res["runs"]:
        for (n, mode, spec), overhead in qat_overheads(run).items():
            out[f"{_ranks_name(run)} N={n} DB {_db_name(*mode)} qat {spec} overhead"] = overhead
        for r in run["rows"]:
            key = f"{_ranks_name(run)} {_label(r)}"
            if "activation_share" in r:
                out[f"{key} activation share"] = r["activation_share"]
            out[f"{key} frames/s"] = r["frames_per_s"]
            out[f"{key} of roofline"] = r["roofline_fraction"]
            if r["exchange"] != "none":
                out[f"{key} comm overhead"] = r["comm_overhead"]
                out[f"{key} exchange ms"] = 1e3 * r["exchange_s"]
                if "wire_s" in r:
                    out[f"{key} comm ms / wire ms"] = r["comm_s"] / r["wire_s"]
    return out


def print_table(run):
    m = run.get("model_parallel", 1)
    k = f"K = {run['ranks']}" if m == 1 else \
        f"grid {run['ranks']} x {m} (data x model): {run['ranks'] * m}"
    print(f"\n{k} rank(s), {run['threads_per_rank']} thread(s) each, {run['params']:,} "
          f"parameters; median of {run['rounds']} x {run['steps']} steps, slowest rank. Limits: "
          f"roofline = the step's GEMMs alone (of roof: ratio of the medians; paired: median "
          f"of each round's ratio); no-exch = the exchange skipped")
    wire = any("wire_s" in r for r in run["rows"])
    if wire:
        print("comm ms = MPI time per step; wire ms = the step's bytes per rank at the link rate")
    print(f"{'N':>6s} {'exchange':>11s} {'DB':>9s} {'frames/s':>9s} {'roofline':>9s} "
          f"{'of roof':>7s} {'paired':>7s} {'no-exch':>8s} {'overhead':>8s} {'exch ms':>8s} "
          + (f"{'comm ms':>8s} {'wire ms':>8s} " if wire else "") +
          f"{'compute':>7s} {'encode':>6s} {'comm':>6s} {'update':>6s} {'other':>6s}")
    for r in run["rows"]:
        f = r["fractions"]
        none = r["exchange"] == "none"
        print(f"{r['minibatch']:>6d} {_run_name(r['exchange'], r.get('precision', 'float32')):>11s} "
              f"{_db_name(*_mode(r)):>9s} "
              f"{r['frames_per_s']:>9.1f} {r['roofline_frames_per_s']:>9.1f} "
              f"{r['roofline_fraction']:>7.1%} {r['roofline_fraction_paired']:>7.1%} "
              f"{r['skip_frames_per_s']:>8.1f} "
              f"{'' if none else format(r['comm_overhead'], '.1%'):>8s} "
              f"{'' if none else format(1e3 * r['exchange_s'], '.1f'):>8s} "
              + (f"{'' if none else format(1e3 * r['comm_s'], '.1f'):>8s} "
                 f"{'' if none else format(1e3 * r['wire_s'], '.1f'):>8s} " if wire else "")
              + " ".join(f"{f[c]:>{w}.0%}" for c, w in
                         (("compute", 7), ("encode", 6), ("communicate", 6), ("update", 6),
                          ("other", 6))))


def qat_overheads(run):
    """{(N, mode, variant): the QAT step's time per frame / the float step's - 1}, exchange
    skipped (the fake quantization's own cost, the --qat variants)."""
    base = {(r["minibatch"], _mode(r)): r["frames_per_s"] for r in run["rows"]
            if r["exchange"] == "none" and r.get("precision", "float32") == "float32"}
    return {(r["minibatch"], _mode(r), r["precision"][4:]):
            base[(r["minibatch"], _mode(r))] / r["frames_per_s"] - 1.0
            for r in run["rows"] if r["exchange"] == "none"
            and r.get("precision", "").startswith("qat:")}


def print_qat_overhead(run):
    for (n, mode, spec), overhead in qat_overheads(run).items():
        print(f"fake quantization {spec} at N = {n} (DB {_db_name(*mode)}): {overhead:+.1%} "
              f"time per frame against the float step (exchange skipped)")


def print_activation_memory(run):
    """Activations and their gradients per rank (each layer's output, the backward's delta,
    the recurrent workspaces), per precision as this rank's models store them: float32; mixed
    on CPU ranks keeps float16 values in float32 buffers (the emulation), on GPU ranks float16
    arrays (half the bytes); bf16 likewise, bfloat16 bits in uint16 arrays on GPU ranks. Plus each 16-bit precision's
    weight and input copies, and on a real GPU what the driver saw a model of each precision
    take (its free memory before and after building one: every buffer, whole pages)."""
    by_precision = run.get("activation_bytes_by_precision") or {"float32": run.get(
        "activation_bytes", {})}
    extra = run.get("copy_bytes_by_precision", {})
    device = run.get("device_bytes_by_precision", {})
    for n in sorted(next(iter(by_precision.values()), {}), key=int):
        parts = []
        for precision, mem in by_precision.items():
            dtype = {"float16": "float16", "uint16": "bfloat16"}.get(
                run.get("storage", {}).get(precision), "float32")
            part = f"{precision} {mem[n] / 2 ** 20:.1f} MiB ({dtype})"
            if extra.get(precision):
                part += f" + {extra[precision][n] / 2 ** 20:.1f} MiB weight and input copies"
            parts.append(part)
        print(f"activation memory per rank at N = {n}: " + "; ".join(parts))
    for precision, mem in device.items():
        print(f"device memory of a {precision} model (max_batch {run['max_local']}), driver's "
              f"free memory before - after building it: {mem / 2 ** 20:.1f} MiB")


def print_table4(res):
    """The paper's Table 4, ours: frames/s over N, without and with double buffering."""
    ns = res["minibatches"]
    where = (f"emulated {res['link_gbps']:g} Gbit/s links" if res["link_gbps"]
             else "one machine, shared memory")
    print(f"\nTable 4 ({where}): frames/s over minibatch size N, without and with half-batch "
          f"double buffering")
    print(f"{'K':>2s} {'exchange':>11s} {'':>14s} " + " ".join(f"{n:>7d}" for n in ns))
    for run in res["runs"]:
        for ex in res["exchanges"]:
            fps = {(r["minibatch"], _mode(r)): r["frames_per_s"]
                   for r in run["rows"] if r["exchange"] == ex}
            modes = sorted({m for _, m in fps}, key=lambda m: (m[0], str(m[1])))
            for m in modes:
                print(f"{run['ranks']:>2d} {ex:>11s} {'DB ' + _db_name(*m):>14s} "
                      + " ".join(f"{fps[(n, m)]:>7.1f}" for n in ns))
            for m in modes[1:]:
                print(f"{'':>2s} {'':>11s} {'gain ' + _db_name(*m):>14s} "
                      + " ".join(f"{fps[(n, m)] / fps[(n, modes[0])] - 1:>+7.1%}" for n in ns))


# ---- rank side (under mpiexec, started by run() through launch.mpirun) -----------------------
def exchange_config(name, device="cpu"):
    """The trainer's config for an exchange name (make_exchange builds the object from it)."""
    from hpcsgd import config
    if name == "allreduce":       # the trainer's default: overlapped where it applies
        over = ["exchange.aggregation=allreduce"]
    elif name == "allreduce_serial":   # one Allreduce after the backward pass
        over = ["exchange.aggregation=allreduce", "exchange.overlap=false"]
    elif name == "allreduce16":
        over = ["exchange.aggregation=allreduce", "exchange.allreduce_dtype=float16"]
    elif name.startswith("kbit"):
        over = ["exchange.aggregation=striped", "exchange.codec=kbit", f"exchange.bits={name[4:]}"]
    else:
        over = ["exchange.aggregation=striped", f"exchange.codec={name}"]
    return config.load(None, ["data.train=unused", f"train.device={device}"] + over)


class Local:
    """The exchange skipped (the no-exch limit): each rank applies its own local gradient,
    post-processing and update in the optimizer's one fused pass (Optimizer.fused_update).
    The exchange interface of hpcsgd/comm/exchange.py with no communication at all."""
    PHASE = {"encode": None, "send": None, "owner": None, "gather": None, "update": "apply"}
    fuses_owner = fuses_apply = True
    poller = None

    def __init__(self, opt):
        self.opt, self.grad = opt, None

    def encode(self, grad):
        self.grad = grad

    def send(self, blocking=False):
        pass

    def test(self):
        pass

    def wait(self):
        pass

    def owner_pass(self, params, opt):
        pass      # in fused_update

    def gather(self):
        pass

    def decode_apply(self, params, lr):
        self.opt.fused_update(params, self.grad, lr)

    def bytes_on_wire(self):
        return 0


class Rank:
    """This rank's model, buffers and random frames, and the timed step loops."""

    def __init__(self, comm, shape, activation, max_local, device="cpu", precisions=("float32",),
                 grid=None):
        from hpcsgd.model import build
        from hpcsgd.model.parallel import ModelGroup
        # the data rank: the ranks of a model group take the same frames (grid: --grid)
        self.comm, self.world = comm, comm.Get_size()
        self.rank = grid.data_rank if grid is not None else comm.Get_rank()
        self.device, self.unit = device, unit_of(shape)
        self.models = {}   # precision -> (model, params, the 2 gradient buffers)
        # "float32", "mixed", "qat:SPEC" (parse_qat) or "act:CODEC" (a split model's
        # activation codec; float32 activations are "float32")
        for precision in precisions:
            qat = parse_qat(precision[4:]) if precision.startswith("qat:") else None
            group = None
            if grid is not None and grid.model_size > 1:
                group = ModelGroup(grid.model, precision[4:] if precision.startswith("act:")
                                   else "float32")
            model = build(dict(builder_shape(shape), activation=activation,
                               **({"qat": qat} if qat else {})),
                          max_batch=max_local, device=device, group=group,
                          precision="float32" if qat or group else precision)
            model.set_dropout(shape.get("dropout", 0.0))
            params = model.new_params()
            model.init(params, np.random.default_rng(0))      # replicas start equal
            self.models[precision] = (model, params, gradient_buffers(model, True))
        self.model, self.params, self.grads = self.models[precisions[0]]
        rng = np.random.default_rng(1 + self.rank)
        self.x = rng.standard_normal((max_local, shape["input_dim"]), dtype=np.float32)
        self.ctc = of_model(shape).UTTERANCES   # token targets of utterances
        if self.ctc:   # whole utterances: n frames are n / steps of them, time-major
            self.shape, self.rng = shape, rng
            self.targets = {}
        else:
            self.y = rng.integers(0, shape["num_labels"], max_local).astype(np.int32)

    def labels(self, n):
        """What the loss of n frames needs: frame labels, or a CTC batch's targets (made
        once per n: the same utterances every step, as the same frames are)."""
        if not self.ctc:
            return self.y[:n]
        if n not in self.targets:
            self.targets[n] = utterance_targets(self.shape, n, self.rng)
        return self.targets[n]

    def batch(self, n):
        return self.x[:n], self.labels(n)

    def halve(self, take):
        """Double buffering of whole utterances: the first half of each rank's (the
        trainer's loader takes every other one; here all have one length)."""
        return halves(take, self.unit)

    def slowest(self, seconds):
        from mpi4py import MPI
        return self.comm.allreduce(seconds, op=MPI.MAX)

    def mean_over_ranks(self, seconds):
        """{name: seconds} averaged over the ranks (every rank has the same names)."""
        from mpi4py import MPI
        keys = sorted(seconds)
        v = np.array([seconds[k] for k in keys], np.float64)
        self.comm.Allreduce(MPI.IN_PLACE, v, op=MPI.SUM)
        return dict(zip(keys, (v / self.world).tolist()))

    def gemm_time(self, parts, repeats):
        """The parts' matmuls alone on every rank at once: median of the slowest rank (the
        step's forward and backward with every element-wise kernel skipped)."""
        samples = []
        for _ in range(repeats + 1):
            self.comm.Barrier()
            t = time.perf_counter()
            for part in parts:
                n = int(part[self.rank])
                if n:
                    self.model.forward_backward(self.params, self.grads[0], self.x,
                                                self.labels(n), n, ops=GemmOnly())
            synchronize(self.device)   # GPU ranks: the GEMMs queued on the device are done
            samples.append(self.slowest(time.perf_counter() - t))
        return statistics.median(samples[1:])

    def loop(self, ex, opt, take, steps, warmup, double_buffering, progress=None,
             precision="float32"):
        """The trainer's step (hpcsgd/step.py), `steps` times after `warmup`, on take[r] frames
        per rank; ex a Local = the exchange skipped; mixed precision with a static loss scale
        of 1 (the vote and unscale run; a skipped step would void the timing: an error).
        Returns this rank's step times and its seconds per step by category and by exchange
        phase, over the timed steps."""
        from hpcsgd.comm.progress import Poller
        from hpcsgd.loss_scale import Static
        if not isinstance(ex, Local):
            ex.poller = Poller() if progress == "thread" else None
        model, params, grads = self.models[precision]
        step = Step(model, params, grads, opt, ex, double_buffering, progress or "none",
                    device=self.device,
                    scaler=Static(1.0) if precision == "mixed" else None, unit=self.unit,
                    halve=self.halve if self.ctc else None)
        marks, ce = [], 0.0
        group = next((layer.group for layer in model.layers if hasattr(layer, "group")), None)
        act = (0.0, 0)
        self.comm.Barrier()
        for s in range(warmup + steps):
            if s == warmup:       # timing starts here; the pipeline keeps running through
                step.phases.pop()
                step.pop_compute()
                host = census.snapshot()
                if group is not None:
                    act = (group.seconds, sum(group.received.values()))
            marks.append(time.perf_counter())
            ce = step.run(self.batch, take, self.rank, LR, "bench train")[0]
        marks.append(time.perf_counter())
        # GPU ranks: what the host did per step (launches, syncs, copies: hpcsgd/census.py),
        # before the phases are read (a wait for the last phase's event)
        asked = census.since(host, steps) if self.device == "cuda" else {}
        exchanges = step.phases.exchanges
        phases = {p: v * exchanges / steps for p, v in step.phases.pop().items()}
        phases.update({f"host_{k}": v for k, v in asked.items()})
        if group is not None:   # model-parallel traffic: seconds and bytes received per step
            phases["activation"] = (group.seconds - act[0]) / steps
            phases["activation_bytes"] = (sum(group.received.values()) - act[1]) / steps
        compute = step.pop_compute()
        step.drain()                               # drain (not timed)
        cats = {"compute": compute / steps}
        for cat, names in CATEGORIES.items():
            cats[cat] = sum(phases.get(p, 0.0) for p in names)
        if not np.isfinite(ce):
            raise FloatingPointError(f"rank {self.rank}: cross-entropy {ce} (lower bench LR)")
        if step.scaler is not None and step.scaler.skipped:
            raise FloatingPointError(f"rank {self.rank}: {step.scaler.skipped} mixed-precision "
                                     f"step(s) overflowed float16 and were skipped: no timing")
        return np.diff(marks)[warmup:], cats, phases


def measure(r, samples, n, db, exchanged):
    """One row from a configuration's samples (one r.loop result per round), reduced over
    rounds and ranks: the median of the slowest rank's step times, mean seconds per step."""
    from mpi4py import MPI
    times = np.concatenate([t for t, _, _ in samples])
    step_max = np.empty_like(times)
    r.comm.Allreduce(times, step_max, op=MPI.MAX)     # a step lasts until its slowest rank
    step = float(np.median(step_max))
    mean_step = float(step_max.mean())     # the categories are means: fractions of the mean
    cats, phases = ({k: float(np.mean([s[i][k] for s in samples])) for k in samples[0][i]}
                    for i in (1, 2))
    cats, phases = (r.mean_over_ranks(d) for d in (cats, phases))
    host = {k[5:]: phases.pop(k) for k in list(phases) if k.startswith("host_")}
    fractions = {k: v / mean_step for k, v in cats.items()}
    fractions["other"] = 1.0 - sum(fractions.values())
    return {"minibatch": n, "double_buffering": db, "step_s": step, "step_s_all": step_max.tolist(),
            "frames_per_s": n / step, "seconds": cats, "fractions": fractions,
            "phases_s": phases, **({"host_per_step": host} if host else {}),
            "exchange_s": sum(cats[c] for c in CATEGORIES) if exchanged else 0.0}


def paired_fraction(gemm_s, step_s_all, per_round):
    """The roofline fraction taken round by round, then the median over rounds: each round's
    GEMM time over the median of that round's steps. The GEMMs and the steps of one round run
    seconds apart, those of different rounds a minute apart, so on a VM whose speed drifts
    this pairs figures the drift has touched alike (the row's roofline_fraction divides the
    medians over all rounds)."""
    if len(gemm_s) != len(per_round) or sum(per_round) != len(step_s_all):
        raise ValueError(f"paired_fraction: {len(gemm_s)} GEMM rounds, rounds of {per_round} "
                         f"steps, {len(step_s_all)} step times")
    ratios, at = [], 0
    for gemm, k in zip(gemm_s, per_round):
        ratios.append(gemm / float(np.median(step_s_all[at:at + k])))
        at += k
    return float(np.median(ratios))


def wire(ex, size):
    """(bytes this rank sends per exchange, bits per value on the wire)."""
    if hasattr(ex, "send_buf"):   # striped: the packed buffer of all stripes
        return ex.bytes_on_wire(), 8.0 * ex.send_buf.size / size
    return ex.bytes_on_wire(), 16.0 if ex.dtype == "float16" else 32.0


def worker(argv):
    from mpi4py import MPI

    from hpcsgd.comm import make_exchange
    from hpcsgd.data.loader import batch_split
    from hpcsgd.optim import Optimizer

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    _, ns, modes = _settings(args)
    from hpcsgd.comm.grid import Grid
    comm = MPI.COMM_WORLD
    grid = Grid(comm, args.model_parallel)
    K, dev = grid.data_size, args.device   # data ranks: the minibatch is dealt over them
    _, shape, activation, _ = model_of(args)
    if dev == "cuda":   # one GPU per local rank, before any allocation on one
        from hpcsgd.comm.gpu import bind_gpu
        bind_gpu(grid.node_rank)
        census.install()
    precisions = args.precision.split(",")
    if not set(precisions) <= {"float32", "mixed", "bf16"}:
        raise SystemExit(f"--precision {args.precision}: expected float32, mixed and/or bf16")
    precisions += [f"qat:{spec}" for spec in args.qat.split(",") if spec]
    if grid.model_size > 1:
        precisions += [f"act:{c}" for c in args.activation_codec.split(",") if c != "float32"]
    unit = unit_of(shape)   # an LSTM's rows are whole chunks (steps = chunk: no context)
    max_local = max(int(batch_split(n, K, unit)[0]) for n in ns)
    r = Rank(comm, shape, activation, max_local, dev, precisions, grid)
    if args.cuda_graphs:   # train.cuda_graphs: every float model's pass as a CUDA Graph
        if dev != "cuda":
            raise SystemExit("--cuda-graphs: GPU ranks only (--device cuda)")
        for precision, (model, _, _) in r.models.items():
            if not precision.startswith(("qat:", "act:")):
                model.use_cuda_graphs()
    size = r.params.size
    flop = r.model.gemm_flop_per_frame()
    configs = [(n, mode, batch_split(n, K, unit)) for n in ns for mode in modes]
    # every exchange (and the skipped one: a replicated momentum optimizer) built once
    runs, precision_of = {}, {}
    for precision in precisions:
        params = r.models[precision][1]   # a QAT model has its learned clips besides
        local_opt = Optimizer(params.size, momentum_time_constant=MOMENTUM_TC, device=dev)
        runs[_run_name("none", precision)] = (Local(local_opt), local_opt)
        for name in args.exchange.split(","):
            ex = make_exchange(exchange_config(name, dev), grid.data, params.matrices,
                               grid.model if grid.model_size > 1 else None)
            runs[_run_name(name, precision)] = (ex, Optimizer(
                params.size, momentum_time_constant=MOMENTUM_TC, post_size=ex.state_size,
                device=dev))
        precision_of.update({_run_name(name, precision): precision
                             for name in ["none"] + args.exchange.split(",")})
    torch_rank, torch_runs = None, []
    if args.pytorch:   # what users would run instead, the same threads per rank
        import numba

        from hpcsgd.bench.pytorch import VARIANTS, TorchRank, variants_for
        torch_runs = variants_for(precisions, dev, args.pytorch_compile, K)
        torch_rank = TorchRank(comm, shape, activation, r.x.shape[0], numba.get_num_threads(),
                               LR, MOMENTUM, device=dev, variants=torch_runs, targets=r.labels)
        precision_of.update({v: VARIANTS[v][0] for v in torch_runs})
    rows, skip, roof = [], {}, {}
    for n in ns:
        here = [(mode, take) for m, mode, take in configs if m == n]
        # rounds: the GEMMs alone, the loop without exchange and with each exchange, with and
        # without double buffering (and each progress mode), in turn, so that each figure, its
        # limits and the other modes see the same neighbours on a shared machine
        gemm_s = {mode: [] for mode, _ in here}
        samples = {(name, mode): [] for name in runs for mode, _ in here}
        for _ in range(args.rounds):
            for mode, take in here:
                parts = [p for p in (halves(take, unit) if mode[0] else [take]) if p.sum()]
                gemm_s[mode].append(r.gemm_time(parts, args.steps))
                for name, (ex, opt) in runs.items():
                    samples[(name, mode)].append(r.loop(ex, opt, take, args.steps, args.warmup,
                                                        *mode, precision=precision_of[name]))
                for variant in (torch_runs if not mode[0] else []):
                    samples.setdefault((variant, mode), []).append(
                        torch_rank.loop(take, args.steps, args.warmup, variant))
        names = list(runs) + torch_runs
        for (mode, take), name in ((m, name) for m in here for name in names):
            if (name, mode) not in samples:   # PyTorch: without double buffering only
                continue
            ex = runs[name][0] if name in runs else None   # "none" first: the others'
            parts = [p for p in (halves(take, unit) if mode[0] else [take]) if p.sum()]  # overhead
            roof[(n, mode)] = statistics.median(gemm_s[mode])
            row = dict(measure(r, samples[(name, mode)], n, mode[0],
                               not name.startswith("none") and name not in torch_runs),
                       exchange=name.split("+")[0], progress=mode[1],
                       precision=precision_of.get(name, "float32"))
            row["roofline_fraction_paired"] = paired_fraction(
                gemm_s[mode], row["step_s_all"], [len(t) for t, _, _ in samples[(name, mode)]])
            if grid.model_size > 1 and name not in torch_runs:   # the model-parallel traffic
                act = row["precision"][4:] if row["precision"].startswith("act:") else "float32"
                row.update(activation_codec=act,
                           activation_s=row["phases_s"].pop("activation"),
                           activation_bytes_per_step=row["phases_s"].pop("activation_bytes"))
                row["activation_share"] = row["activation_s"] / row["step_s"]
            if row["exchange"] == "none":
                skip[(n, mode, row["precision"])] = row["frames_per_s"]
            else:
                nbytes, bits = ((torch_rank.bytes_on_wire(size), 32.0) if name in torch_runs
                                else wire(ex, size))
                row.update(bytes_per_rank=nbytes, bits_per_value=bits,
                           exchanges_per_step=len(parts),
                           comm_overhead=1.0 - row["frames_per_s"]
                           / skip[(n, mode, row["precision"])])
            rows.append(row)
            if comm.Get_rank() == 0:
                h = row.get("host_per_step")
                print(f"  {'K=' + str(K) if grid.model_size == 1 else 'grid ' + grid.describe()}"
                      f" {_label(row)}: {row['frames_per_s']:.1f} frames/s"
                      + (f"; per step {h['launches']:.0f} launches ({h['small_launches']:.0f} "
                         f"under {census.FILL_BLOCKS} blocks), {h['syncs']:.0f} host syncs, "
                         f"{h['allocations']:.0f} allocations, {h['h2d_bytes']:.0f} B to and "
                         f"{h['d2h_bytes']:.0f} B from the device" if h else ""), flush=True)
    for row in rows:
        key = (row["minibatch"], _mode(row))
        row.update(skip_frames_per_s=skip[key + (row["precision"],)], gemm_only_s=roof[key],
                   roofline_frames_per_s=row["minibatch"] / roof[key],
                   roofline_fraction=roof[key] / row["step_s"],
                   gflops=flop * row["minibatch"] / row["step_s"] / 1e9,
                   gemm_only_gflops=flop * row["minibatch"] / roof[key] / 1e9)
    if torch_rank is not None:
        torch_rank.close()
    # activations (each layer's output, overwritten by its dz), the backward's delta and the
    # recurrent layers' workspaces (gates, cells, one step's products), per row
    layers = r.model.layers
    row_floats = (sum(layer.n_out for layer in layers) + max(layer.n_in for layer in layers[1:])
                  + sum(a.size // r.model.max_batch for ws in r.model.workspaces if ws
                        for a in ws.values()))
    acts = {str(n): int(batch_split(n, K, unit)[0]) * row_floats * 4 for n in ns}
    # per precision, the bytes of each model's own buffers (Network.activation_bytes: float16
    # arrays for mixed on GPU ranks); the 16-bit weight and input copies apart
    memory = {"activation_bytes_by_precision": {}, "copy_bytes_by_precision": {},
              "storage": {}, "device_bytes_by_precision": {}, "max_local": max_local}
    for precision, (model, _, _) in r.models.items():
        if precision not in ("float32", "mixed", "bf16"):
            continue
        x16 = model.activation_buffers().get("x16")
        x16_bytes = x16.size * x16.dtype.itemsize if x16 is not None else 0
        per_n = {str(n): int(batch_split(n, K, unit)[0]) for n in ns}
        memory["activation_bytes_by_precision"][precision] = {
            n: model.activation_bytes(k) - x16_bytes * k // model.max_batch
            for n, k in per_n.items()}
        if model.half:
            w16 = model.w16.flat.size * model.w16.flat.dtype.itemsize
            memory["copy_bytes_by_precision"][precision] = {
                n: w16 + x16_bytes * k // model.max_batch for n, k in per_n.items()}
        memory["storage"][precision] = str(model.storage)
        from hpcsgd.device import simulated
        if dev == "cuda" and not simulated():   # what the driver saw: a model built again
            from hpcsgd.lazy_cuda import cuda
            from hpcsgd.model import build
            synchronize("cuda")
            free = cuda.current_context().get_memory_info()[0]
            again = build(dict(builder_shape(shape), activation=activation), max_batch=max_local,
                          device=dev, precision=precision)
            synchronize("cuda")
            memory["device_bytes_by_precision"][precision] = \
                free - cuda.current_context().get_memory_info()[0]
            del again
    launch.write_result(comm, {"ranks": K, "grid": f"{K}x{grid.model_size}",
                               "model_parallel": grid.model_size, "params": size,
                               "steps": args.steps,
                               "activation_bytes": acts, **memory,
                               "rounds": args.rounds, "warmup": args.warmup, "gflop_per_frame": flop / 1e9,
                               "load_average_end": report.load_average(), "rows": rows},
                        args.json)
    return 0


if __name__ == "__main__":
    sys.exit(worker(sys.argv[1:]))
