"""`hpcsgd bench plan`: the paper's cost model (Seide et al. 2014, Eq. 4) — the optimal node count
K-hat and predicted speed-up over K for each codec and minibatch size, with and without
half-minibatch double buffering, from measured costs; validated against the paper's own costs
(Table 1, §5.1) and speeds (Table 5).

    hpcsgd bench plan [--small] [--json FILE] [--plot PNG] [--link-gbps 1,10,25]
                      [--latency-us 50] [--minibatch 1024,4096,16384] [--measure]
                      [--train-json F] [--exchange-json F]
                      [--grid 1x2,4x2,8x2] [--activation-codec float32|float16|dettmers]
                      [--mp-link-gbps 48] [--mp-latency-us 10]

Eq. 4 (per exchange; double buffering exchanges each half-minibatch while computing the next):

    K-hat = (N/2 * T_frm + C*T_post) / (T_comm_float / Z - T_upd)

T_frm: compute per frame (depends on the sub-batch size: Table 1); C*T_post: post-processing
that striping splits over K nodes; T_upd: fixed per-exchange cost on every node; Z = 32 / bits
per value on the wire. Predicted time per minibatch of N frames at K nodes:

    with DB:    2 * max(v(N/2K) + C*T_post/K + T_upd,  T_comm(K)/Z)     (§2.2: overlapped)
    without:        v(N/K)  + C*T_post/K + T_upd + T_comm(K)/Z          (§5.1: serialised)

with v(n) = n * T_frm(n), the variable time of one sub-batch (piecewise linear through the
measured points, extrapolated with the end slopes). If T_comm/Z <= T_upd the denominator is <= 0:
§2.3's case, communication cannot be saturated, K-hat is unbounded and the fixed cost limits
the speed. Derived communication (--link-gbps, --latency-us): a node sends and receives
2(K-1)/K of the gradient per exchange (ring allreduce, or striped Alltoallv + Allgatherv) in
2(K-1) messages: T_comm(K) = 2(K-1)/K * M*bits/8 / rate + 2(K-1) * latency.

hpcsgd's costs per codec (from `bench exchange` JSON, phases of one rank at the JSON's K):
float32 allreduce: T_upd = post_process + apply (every rank post-processes the whole model),
C*T_post = 0. Striped codec: T_upd = encode + decode_sum + decode_apply (each a pass over all M
values on every rank, whatever K), C*T_post = K * (post_process + reencode) (the owner's 1/K);
with the owner's fused pass (phase "owner") C*T_post = K * owner: its memory traffic is the
stripe's optimizer state and residual (1/K), the K packed contributions 1 bit per value.
T_frm from `bench train` JSON, or measured here per sub-batch size (--measure; --small: a tiny
model, seconds).

Model parallelism (Table 5's D x W rows, data x model; --grid for the user's model): each of the
D data-parallel groups is W ranks inside one node that split every weight matrix (n_in, n_out)
by output columns. Per exchange of n frames (n = N/2D with DB, N/D without) a rank computes
1/W of every layer, v(n)/W (T_frm stays that of sub-batch n: the GEMMs are n x n_in x n_out/W),
holds 1/W of the parameters, so T_upd and C*T_post (passes over its parameters) shrink to 1/W,
and exchanges only its 1/W of the gradient with its D-1 peers: T_comm_W(D)/Z, the link formula
above for M/W values (the latency term stays), or the paper's comm/Z divided by W. On top of
that the group exchanges activations over the node's link (activation_values), serial with
the compute, which waits for them:

    with DB:    2 * max(v(n)/W + (C*T_post/D + T_upd)/W + A(n),  T_comm_W(D)/Z)
    without:        v(n)/W + (C*T_post/D + T_upd)/W + A(n) + T_comm_W(D)/Z
    D = 1:          v(N)/W + (post + update)/W + A(N)        (no exchange, no DB)

A(n) = bytes/rate + ring steps * latency (activation_comm; --mp-link-gbps, --mp-latency-us).
W = 1 gives A = 0 and the formulas above exactly.
"""
import json
import math
import os
import sys
import time

import numpy as np

# ---- the paper's published costs (Seide et al. 2014) ---------------------------------------
# Table 1: sub-batch size -> T_frm [us] (variable cost per frame, one K20X, momentum+AdaGrad)
PAPER_TABLE1 = {256: 156, 512: 137, 1024: 122, 2048: 118, 4096: 115, 8192: 114}
PAPER_POST_PLUS_UPD_S = 18.2e-3   # §5.1: C*T_post + T_upd (momentum, two AdaGrad steps, update)
PAPER_UPD_S = 9e-3                # §5.1: "with quantization, our fixed cost T_upd is ~9 ms"
PAPER_COMM_Z_S = (3e-3, 6.5e-3, 10e-3)   # §5.1: Z^-1 T_comm_float 3..10 ms (Z = 32); mid 6.5
PAPER_M = 46e6
# Table 5, data x 1 (no model parallelism) rows: kfps for N = 2880 and 16384, farm / 8-GPU
PAPER_TABLE5 = {(1, 2880): (7.5, 7.4), (1, 16384): (8.2, 8.0), (8, 2880): (26.9, 26.5),
                (8, 16384): (51.6, 50.6), (16, 2880): (30.2, None), (16, 16384): (77.9, None)}
# Table 5, data x model rows with 2-way model parallelism: (D, W, N) -> kfps farm / 8-GPU server
PAPER_TABLE5_MP = {(1, 2, 2880): (11.7, 11.7), (1, 2, 16384): (12.7, 12.6),
                   (4, 2, 2880): (26.9, 25.0), (4, 2, 16384): (42.3, 40.9),
                   (8, 2, 2880): (34.8, None), (8, 2, 16384): (72.5, None)}
# §5: "7 hidden layers of dimension 2048, and an output dimension of 9304". The input dimension
# is not given; 440 (11 x 40, hpcsgd's 46M model) changes nothing here: the first layer's input
# is neither gathered nor its gradient reduced, and the paper's comm/Z is a constant.
PAPER_DIMS = (440,) + (2048,) * 7 + (9304,)
# The model-parallel link inside a dual-K20Xm server: PCIe 2.0 x16 (the K20X's bus) carries
# 8 GB/s per direction before packet overhead; ~6 GB/s (48 Gbit/s) is what a pinned copy or a
# peer-to-peer copy reaches on gen 2 (CUDA's bandwidthTest). Also the --mp-link-gbps default:
# this VM's shared-memory MPI Allgather moves 7-10 GB/s at K = 2 (docs/benchmarks.md), so
# 6 GB/s is a conservative figure for CPU ranks on one node too.
MP_LINK_GBPS = 48.0
MP_LATENCY_US = 10.0       # per ring step: a CUDA copy's launch, or a few shared-memory messages
# bytes per activation value on the model-parallel link (model.activation_codec); dettmers'
# small per-row scale is left out
ACTIVATION_BYTES = {"float32": 4, "float16": 2, "dettmers": 1}
SOFTMAX_STATS_PER_FRAME = 4   # per rank: its max, sum of exponentials, target logit, argmax

DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                    "docs", "bench")


def add_arguments(parser):
    parser.add_argument("--small", action="store_true",
                        help="smoke test: measure a tiny model's costs here (seconds)")
    parser.add_argument("--plot", metavar="PNG", help="plot predicted speed-up vs K")
    parser.add_argument("--link-gbps", default="1,10,25",
                        help="derive T_comm from these link rates, Gbit/s ('' = the measured "
                             "allreduce of --exchange-json)")
    parser.add_argument("--latency-us", type=float, default=50.0, help="per-message latency, us")
    parser.add_argument("--minibatch", default="1024,4096,16384", help="minibatch sizes N")
    parser.add_argument("--kmax", type=int, default=64, help="largest K on the curves")
    parser.add_argument("--measure", action="store_true",
                        help="time T_frm per sub-batch size, post, update and codecs in this run")
    parser.add_argument("--train-json", default=os.path.join(DOCS, "train_46m.json"))
    parser.add_argument("--validate", metavar="TRAIN.json",
                        help="only compare the model's step time with `bench train` runs at K "
                             "ranks (best: --emulate; costs from its K = 1 rows)")
    parser.add_argument("--ceiling-gbps", type=float, default=None,
                        help="--validate: also predict with the link capped at this rate (the "
                             "emulation's own ceiling, from `bench machine --emulate`)")
    parser.add_argument("--exchange-json", default=os.path.join(DOCS, "exchange.json"))
    parser.add_argument("--grid", default="",
                        help="also predict these data x model-parallel grids for the model of "
                             "the costs (e.g. 1x2,4x2,8x2; a DNN: dims from --train-json)")
    parser.add_argument("--activation-codec", default="float32", choices=sorted(ACTIVATION_BYTES),
                        help="--grid: bytes per activation value on the model-parallel link")
    parser.add_argument("--mp-link-gbps", type=float, default=MP_LINK_GBPS,
                        help="--grid: the model-parallel link inside a node, Gbit/s (default: "
                             "PCIe 2.0 x16's ~6 GB/s, the paper's K20X servers)")
    parser.add_argument("--mp-latency-us", type=float, default=MP_LATENCY_US,
                        help="--grid: latency per ring step of a model-parallel collective, us")


# ---- the model ------------------------------------------------------------------------------
def eq4_khat(n, t_frm, c_post, t_upd, t_comm_z, double_buffer=True):
    """Eq. 4 as printed: the K where computation (n/2 frames per exchange with double
    buffering, n without) equals communication. inf when T_comm/Z <= T_upd (§2.3)."""
    denom = t_comm_z - t_upd
    if denom <= 0:
        return math.inf
    return ((n / 2 if double_buffer else n) * t_frm + c_post) / denom


class VarCost:
    """v(n): compute time of one sub-batch of n frames, piecewise linear through measured
    (n, T_frm) points, extrapolated with the end segments' slopes (a constant T_frm if only
    one point is known). T_frm(n) = v(n)/n."""

    def __init__(self, points):
        self.n = np.array(sorted(points), float)
        self.v = np.array([points[k] * k for k in sorted(points)], float)

    def __call__(self, n):
        x, y = self.n, self.v
        if len(x) == 1:
            return y[0] / x[0] * n
        if n <= x[0]:
            return max(0.0, y[0] + (n - x[0]) * (y[1] - y[0]) / (x[1] - x[0]))
        if n >= x[-1]:
            return y[-1] + (n - x[-1]) * (y[-1] - y[-2]) / (x[-1] - x[-2])
        return float(np.interp(n, x, y))

    def t_frm(self, n):
        return self(n) / n


def minibatch_time(k, n, v, c_post, t_upd, comm_z, double_buffer, ways=1, activation=None):
    """Predicted seconds per minibatch of n frames at k nodes (module docstring). k = 1 is
    plain single-node SGD: no exchange, so no comm (and no reason to double-buffer).
    ways > 1: k data-parallel groups of `ways` model-parallel ranks (k x ways in Table 5):
    compute and fixed costs divided by `ways`, plus activation(frames) seconds of activation
    traffic per exchange (activation_comm). comm_z(k) is what the rank's own exchange with its
    k-1 peers costs: for ways > 1 the caller passes the comm of its 1/ways of the gradient
    (link_comm(M / ways, ...)), or of the whole model where the node's ranks share one port.
    The terms keep today's order, so ways = 1 (activation None or 0) is today's time exactly."""
    def act(frames):
        return activation(frames) if activation is not None else 0.0
    if k == 1:
        return v(n) / ways + c_post / ways + t_upd / ways + act(n)
    if double_buffer:
        sub = n / (2 * k)
        return 2 * max(v(sub) / ways + c_post / k / ways + t_upd / ways + act(sub), comm_z(k))
    sub = n / k
    return v(sub) / ways + c_post / k / ways + t_upd / ways + comm_z(k) + act(sub)


def khat_consistent(n, v, c_post, t_upd, comm_z, double_buffer=True, kmax=1e6):
    """Eq. 3 solved for K without Eq. 4's constants: the K where the per-exchange computation
    v(sub-batch) + C*T_post/K + T_upd (decreasing in K) meets T_comm(K)/Z (increasing), with
    T_frm at the real sub-batch n/2K (n/K without DB). A geometric scan finds the crossing,
    bisection refines it; inf if none below kmax (§2.3: comm stays below the fixed cost)."""
    def gap(k):
        sub = n / (2 * k) if double_buffer else n / k
        return v(sub) + c_post / k + t_upd - comm_z(k)
    lo, hi = 1.0, None
    k = 1.0
    while k <= kmax:
        if gap(k) <= 0:
            hi = k
            break
        lo, k = k, k * 1.25
    if hi is None:
        return math.inf
    if hi == 1.0:
        return 1.0
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if gap(mid) <= 0 else (mid, hi)
    return hi


