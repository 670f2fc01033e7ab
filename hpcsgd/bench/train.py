"""Training frames/s of the DNN against the GEMM-only roofline, measured in the same run.

`hpcsgd bench train [--small] [--batch 1024] [--steps 5] [--json FILE]`

One step = forward + backward (hpcsgd.model.dnn) + SGD-momentum update (hpcsgd.optim), on random
frames, the paper's 46M model by default (11x40 = 440 inputs, 7x2048 sigmoid, 9304 outputs).
The roofline is the same step's matmuls alone (forward, dW, dX, same shapes and buffers): a
BLAS-based trainer cannot beat it, so step time / GEMM time shows what the element-wise kernels,
the update and Python cost. Steps and GEMM-only passes alternate, medians are reported.
The process CPU time of both is reported too: on a machine shared with other jobs, and with
1 thread (OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1), it measures the work without the time
spent descheduled; with more threads it also counts spin-waiting.
"""
import json
import os
import platform
import statistics
import time

import numpy as np

PAPER = dict(input_dim=440, hidden=[2048] * 7, num_labels=9304)
SMALL = dict(input_dim=440, hidden=[256] * 3, num_labels=500)


def add_arguments(parser):
    parser.add_argument("--small", action="store_true",
                        help="a 0.4M-parameter model (CI smoke test, seconds)")
    parser.add_argument("--batch", type=int, default=1024, help="minibatch size in frames")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (after one warm-up)")
    parser.add_argument("--activation", default="sigmoid", choices=["sigmoid", "relu"])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")


def gemm_only(model, params, grads, x, n):
    """The matmuls of one training step, in the step's order, into the step's buffers."""
    a = x[:n]
    for l in range(model.n_layers):
        np.matmul(a, params.views[f"W{l}"], out=model.acts[l][:n])
        a = model.acts[l][:n]
    for l in range(model.n_layers - 1, -1, -1):
        dz = model.acts[l][:n]
        a = model.acts[l - 1][:n] if l > 0 else x[:n]
        np.matmul(a.T, dz, out=grads.views[f"W{l}"])
        if l > 0:
            m = model.dims[l]
            np.matmul(dz, params.views[f"W{l}"].T, out=model.delta[:n * m].reshape(n, m))


def run(args):
    import numba

    from hpcsgd.model.dnn import DNN, gemm_flop_per_frame
    from hpcsgd.optim import Optimizer

    shape = SMALL if args.small else PAPER
    n = args.batch
    model = DNN(**shape, activation=args.activation, max_batch=n)
    params, grads = model.new_params(), model.new_params()
    rng = np.random.default_rng(0)
    model.init(params, rng)
    # momentum 0.9 per 1024-frame minibatch, as CNTK's usual setting
    opt = Optimizer(params.size, momentum_time_constant=-1024 / np.log(0.9))
    x = rng.standard_normal((n, shape["input_dim"]), dtype=np.float32)
    y = rng.integers(0, shape["num_labels"], n).astype(np.int32)
    lr = 1e-5   # small, so that random labels do not blow the weights up while timing

    def train_step():
        model.forward_backward(params, grads, x, y, n)
        opt.step(params.flat, grads.flat, lr, n)

    t0 = time.perf_counter()
    train_step()                                  # compiles the kernels (cached on disk)
    gemm_only(model, params, grads, x, n)
    warmup_s = time.perf_counter() - t0
    step_s, gemm_s, step_cpu, gemm_cpu = [], [], [], []
    for _ in range(args.steps):
        t, c = time.perf_counter(), time.process_time()
        train_step()
        step_s.append(time.perf_counter() - t)
        step_cpu.append(time.process_time() - c)
        t, c = time.perf_counter(), time.process_time()
        gemm_only(model, params, grads, x, n)
        gemm_s.append(time.perf_counter() - t)
        gemm_cpu.append(time.process_time() - c)
    step, gemm = statistics.median(step_s), statistics.median(gemm_s)
    step_c, gemm_c = statistics.median(step_cpu), statistics.median(gemm_cpu)
    flop = gemm_flop_per_frame(**shape) * n
    res = {
        "model": "small" if args.small else "paper-46M", "params": params.size, "batch": n,
        "activation": args.activation, "steps": args.steps,
        "step_s": step, "gemm_only_s": gemm, "frames_per_s": n / step,
        "gemm_only_frames_per_s": n / gemm, "roofline_fraction": gemm / step,
        "gflops": flop / step / 1e9, "gemm_only_gflops": flop / gemm / 1e9,
        "gflop_per_step": flop / 1e9, "warmup_s": warmup_s,
        "numba_threads": numba.get_num_threads(), "numba_threading_layer": numba.threading_layer(),
        "OPENBLAS_NUM_THREADS": os.environ.get("OPENBLAS_NUM_THREADS", "(default: all cores)"),
        "cpus": os.cpu_count(), "machine": platform.machine(),
        "step_cpu_s": step_c, "gemm_only_cpu_s": gemm_c, "roofline_fraction_cpu": gemm_c / step_c,
        "load_avg_1min": os.getloadavg()[0],
        "step_s_all": step_s, "gemm_only_s_all": gemm_s,
    }
    print(f"bench train: {res['model']} ({params.size / 1e6:.1f}M params), minibatch {n}, "
          f"{args.activation}, median of {args.steps} steps")
    print(f"  train step (fwd+bwd+momentum): {step * 1e3:8.1f} ms  {n / step:8.0f} frames/s  "
          f"{flop / step / 1e9:6.1f} GFLOP/s")
    print(f"  GEMM only (same matmuls):      {gemm * 1e3:8.1f} ms  {n / gemm:8.0f} frames/s  "
          f"{flop / gemm / 1e9:6.1f} GFLOP/s")
    print(f"  fraction of the GEMM roofline: {gemm / step * 100:.1f}%  "
          f"(numba {res['numba_threads']} threads/{res['numba_threading_layer']}, "
          f"OpenBLAS {res['OPENBLAS_NUM_THREADS']})")
    print(f"  process CPU time: step {step_c * 1e3:.1f} ms, GEMM only {gemm_c * 1e3:.1f} ms, "
          f"ratio {gemm_c / step_c * 100:.1f}%; load average {res['load_avg_1min']:.2f} "
          f"on {res['cpus']} CPUs (> 0.5 or so: other jobs share the cores)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0
