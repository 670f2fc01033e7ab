"""`hpcsgd bench int4`: an INT4 model's matrix products on this CPU, float32 beside integer --
what the INT4 paper's deployment buys on the machine at hand.

    hpcsgd bench int4 [--config jobs/configs/so762_rnnt.yaml | --ibm] [--utterances 8]
                      [--seconds 10] [--beam 4] [--threads 1] [--repeats 20] [--json FILE]

An INT4 export (hpcsgd export --int4) holds each weight matrix as 4-bit codes k and a step s;
the inputs the QAT model quantizes are codes on their own grid. A layer's product is then an
integer one, k_x @ k_W in int32, scaled once by s_x s_W. No x86 CPU multiplies 4-bit values:
the codes run on the int8 path (AVX-512 VNNI / AVX-VNNI vpdpbusd: four 8-bit products summed
into each 32-bit lane; AMX on Sapphire Rapids and later). NumPy has no integer BLAS, so the
integer products go through oneDNN's kernel in PyTorch (torch._int_mm: int8 x int8 -> int32),
a benchmark peer, never a dependency (`pip install torch==2.13.0` beside hpcsgd); without it
the integer columns are skipped and the output says so.

Each product of the model (from the config: every LSTM layer of the encoder and of an RNN-T's
prediction network) in the shapes inference gives it:
  input   all frames of a batch at once: (utterances x T' frames) x n_in @ n_in x 4H per
          direction (both directions side by side, as hpcsgd's BLSTM runs them)
  step    one recurrent step: utterances x H @ H x 4H, T' times per direction
  pred    a prediction-network step of beam search: (utterances x beam) x (E + H_p) @
          (E + H_p) x 4H_p, once per encoder frame (the bound: every hypothesis grew)
timed three ways: float32 (NumPy's BLAS, what hpcsgd's layers run), int8 GEMM alone, and the
integer layer's whole product (quantize the float input to int8 on its grid, GEMM, scale the
int32 sums back to float32). Each against this machine's limits measured in the same run: the
float32 GEMM rate and the int8 GEMM rate of a large square product. Every integer product is
checked against NumPy's int64 one (exact: the sums fit in int32). The model line sums the
products of one utterance-second, the first encoder layer float32 on both sides (the paper's
recipe keeps it so: qat.first_layer).
"""
import time

import numpy as np

from hpcsgd import threads as thread_pools
from hpcsgd.bench import membw

SQUARE, SQUARE_SMALL = 1536, 256   # the limits' square products
FRAME_RATE = 100                   # feature frames per second (10 ms shift)
EXAMPLES = """examples:
  hpcsgd bench int4 --config jobs/configs/so762_rnnt.yaml --json docs/bench/int4.json
  hpcsgd bench int4 --ibm --beam 16                             the paper's model
  hpcsgd bench int4 --small                                     seconds"""


def add_arguments(parser):
    parser.add_argument("--small", action="store_true", help="tiny shapes, for a CI smoke test")
    parser.add_argument("--config", default="jobs/configs/so762_rnnt.yaml",
                        help="the model whose LSTM products are timed (CTC or RNN-T config)")
    parser.add_argument("--ibm", action="store_true",
                        help="the INT4 paper's Switchboard RNN-T instead (6 BLSTM x 640, "
                             "a 768 prediction network, 152-frame utterances)")
    parser.add_argument("--utterances", type=int, default=8, help="utterances decoded together")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each utterance")
    parser.add_argument("--beam", type=int, default=4, help="beam of the prediction network")
    parser.add_argument("--threads", type=int, default=1,
                        help="BLAS / PyTorch threads (default 1: figures per core)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs, best kept")


def cpu_int8_features():
    """The CPU's int8 dot-product instructions, from /proc/cpuinfo's flags."""
    try:
        flags = next(line.split(":", 1)[1].split() for line in open("/proc/cpuinfo")
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in flags]


# --small: a tiny RNN-T (no archive needed)
SMALL = {"model.type": "rnnt", "model.encoder": ["stack 3", "blstm 16", "blstm 16"],
         "model.predictor": ["lstm 16"], "model.embed": 8, "input_dim": 40}
# --ibm: the INT4 paper's Switchboard RNN-T (seeds/004: 6 BLSTM layers of 640 per direction
# over 240 features + a 100-dim i-vector, frames at 20 ms: 152 on average; a prediction
# network of one LSTM of 768; its embedding size is not given: 256 here)
IBM = {"model.type": "rnnt", "model.encoder": ["blstm 640"] * 6,
       "model.predictor": ["lstm 768"], "model.embed": 256, "input_dim": 340,
       "frame_rate": 50}
IBM_SECONDS = 152 / 50   # its mean utterance: 152 frames of 20 ms