def link_comm(m, bits, gbps, latency_s):
    """T_comm(K)/Z for M values of `bits` each over a `gbps` link (module docstring)."""
    def comm(k):
        return 2 * (k - 1) / k * m * bits / 8 / (gbps * 1e9 / 8) + 2 * (k - 1) * latency_s
    # Eq. 4 treats T_comm as a constant: the bandwidth term as K -> inf plus one round trip
    comm.asymptote = 2 * m * bits / 8 / (gbps * 1e9 / 8) + 2 * latency_s
    return comm


def column_split(n_out, ways):
    """Output columns per rank when `ways` ranks split a layer of n_out outputs: the first
    n_out % ways ranks take one more (MPI's block distribution)."""
    return [n_out // ways + (1 if r < n_out % ways else 0) for r in range(ways)]


def activation_values(dims, n, ways):
    """Values the busiest rank of a `ways`-way model-parallel group receives (and sends) per
    n frames of a DNN with layer widths dims = [input, hidden..., output]: every weight
    matrix (n_in, n_out) split by output columns (column_split).
    - forward: an Allgather of each hidden layer's output, n x n_out; a ring rank receives
      every block but one, so the busiest receives n (n_out - smallest block);
    - the softmax layer's logits stay split: each rank's SOFTMAX_STATS_PER_FRAME values per
      frame (its max, sum of exponentials, target logit and first argmax) go to every other
      rank in one Allgather (hpcsgd/model/parallel.py): (ways-1) of them per frame arrive;
    - backward: a Reduce_scatter of each layer's input gradient but the first's (n x n_in,
      n_in = the layer below's output): again every block but one.
    Each collective waits for its slowest rank, so the per-collective maxima add up.
    Also the number of ring steps, for the latency: ways-1 per Allgather and Reduce_scatter."""
    if ways == 1:
        return {"allgather": 0, "reduce_scatter": 0, "softmax_allreduce": 0.0, "ring_steps": 0}
    hidden = dims[1:-1]   # the hidden outputs = the inputs of layers 2..L
    gathered = sum(n * (width - min(column_split(width, ways))) for width in hidden)
    return {"allgather": gathered,
            "reduce_scatter": gathered,   # same widths: layer l's input is layer l-1's output
            "softmax_allreduce": (ways - 1) * SOFTMAX_STATS_PER_FRAME * n,
            "ring_steps": 2 * len(hidden) * (ways - 1) + (ways - 1)}


def activation_bytes(dims, n, ways, codec="float32"):
    """Bytes of activation_values: hidden activations and their gradients in the activation
    codec's bytes per value, the softmax statistics always float32 (a max or a sum of
    exponentials in 8 bits would break the softmax; they are 4 values per frame anyway)."""
    a = activation_values(dims, n, ways)
    return (a["allgather"] + a["reduce_scatter"]) * ACTIVATION_BYTES[codec] \
        + a["softmax_allreduce"] * 4


def activation_comm(dims, ways, codec, gbps, latency_s):
    """A(n): seconds of model-parallel activation traffic per exchange of n frames over a
    `gbps` link inside the node, plus latency per ring step. 0 for ways = 1."""
    steps = activation_values(dims, 1, ways)["ring_steps"]

    def comm(n):
        if ways == 1:
            return 0.0
        return activation_bytes(dims, n, ways, codec) / (gbps * 1e9 / 8) + steps * latency_s
    return comm


def const_comm(seconds):
    """A K-independent T_comm/Z, as the paper's §5.1 gives it."""
    def comm(k):
        return seconds
    comm.asymptote = seconds
    return comm


# ---- inputs ---------------------------------------------------------------------------------
def paper_costs():
    """The paper's §5.1 costs in this module's terms, 1-bit (Z = 32) and float (Z = 1)."""
    return {"source": "Seide et al. 2014, Table 1 and §5.1", "M": PAPER_M,
            "dims": list(PAPER_DIMS),
            "t_frm": {n: us * 1e-6 for n, us in PAPER_TABLE1.items()},
            "single_fixed_s": PAPER_POST_PLUS_UPD_S,
            "codecs": {"onebit": {"bits": 1.0, "t_upd": PAPER_UPD_S,
                                  "c_post": PAPER_POST_PLUS_UPD_S - PAPER_UPD_S}}}


def dnn_dims(shape):
    """[input, hidden..., output] of a `bench train` shape, None for a model that is not a
    DNN (an LSTM: the model-parallel traffic here is a DNN's) or a JSON without one."""
    if not shape or shape.get("type", "dnn") != "dnn":
        return None
    return [int(shape["input_dim"]), *map(int, shape["hidden"]), int(shape["num_labels"])]


def costs_from_json(train_json, exchange_json):
    """hpcsgd's costs from earlier `bench train` / `bench exchange` runs."""
    with open(train_json) as f:
        tr = json.load(f)
    with open(exchange_json) as f:
        ex = json.load(f)
    run = ex["runs"][0]
    k, m, res = run["ranks"], run["parameters"], run["results"]
    codecs = {}
    ar = res.get("allreduce_f32+post+apply")
    if ar:
        # (float32 on CPU fuses the post-processing into apply: no post_process phase)
        codecs["float32-allreduce"] = {"bits": 32.0,
                                       "t_upd": ar.get("post_process", 0.0) + ar["apply"],
                                       "c_post": 0.0}
    for name, r in res.items():
        if name.startswith("striped_"):
            codecs[name[len("striped_"):]] = {
                "bits": 8.0 * r["bytes_per_rank"] / m,
                "t_upd": r["encode"] + r.get("decode_sum", 0) + r["decode_apply"],
                "c_post": k * (r.get("post_process", 0) + r.get("reencode", 0)
                               + r.get("owner", 0))}
    if "runs" in tr:   # bench train at K ranks: one rank's step with the exchange skipped
        one = [r for r in tr["runs"][0]["rows"]
               if r["exchange"] == "none" and not r["double_buffering"]]
        t_frm = {r["minibatch"]: r["step_s"] / r["minibatch"] for r in one}
    else:              # the earlier single-process format
        t_frm = {tr["batch"]: tr["step_s"] / tr["batch"]}
    out = {"source": f"{train_json} (T_frm at N={','.join(map(str, t_frm))}), "
                     f"{exchange_json} (K={k})",
           "M": float(m), "t_frm": t_frm,
           "single_fixed_s": codecs.get("float32-allreduce", {}).get("t_upd", 0.0),
           "codecs": codecs, "dims": dnn_dims(tr.get("shape"))}
    if "allreduce_f32_inplace" in res:
        out["measured_comm_float_s"] = res["allreduce_f32_inplace"]["total"]
        out["measured_comm_k"] = k
        out["measured_link_gbps"] = run.get("link_gbps")
    return out


def _best(fn, repeats):
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_costs(small, repeats=3):
    """Table 1 measured here: forward+backward per sub-batch size; then the per-step passes
    over all M values: momentum post-processing, update, onebit encode/decode-accumulate."""
    from hpcsgd.bench.train import PAPER, SMALL
    from hpcsgd.codecs import make_codec
    from hpcsgd.model.dnn import dnn
    from hpcsgd.optim import Optimizer

    shape = SMALL if small else PAPER
    sizes = (64, 128, 256) if small else (256, 512, 1024)
    model = dnn(**shape, activation="sigmoid", max_batch=max(sizes))
    params, grads = model.new_params(), model.new_params()
    rng = np.random.default_rng(0)
    model.init(params, rng)
    x = rng.standard_normal((max(sizes), shape["input_dim"]), dtype=np.float32)
    y = rng.integers(0, shape["num_labels"], max(sizes)).astype(np.int32)
    t_frm = {n: _best(lambda n=n: model.forward_backward(params, grads, x[:n], y[:n], n),
                      repeats) / n for n in sizes}
    m = params.size
    opt = Optimizer(m, momentum_time_constant=-1024 / np.log(0.9))
    opt.begin_step(1024, 1024)
    post = _best(lambda: opt.post_exchange(grads.flat, params.flat), repeats)
    apply = _best(lambda: opt.apply(params.flat, grads.flat, 0.0), repeats)
    codec = make_codec("onebit")
    mats = list(grads.views.values())       # (n_cols, n_rows) views of the flat buffer
    bufs = [np.empty(codec.packed_nbytes(*a.shape), np.uint8) for a in mats]
    res = [np.zeros_like(a) for a in mats]
    outs = [np.zeros_like(a) for a in mats]

    def enc():
        for a, r, b in zip(mats, res, bufs):
            codec.encode(a, r, b)

    def dec():
        for b, o in zip(bufs, outs):
            codec.decode_accumulate(b, o)
    t_enc, t_dec = _best(enc, repeats), _best(dec, repeats)
    bits = 8.0 * sum(b.size for b in bufs) / m
    return {"source": f"measured in this run ({'small' if small else '46M'} model, best of "
                      f"{repeats}; load average {os.getloadavg()[0]:.2f})",
            "M": float(m), "t_frm": t_frm, "single_fixed_s": post + apply,
            "dims": dnn_dims(shape),
            "codecs": {"float32-allreduce": {"bits": 32.0, "t_upd": post + apply, "c_post": 0.0},
                       # striped: encode, decode-sum (K stripes of M/K), decode+apply on every
                       # rank; owner post + re-encode of 1/K (module docstring)
                       "onebit": {"bits": bits, "t_upd": t_enc + 2 * t_dec + apply,
                                  "c_post": post + t_enc}},
            "measured": {"post_s": post, "apply_s": apply, "onebit_encode_s": t_enc,
                         "onebit_decode_acc_s": t_dec}}


# ---- predictions ----------------------------------------------------------------------------
def predict(costs, links, minibatches, kmax):
    """Rows of K-hat and speed-up curves, one per (link, codec, N). `links`: list of
    (label, make_comm(bits) -> comm(K)) pairs."""
    v = VarCost(costs["t_frm"])
    rows = []
    for label, make_comm in links:
        for codec, c in costs["codecs"].items():
            comm = make_comm(c["bits"])
            for n in minibatches:
                t1 = v(n) + costs["single_fixed_s"]
                row = {"link": label, "codec": codec, "N": n, "bits": c["bits"],
                       "Z": 32.0 / c["bits"], "t_upd_ms": 1e3 * c["t_upd"],
                       "c_post_ms": 1e3 * c["c_post"], "t_comm_z_ms_at_2": 1e3 * comm(2),
                       "t_comm_z_ms_inf": 1e3 * comm.asymptote,
                       "t_frm_us_at_n_over_2": 1e6 * v.t_frm(n / 2)}
                for db in (True, False):
                    key = "db" if db else "nodb"
                    row[f"khat_eq4_{key}"] = eq4_khat(n, v.t_frm(n / 2 if db else n), c["c_post"],
                                                      c["t_upd"], comm.asymptote, db)
                    row[f"khat_{key}"] = khat_consistent(n, v, c["c_post"], c["t_upd"], comm, db)
                    ks = list(range(1, kmax + 1))
                    # K = 1 is the single-node baseline itself (no exchange, no codec)
                    sp = [1.0 if k == 1 else
                          t1 / minibatch_time(k, n, v, c["c_post"], c["t_upd"], comm, db)
                          for k in ks]
                    row[f"speedup_{key}"] = sp
                    i = int(np.argmax(sp))
                    row[f"best_k_{key}"], row[f"best_speedup_{key}"] = ks[i], sp[i]
                row["single_node_fps"] = n / t1
                rows.append(row)
    return rows


def paper_validation():
    """The model fed with the paper's costs against the paper's Table 5 (data x 1 rows)."""
    costs = paper_costs()
    v = VarCost(costs["t_frm"])
    c = costs["codecs"]["onebit"]
    out = []
    for (k, n), (farm, gpu8) in sorted(PAPER_TABLE5.items()):
        r = {"K": k, "N": n, "paper_farm_kfps": farm, "paper_8gpu_kfps": gpu8}
        for label, cz in zip(("lo", "mid", "hi"), PAPER_COMM_Z_S):
            for db in (True, False):
                t = minibatch_time(k, n, v, c["c_post"], c["t_upd"], const_comm(cz), db)
                r[f"pred_kfps_{'db' if db else 'nodb'}_{label}"] = n / t / 1e3
        r["ratio_mid_db"] = r["pred_kfps_db_mid"] / farm
        r["ratio_mid_nodb"] = r["pred_kfps_nodb_mid"] / farm
        # what the paper's speed implies beyond the model, per minibatch
        r["unexplained_ms_nodb_mid"] = 1e3 * (n / (farm * 1e3) - n / (r["pred_kfps_nodb_mid"]
                                                                       * 1e3))
        out.append(r)
    khat = {f"N={n} comm/Z={1e3 * cz:g}ms": eq4_khat(n, v.t_frm(n / 2), c["c_post"], c["t_upd"],
                                                       cz, True)
            for n in (2880, 16384) for cz in PAPER_COMM_Z_S}
    return {"table5": out, "khat_eq4": khat,
            "note": "Table 5 x1 rows only (no model parallelism); T_upd = 9 ms and "
                    "C*T_post = 18.2 - 9 ms (§5.1); comm/Z 3 | 6.5 | 10 ms (§5.1 range)"}


def paper_validation_mp(gbps=MP_LINK_GBPS, latency_s=MP_LATENCY_US * 1e-6):
    """The model fed with the paper's costs against Table 5's D x 2 rows. All but the
    activation traffic is paper_validation's; activations are float32 (the paper's 2014 code)
    over the dual-K20Xm server's PCIe (MP_LINK_GBPS), the gradient share 1/W of §5.1's comm/Z.
    Beside each row: "shared port", the node's W ranks sharing its Infiniband port (the whole
    comm/Z per node, as if not divided), and the x 1 row with as many GPUs (D W x 1) with the
    model's error there, so what model parallelism adds to the error shows. For the D = 1 rows
    also the link rate at which the model would match the paper (implied_mp_gbps), and the
    same with the 1 x 1 row's unexplained time (data reading...) left unsplit by W."""
    costs = paper_costs()
    v = VarCost(costs["t_frm"])
    c = costs["codecs"]["onebit"]
    x1 = {(r["K"], r["N"]): r for r in paper_validation()["table5"]}
    out = []
    for (d, w, n), (farm, gpu8) in sorted(PAPER_TABLE5_MP.items()):
        act = activation_comm(PAPER_DIMS, w, "float32", gbps, latency_s)
        r = {"D": d, "W": w, "N": n, "paper_farm_kfps": farm, "paper_8gpu_kfps": gpu8,
             "activation_MB_per_minibatch": activation_bytes(PAPER_DIMS, n / d, w) / 1e6,
             "activation_ms_nodb": 1e3 * act(n / d)}
        for label, cz in zip(("lo", "mid", "hi"), PAPER_COMM_Z_S):
            for db in (True, False):
                t = minibatch_time(d, n, v, c["c_post"], c["t_upd"], const_comm(cz / w), db,
                                   w, act)
                r[f"pred_kfps_{'db' if db else 'nodb'}_{label}"] = n / t / 1e3
        for db in (True, False):
            t = minibatch_time(d, n, v, c["c_post"], c["t_upd"], const_comm(PAPER_COMM_Z_S[1]),
                               db, w, act)
            r[f"pred_kfps_{'db' if db else 'nodb'}_mid_shared_port"] = n / t / 1e3
        r["ratio_mid_db"] = r["pred_kfps_db_mid"] / farm
        r["ratio_mid_nodb"] = r["pred_kfps_nodb_mid"] / farm
        r["unexplained_ms_nodb_mid"] = 1e3 * (n / (farm * 1e3) - n / (r["pred_kfps_nodb_mid"]
                                                                       * 1e3))
        same = x1.get((d * w, n))
        r["same_gpus_x1"] = f"{d * w}x1"
        r["same_gpus_x1_ratio_mid_nodb"] = same["ratio_mid_nodb"] if same else None
        if d == 1:
            rest = v(n) / w + c["c_post"] / w + c["t_upd"] / w
            steps_s = activation_values(PAPER_DIMS, 1, w)["ring_steps"] * latency_s
            wire = activation_bytes(PAPER_DIMS, n, w)
            published = n / (farm * 1e3)
            gap_1x1 = x1[(1, n)]["unexplained_ms_nodb_mid"] / 1e3
            for key, spare in (("implied_mp_gbps", published - rest - steps_s),
                               ("implied_mp_gbps_1x1_gap_unsplit",
                                published - rest - steps_s - gap_1x1)):
                r[key] = 8 * wire / spare / 1e9 if spare > 0 else None
            r["pred_gain_over_1x1"] = r["pred_kfps_nodb_mid"] / x1[(1, n)]["pred_kfps_nodb_mid"]
            r["paper_gain_over_1x1"] = farm / x1[(1, n)]["paper_farm_kfps"]
        out.append(r)
    return {"table5_mp": out, "mp_link_gbps": gbps, "mp_latency_us": latency_s * 1e6,
            "dims": list(PAPER_DIMS), "activation_codec": "float32",
            "note": "Table 5 D x 2 rows: the paper's costs (Table 1, §5.1), fixed costs and "
                    "compute / W, the gradient exchange 1/W of comm/Z (shared port: not "
                    "divided), float32 activations over PCIe 2.0 x16 at ~6 GB/s"}


def predict_grid(costs, links, minibatches, grid, activation_codec="float32",
                 mp_gbps=MP_LINK_GBPS, mp_latency_s=MP_LATENCY_US * 1e-6):
    """Frames/s and speed-up over one rank for data x model grids [(D, W), ...] of the costs'
    DNN, one row per (link, codec, N) as predict() makes them. `links`: (label,
    make_comm(bits, ways) -> comm(K)) with ways = the share of the gradient a rank exchanges.
    D = 1 has no exchange: its fixed cost is one rank's post-processing + update (the
    single_fixed_s predict() divides by), whatever the codec, divided by W. (D, 1) is
    predict()'s K = D exactly."""
    dims = costs.get("dims")
    if not dims:
        raise ValueError("--grid: the costs name no DNN shape (model parallelism is modelled "
                         "for a DNN; the train JSON needs its 'shape')")
    v = VarCost(costs["t_frm"])
    rows = []
    for label, make_comm in links:
        for codec, c in costs["codecs"].items():
            for n in minibatches:
                t1 = v(n) + costs["single_fixed_s"]
                row = {"link": label, "codec": codec, "N": n, "single_node_fps": n / t1,
                       "activation_codec": activation_codec, "mp_link_gbps": mp_gbps,
                       "grid": []}
                for d, w in grid:
                    act = activation_comm(dims, w, activation_codec, mp_gbps, mp_latency_s)
                    comm = make_comm(c["bits"], w)
                    c_post, t_upd = ((costs["single_fixed_s"], 0.0) if d == 1
                                     else (c["c_post"], c["t_upd"]))
                    g = {"D": d, "W": w, "ranks": d * w,
                         "activation_MB_per_rank": activation_bytes(dims, n / d, w,
                                                                    activation_codec) / 1e6,
                         "activation_ms_nodb": 1e3 * act(n / d)}
                    for db in (True, False):
                        t = minibatch_time(d, n, v, c_post, t_upd, comm, db, w, act)
                        key = "db" if db else "nodb"
                        g[f"fps_{key}"], g[f"speedup_{key}"] = n / t, t1 / t
                    row["grid"].append(g)
                rows.append(row)
    return rows


def parse_grid(text):
    """'1x2,4x2,8x2' -> [(1, 2), (4, 2), (8, 2)] (data x model, as Table 5 writes them)."""
    grid = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        d, _, w = item.lower().partition("x")
        if not (d.isdigit() and w.isdigit()) or int(d) < 1 or int(w) < 1:
            raise ValueError(f"--grid {item!r}: expected DATAxMODEL, e.g. 4x2")
        grid.append((int(d), int(w)))
    return grid


def _fmt_k(k):
    return "inf" if not math.isfinite(k) else f"{k:.1f}"


def print_rows(rows, kshow=(2, 4, 8, 16, 32)):
    print(f"{'link':>14s} {'codec':>18s} {'N':>6s} {'Z':>5s} {'T_upd':>6s} {'CTpost':>6s} "
          f"{'comm/Z':>7s} {'Khat4':>6s} {'Khat':>6s} {'Khat-noDB':>9s} {'bestK':>5s} "
          + " ".join(f"{'S@' + str(k):>6s}" for k in kshow) + "  (S = speed-up with DB / noDB)")
    for r in rows:
        sp = " ".join(f"{r['speedup_db'][k - 1]:>3.1f}/{r['speedup_nodb'][k - 1]:<3.1f}"
                      if k <= len(r["speedup_db"]) else "" for k in kshow)
        print(f"{r['link']:>14s} {r['codec']:>18s} {r['N']:>6d} {r['Z']:>5.1f} "
              f"{r['t_upd_ms']:>6.1f} {r['c_post_ms']:>6.1f} {r['t_comm_z_ms_inf']:>7.1f} "
              f"{_fmt_k(r['khat_eq4_db']):>6s} {_fmt_k(r['khat_db']):>6s} "
              f"{_fmt_k(r['khat_nodb']):>9s} {r['best_k_db']:>5d} {sp}")


def print_validation(val):
    print("\nValidation: the model with the paper's costs (Table 1, §5.1) vs the paper's Table 5 "
          "(kfps; data x 1 rows)")
    print(f"{'K':>3s} {'N':>6s} {'paper farm':>10s} {'8-GPU':>6s} {'pred DB':>18s} "
          f"{'pred noDB':>18s} {'noDB/paper':>10s} {'unexplained ms':>14s}")
    for r in val["table5"]:
        print(f"{r['K']:>3d} {r['N']:>6d} {r['paper_farm_kfps']:>10.1f} "
              f"{(r['paper_8gpu_kfps'] or float('nan')):>6.1f} "
              f"{r['pred_kfps_db_lo']:>5.1f}|{r['pred_kfps_db_mid']:>5.1f}|"
              f"{r['pred_kfps_db_hi']:>5.1f} "
              f"{r['pred_kfps_nodb_lo']:>5.1f}|{r['pred_kfps_nodb_mid']:>5.1f}|"
              f"{r['pred_kfps_nodb_hi']:>5.1f} {r['ratio_mid_nodb']:>10.2f} "
              f"{r['unexplained_ms_nodb_mid']:>14.1f}")
    print("  (pred a|b|c: comm/Z = 3 | 6.5 | 10 ms.) Eq. 4 K-hat with the paper's costs: " +
          ", ".join(f"{k}: {_fmt_k(x)}" for k, x in val["khat_eq4"].items()))
    print("  comm/Z (3-10 ms) <= T_upd (9 ms) for most of the range: §2.3's case, where Eq. 4's "
          "denominator is <= 0 and the fixed cost, not the link, limits the speed.")


def print_validation_mp(val):
    print(f"\nModel parallelism: the paper's costs vs Table 5's data x model rows (kfps; "
          f"float32 activations over {val['mp_link_gbps']:g} Gbit/s, "
          f"{val['mp_latency_us']:g} us per ring step; gradient exchange 1/W of comm/Z)")
    print(f"{'DxW':>4s} {'N':>6s} {'paper farm':>10s} {'8-GPU':>6s} {'act MB':>7s} "
          f"{'act ms':>6s} {'pred DB':>17s} {'pred noDB':>17s} {'noDB/paper':>10s} "
          f"{'shared port':>11s} {'x1 same GPUs':>12s} {'unexplained ms':>14s}")
    for r in val["table5_mp"]:
        same = r["same_gpus_x1_ratio_mid_nodb"]
        print(f"{r['D']:>2d}x{r['W']:<1d} {r['N']:>6d} {r['paper_farm_kfps']:>10.1f} "
              f"{(r['paper_8gpu_kfps'] or float('nan')):>6.1f} "
              f"{r['activation_MB_per_minibatch']:>7.0f} {r['activation_ms_nodb']:>6.1f} "
              f"{r['pred_kfps_db_lo']:>5.1f}|{r['pred_kfps_db_mid']:>5.1f}|"
              f"{r['pred_kfps_db_hi']:>5.1f} "
              f"{r['pred_kfps_nodb_lo']:>5.1f}|{r['pred_kfps_nodb_mid']:>5.1f}|"
              f"{r['pred_kfps_nodb_hi']:>5.1f} {r['ratio_mid_nodb']:>10.2f} "
              f"{r['pred_kfps_nodb_mid_shared_port']:>11.1f} "
              f"{(r['same_gpus_x1'] + ' ' + format(same, '.2f')) if same else '':>12s} "
              f"{r['unexplained_ms_nodb_mid']:>14.1f}")
    print("  (act MB/ms: one rank's activation traffic per minibatch and its time without DB; "
          "shared port: noDB mid with the node's W ranks sharing one port; x1 same GPUs: "
          "noDB/paper of the x 1 row with as many GPUs)")
    for r in val["table5_mp"]:
        if r["D"] == 1:
            gbps = [r[k] for k in ("implied_mp_gbps", "implied_mp_gbps_1x1_gap_unsplit")]
            print(f"  1x{r['W']} N={r['N']}: gain over 1x1 predicted "
                  f"{r['pred_gain_over_1x1']:.2f}, paper {r['paper_gain_over_1x1']:.2f}; the paper's speed implies a "
                  f"model-parallel link of " + " / ".join("-" if g is None else f"{g:.0f}"
                                                         for g in gbps)
                  + " Gbit/s (1x1's unexplained time counted as traffic / kept, unsplit)")


def print_grid(rows, grid):
    print(f"\nData x model grid for this model ({rows[0]['activation_codec']} activations over "
          f"{rows[0]['mp_link_gbps']:g} Gbit/s inside a node; frames/s with DB / without, "
          f"speed-up over one rank without DB in brackets; A = activation MB per rank per "
          f"minibatch)")
    print(f"{'link':>14s} {'codec':>18s} {'N':>6s} {'1 rank':>7s} "
          + " ".join(f"{f'{d}x{w}':^28s}" for d, w in grid))
    for r in rows:
        cells = " ".join(f"{g['fps_db']:>7.0f}/{g['fps_nodb']:<7.0f}({g['speedup_nodb']:>4.1f}) "
                         f"A{g['activation_MB_per_rank']:<5.3g}" for g in r["grid"])
        print(f"{r['link']:>14s} {r['codec']:>18s} {r['N']:>6d} {r['single_node_fps']:>7.0f} "
              f"{cells}")


def plot(rows, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = list(dict.fromkeys(r["link"] for r in rows))
    ns = list(dict.fromkeys(r["N"] for r in rows))
    fig, axes = plt.subplots(len(ns), len(links), figsize=(4.5 * len(links), 3.4 * len(ns)),
                             squeeze=False, sharey="row")
    for r in rows:
        ax = axes[ns.index(r["N"])][links.index(r["link"])]
        ks = np.arange(1, len(r["speedup_db"]) + 1)
        line, = ax.plot(ks, r["speedup_db"], label=f"{r['codec']} DB")
        ax.plot(ks, r["speedup_nodb"], "--", color=line.get_color(), label=f"{r['codec']} no DB")
        ax.set_title(f"{r['link']}, N = {r['N']}", fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("K nodes")
        ax.set_ylabel("predicted speed-up")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def run(args):
    if args.validate:
        with open(args.validate) as f:
            rows = validate(json.load(f), args.latency_us * 1e-6, args.ceiling_gbps)
        print_validate(rows, args.validate)
        return {"validation": rows, "latency_us": args.latency_us,
                "ceiling_gbps": args.ceiling_gbps, "train_json": args.validate}
    minibatches = [int(n) for n in args.minibatch.split(",") if n]
    kmax = args.kmax
    if args.small:
        # 1 Numba thread: on 2 shared cores a 2-thread kernel waiting for a descheduled thread
        # measured 200x its normal time (onebit encode 71 ms instead of 0.3 ms)
        import numba
        numba.set_num_threads(1)
        minibatches, kmax = minibatches[:2], min(kmax, 16)
        costs = measure_costs(small=True, repeats=2)
    elif args.measure:
        costs = measure_costs(small=False)
        try:
            ex = costs_from_json(args.train_json, args.exchange_json)
            costs["codecs"].update({k: c for k, c in ex["codecs"].items()
                                    if k not in costs["codecs"]})
        except OSError:
            pass
    else:
        costs = costs_from_json(args.train_json, args.exchange_json)
    lat = args.latency_us * 1e-6
    try:
        grid = parse_grid(args.grid)
        if grid and not costs.get("dims"):
            raise ValueError(f"--grid: {costs['source']} names no DNN shape (model "
                             f"parallelism is modelled for a DNN: the train JSON's 'shape')")
    except ValueError as err:
        print(f"hpcsgd bench plan: {err}", file=sys.stderr)
        return 2
    # make_comm(bits, ways): the exchange of a rank's 1/ways of the M values
    links = [(f"{g:g} Gbit/s", (lambda bits, ways=1, g=g: link_comm(costs["M"] / ways, bits, g,
                                                                     lat)))
             for g in (float(x) for x in args.link_gbps.split(",") if x)]
    if not links and "measured_comm_float_s" in costs:
        cf = costs["measured_comm_float_s"]
        links = [(f"measured K={costs['measured_comm_k']}",
                  lambda bits, ways=1, cf=cf: const_comm(cf * bits / 32.0 / ways))]
    print(f"hpcsgd bench plan: Eq. 4 with costs from {costs['source']}; "
          f"M = {costs['M'] / 1e6:.1f}M; latency {args.latency_us:g} us/message; "
          f"T_frm per sub-batch: " + ", ".join(f"{n}: {1e6 * t:.0f} us"
                                               for n, t in sorted(costs["t_frm"].items())))
    rows = predict(costs, links, minibatches, kmax)
    print("ms: T_upd = fixed per exchange, CTpost = post-processing split over K, comm/Z = "
          "exchange time as K -> inf; Khat4 = Eq. 4 as printed (T_frm at N/2, comm at K -> inf); "
          "Khat = Eq. 4 solved self-consistently; bestK = argmax of the DB curve")
    print_rows(rows)
    val = paper_validation()
    print_validation(val)
    paper_rows = predict(paper_costs(), [("paper IB", lambda bits: const_comm(PAPER_COMM_Z_S[1]
                                                                              * bits))],
                         [2880, 16384], 32)
    print("\nThe paper's costs through the same predict() (comm/Z = 6.5 ms):")
    print_rows(paper_rows)
    val_mp = paper_validation_mp()
    print_validation_mp(val_mp)
    out = {"costs": costs, "latency_us": args.latency_us, "rows": rows,
           "paper_validation": val, "paper_rows": paper_rows, "paper_validation_mp": val_mp}
    if grid:
        grid_rows = predict_grid(costs, links, minibatches, grid, args.activation_codec,
                                 args.mp_link_gbps, args.mp_latency_us * 1e-6)
        print_grid(grid_rows, grid)
        out["grid_rows"] = grid_rows
    if args.plot:
        plot(rows, args.plot, f"Eq. 4 model, costs: {costs['source'][:90]}")
        print(f"plot: wrote {args.plot}")
    return out


def figures(res):
    if "validation" in res:
        return {f"{r['link']} K={r['K']} N={r['N']} {r['exchange']} DB {r['db']} measured/pred":
                r["measured_over_pred"] for r in res["validation"]}
    figs = {f"{r['link']} {r['codec']} N={r['N']} {key}": r[key] for r in res["rows"]
            for key in ("best_speedup_db", "best_speedup_nodb", "khat_db")}
    figs.update({f"paper Table 5 {r['D']}x{r['W']} N={r['N']} pred/paper noDB":
                 r["ratio_mid_nodb"] for r in res.get("paper_validation_mp", {})
                 .get("table5_mp", [])})
    return figs


# ---- predicted vs measured training steps (`bench train` JSON, ideally --emulate) -----------
def fixed_costs(phases, striped):
    """(T_upd, C*T_post) per step from one rank's exchange phases at K = 1: the passes over all
    M values every rank makes, and the owners' post-processing that striping splits over K
    (module docstring). The K = 1 collectives are self-copies and are left out."""
    p = phases
    if striped:
        return (p.get("encode", 0) + p.get("decode_sum", 0) + p.get("decode_apply", 0)
                + p.get("decode", 0)), (p.get("post_process", 0) + p.get("reencode", 0)
                                        + p.get("owner", 0))
    return (p.get("encode", 0) + p.get("decode", 0) + p.get("post_process", 0)
            + p.get("apply", 0)), 0.0


def validate(train, latency_s, ceiling_gbps=None):
    """Eq. 4's time per minibatch against `bench train`'s measured steps, per link, K, N,
    exchange and double buffering. Costs come from the run's own K = 1 rows. K ranks share
    this machine's C cores: a rank runs on min(threads, C/K) cores, so its compute and its
    passes over memory take s_K = share_1 / share_K times the K = 1 time (s_K = K when the
    one rank had all C cores; max(1, K/C) with 1 thread per rank): v_K(n) = s_K v_1(n),
    T_upd_K = s_K T_upd_1, C T_post_K = s_K C T_post_1 (then split over K owners).
    Per exchange (nex = 2 with double buffering): v = v_K(N / (nex K)), u = T_upd_K +
    C T_post_K / K, c = T_comm(K)/Z from the link rate (link_comm), or the measured
    communication where there is no emulated link. Predicted step: serial nex (v + u + c);
    overlapped (the paper's DB) nex max(v + u, c)."""
    links = train["links"] if "links" in train else [train]
    cores = train.get("cpus") or os.cpu_count() or 1
    out = []
    for link in links:
        gbps = link.get("link_gbps")
        runs = {r["ranks"]: r for r in link["runs"]}
        if 1 not in runs:
            raise ValueError("validate: the train JSON needs a K = 1 run (--ranks 1,...)")
        base = {(r["minibatch"], r["exchange"], (r["double_buffering"], r.get("progress"))): r
                for r in runs[1]["rows"]}
        m = float(runs[1]["params"])

        def share(run):   # cores one rank of `run` computes on
            return min(run.get("threads_per_rank", 1), cores / run["ranks"])
        for k, run in sorted(runs.items()):
            if k == 1:
                continue
            slow = share(runs[1]) / share(run)
            for row in run["rows"]:
                if row["exchange"] == "none":
                    continue
                n, ex, db = row["minibatch"], row["exchange"], row["double_buffering"]
                mode = (db, row.get("progress"))
                b = base[(n, ex, mode)]
                nex = row["exchanges_per_step"]
                points = {r["minibatch"] / nex: r["seconds"]["compute"] / r["minibatch"]
                          for key, r in base.items() if key[1] == "none" and key[2] == mode}
                v1 = VarCost(points)
                t_upd1, c_post1 = fixed_costs(b["phases_s"], not ex.startswith("allreduce"))
                v = slow * v1(n / (nex * k))
                u = slow * (t_upd1 + c_post1 / k) / nex
                meas_c = row["seconds"]["communicate"] / nex
                if gbps:
                    c = link_comm(m, row["bits_per_value"], gbps, latency_s)(k)
                    c_cap = (link_comm(m, row["bits_per_value"], min(gbps, ceiling_gbps),
                                       latency_s)(k) if ceiling_gbps else None)
                else:
                    c, c_cap = meas_c, None
                serial = nex * (v + u + c)
                overlap = nex * max(v + u, c)
                pred = overlap if db else serial
                r = {"link": f"{gbps:g} Gbit/s" if gbps else "shared memory (comm measured)",
                     "K": k, "N": n, "exchange": ex,
                     "db": (f"on+{mode[1]}" if mode[1] not in (None, "none") else "on")
                           if db else "off",
                     "core_share_slowdown": slow,
                     "compute_pred_s": nex * v, "compute_meas_s": row["seconds"]["compute"],
                     "fixed_pred_s": nex * u,
                     "fixed_meas_s": row["seconds"]["encode"] + row["seconds"]["update"],
                     "comm_pred_s": c, "comm_meas_s": meas_c,
                     "step_pred_serial_s": serial, "step_pred_overlap_s": overlap,
                     "step_pred_s": pred, "step_meas_s": row["step_s"],
                     "fps_pred": n / pred, "fps_meas": row["frames_per_s"],
                     "measured_over_pred": row["step_s"] / pred}
                if c_cap is not None:
                    r["comm_pred_capped_s"] = c_cap
                    r["step_pred_capped_s"] = (nex * max(v + u, c_cap) if db
                                               else nex * (v + u + c_cap))
                out.append(r)
    return out


def print_validate(rows, path):
    print(f"Eq. 4's step time vs `bench train` ({path}); costs from its K = 1 rows, K ranks "
          f"sharing the cores (validate()); ms per step unless noted; DB on: predicted = "
          f"overlapped 2 max(v+u, c), [serial] = 2 (v+u+c)")
    capped = any("step_pred_capped_s" in r for r in rows)
    print(f"{'link':>14s} {'K':>2s} {'N':>5s} {'exchange':>10s} {'DB':>9s} "
          f"{'compute p/m':>13s} {'fixed p/m':>13s} {'comm/exch p/m':>15s} "
          f"{'step pred':>9s} {'[serial]':>9s} {'measured':>9s} {'meas/pred':>9s} "
          f"{'/serial':>7s}" + (f" {'capped':>8s} {'/capped':>7s}" if capped else ""))
    for r in rows:
        print(f"{r['link'][:14]:>14s} {r['K']:>2d} {r['N']:>5d} {r['exchange']:>10s} {r['db']:>9s} "
              f"{1e3 * r['compute_pred_s']:>6.0f}/{1e3 * r['compute_meas_s']:<6.0f} "
              f"{1e3 * r['fixed_pred_s']:>6.0f}/{1e3 * r['fixed_meas_s']:<6.0f} "
              f"{1e3 * r['comm_pred_s']:>7.1f}/{1e3 * r['comm_meas_s']:<7.1f} "
              f"{1e3 * r['step_pred_s']:>9.0f} "
              f"{(format(1e3 * r['step_pred_serial_s'], '.0f') if r['db'] != 'off' else ''):>9s} "
              f"{1e3 * r['step_meas_s']:>9.0f} {r['measured_over_pred']:>9.2f} "
              f"{r['step_meas_s'] / r['step_pred_serial_s']:>7.2f}"
              + (f" {1e3 * r.get('step_pred_capped_s', float('nan')):>8.0f} "
                 f"{r['step_meas_s'] / r.get('step_pred_capped_s', float('nan')):>7.2f}"
                 if capped else ""))