def model_of(path):
    """The config's model keys and its archive's feature dimension (input_dim)."""
    from hpcsgd import config
    from hpcsgd.data import archive
    cfg = config.load(path, [])
    try:
        index = archive.read_index(cfg["data.train"])
    except (OSError, ValueError) as e:
        raise SystemExit(f"hpcsgd bench int4: {path}: its training archive "
                         f"{cfg['data.train']} gives the input size ({e}); prep it first "
                         f"(docs/ctc.md)") from None
    return dict(cfg, input_dim=index["feature_dim"])


def products(cfg, utterances, seconds, beam):
    """[(label, layer, m, k, n, calls per utterance-second)] of the model's LSTM products."""
    from hpcsgd.model.encoder import parse_spec
    rate = cfg.get("frame_rate", FRAME_RATE)   # the input's frames per second
    t = max(1, int(round(rate * seconds)))
    out, n_in, lstm = [], cfg["input_dim"], 0
    for text in cfg["model.encoder"]:
        spec = parse_spec(text)
        kind, units = spec["kind"], spec["units"]
        if kind == "stack":
            t, n_in = -(-t // units), n_in * units
            continue
        if kind == "conv":
            t, n_in = -(-t // spec["stride"]), units
            continue
        if kind not in ("lstm", "blstm"):
            n_in = units
            continue
        dirs = 2 if kind == "blstm" else 1
        per_second = 1.0 / seconds   # one batch of utterances of `seconds` each
        out.append((f"enc{lstm} input", lstm, utterances * t, n_in, 4 * units * dirs,
                    per_second / utterances))
        out.append((f"enc{lstm} step", lstm, utterances, units, 4 * units,
                    t * dirs * per_second / utterances))
        n_in, lstm = units * dirs, lstm + 1
    if cfg["model.type"] == "rnnt":
        # beam search: at most one prediction step per encoder frame for the beam's grown
        # hypotheses (decode/rnnt.py), timed at its bound, every hypothesis grown
        p_in = cfg["model.embed"]
        for k, text in enumerate(cfg["model.predictor"]):
            units = parse_spec(text)["units"]
            out.append((f"pred{k} step", lstm + k, utterances * beam, p_in + units, 4 * units,
                        t / seconds / utterances))
            p_in = units
    return out


class IntegerProduct:
    """k_x @ k_W through torch._int_mm into preallocated tensors; `layer()` is the whole
    integer product of a float input (quantize on its grid, GEMM, scale back)."""

    def __init__(self, torch, x, codes, step_x, step_w):
        self.torch = torch
        m, n = x.shape[0], codes.shape[1]
        self.x = torch.from_numpy(x)
        self.inv, self.scale = 1.0 / step_x, step_x * step_w
        self.xf = torch.empty_like(self.x)
        self.xq = torch.from_numpy(np.clip(np.rint(x / step_x), -127, 127).astype(np.int8))
        self.w = torch.from_numpy(codes)
        self.acc = torch.empty((m, n), dtype=torch.int32)
        self.y = torch.empty((m, n), dtype=torch.float32)

    def gemm(self):
        self.torch._int_mm(self.xq, self.w, out=self.acc)

    def layer(self):
        torch = self.torch
        torch.mul(self.x, self.inv, out=self.xf)
        self.xf.round_().clamp_(-127, 127)
        self.xq.copy_(self.xf)
        torch._int_mm(self.xq, self.w, out=self.acc)
        torch.mul(self.acc, self.scale, out=self.y)


def best(fn, repeats):
    fn()
    return membw.best_time(fn, repeats)


def limits(torch, size, repeats):
    """(float32 GFLOP/s, int8 GOP/s or None) of one size x size x size product."""
    from hpcsgd.bench.gemm import gemm_timer
    run, flop = gemm_timer(size, size, size)
    f32 = flop / best(run, repeats) / 1e9
    if torch is None:
        return f32, None
    a = torch.randint(-7, 8, (size, size), dtype=torch.int8)
    c = torch.empty((size, size), dtype=torch.int32)
    i8 = flop / best(lambda: torch._int_mm(a, a, out=c), repeats) / 1e9
    return f32, i8


def run(args):
    try:
        import torch
    except ImportError:
        torch = None
    n_threads = int(args.threads)
    thread_pools.blas_threads(n_threads)
    if torch is not None:
        torch.set_num_threads(n_threads)
    repeats = args.repeats or (2 if args.small else 20)
    cfg = SMALL if args.small else IBM if args.ibm else model_of(args.config)
    utt, secs = ((2, 0.3) if args.small else (args.utterances, IBM_SECONDS) if args.ibm
                 else (args.utterances, args.seconds))
    shapes = products(cfg, utt, secs, args.beam)
    features = cpu_int8_features()
    name = "small" if args.small else "the INT4 paper's RNN-T" if args.ibm else args.config
    print(f"hpcsgd bench int4: {name} ({cfg['model.type']}), {utt} utterances of "
          f"{secs:g} s, beam {args.beam}, {n_threads} thread(s); best of {repeats}; int8 "
          f"instructions of this CPU: {', '.join(features) or 'none'}; integer GEMMs by "
          + (f"torch {torch.__version__} (oneDNN, torch._int_mm)" if torch is not None else
             "nothing: PyTorch is not installed, the integer columns are skipped "
             "(pip install torch==2.13.0)"))
    f32_peak, i8_peak = limits(torch, SQUARE_SMALL if args.small else SQUARE, repeats)
    rng = np.random.default_rng(0)
    rows = []
    for label, layer, m, k, n, calls in shapes:
        x = rng.standard_normal((m, k), dtype=np.float32)
        codes = rng.integers(-7, 8, (k, n)).astype(np.int8)   # 4-bit codes, held in int8
        step_w, step_x = 0.05, 4.0 / 127                      # the grids' steps
        w = codes.astype(np.float32) * step_w
        y = np.empty((m, n), np.float32)
        flop = 2.0 * m * k * n
        row = {"product": label, "layer": layer, "m": m, "k": k, "n": n,
               "calls_per_second": calls, "f32_ms": 1e3 * best(
                   lambda: np.matmul(x, w, out=y), repeats),
               "int8_ms": None, "int8_layer_ms": None}
        if torch is not None:
            p = IntegerProduct(torch, x, codes, step_x, step_w)
            p.gemm()
            exact = p.xq.numpy().astype(np.int64) @ codes.astype(np.int64)
            if not np.array_equal(p.acc.numpy(), exact):
                raise SystemExit(f"hpcsgd bench int4: torch._int_mm differs from NumPy's int64 "
                                 f"product on {label} ({m}x{k} @ {k}x{n})")
            row.update(int8_ms=1e3 * best(p.gemm, repeats),
                       int8_layer_ms=1e3 * best(p.layer, repeats))
        row["f32_gflops"] = flop / row["f32_ms"] / 1e6
        if row["int8_ms"]:
            row.update(int8_gops=flop / row["int8_ms"] / 1e6,
                       speedup=row["f32_ms"] / row["int8_ms"],
                       layer_speedup=row["f32_ms"] / row["int8_layer_ms"])
        rows.append(row)
    print(f"limits: float32 GEMM {f32_peak:.1f} GFLOP/s"
          + (f", int8 GEMM {i8_peak:.1f} GOP/s ({i8_peak / f32_peak:.2f}x)" if i8_peak else "")
          + f" ({SQUARE_SMALL if args.small else SQUARE}^3)")
    print(f"{'product':12} {'m':>5} {'k':>5} {'n':>5} | {'f32 ms':>8} {'of peak':>7} | "
          f"{'int8 ms':>8} {'of peak':>7} {'x f32':>6} | {'layer ms':>8} {'x f32':>6}")
    for r in rows:
        f32 = f"{r['f32_ms']:8.3f} {r['f32_gflops'] / f32_peak:7.1%}"
        i8 = (f"{r['int8_ms']:8.3f} {r['int8_gops'] / i8_peak:7.1%} {r['speedup']:6.2f} | "
              f"{r['int8_layer_ms']:8.3f} {r['layer_speedup']:6.2f}" if r["int8_ms"] else
              f"{'-':>8} {'-':>7} {'-':>6} | {'-':>8} {'-':>6}")
        print(f"{r['product']:12} {r['m']:5d} {r['k']:5d} {r['n']:5d} | {f32} | {i8}")
    model = model_totals(rows)
    print(f"one utterance-second of the model's LSTM products: float32 {model['f32_ms']:.2f} ms"
          + (f", INT4 on the int8 path {model['int4_ms']:.2f} ms ({model['speedup']:.2f}x; "
             f"the first encoder layer float32 in both)" if model["int4_ms"] else ""))
    print("layer: the integer product as a layer runs it (the float input quantized to int8, "
          "the GEMM, the int32 sums scaled back); x f32 > 1: the integer path is faster.")
    return {"config": name, "threads": n_threads, "utterances": utt, "seconds": secs,
            "beam": args.beam, "cpu_int8": features, "small": args.small,
            "torch": torch.__version__ if torch is not None else None,
            "f32_peak_gflops": f32_peak, "int8_peak_gops": i8_peak, "rows": rows,
            "model": model}


def model_totals(rows):
    """Milliseconds of the products of one utterance-second: float32, and INT4 with the first
    encoder layer float32 (None without the integer path)."""
    f32 = sum(r["f32_ms"] * r["calls_per_second"] for r in rows)
    if not all(r["int8_layer_ms"] for r in rows):
        return {"f32_ms": f32, "int4_ms": None, "speedup": None}
    int4 = sum((r["f32_ms"] if r["layer"] == 0 else r["int8_layer_ms"]) * r["calls_per_second"]
               for r in rows)
    return {"f32_ms": f32, "int4_ms": int4, "speedup": f32 / int4}


def figures(res):
    out = {"float32 GFLOP/s": res["f32_peak_gflops"], "model f32 ms": res["model"]["f32_ms"]}
    if res["model"]["int4_ms"]:
        out.update({"int8 GOP/s": res["int8_peak_gops"], "model int4 ms": res["model"]["int4_ms"],
                    "model speedup": res["model"]["speedup"]})
    return out
