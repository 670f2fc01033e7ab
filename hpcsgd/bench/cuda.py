"""`hpcsgd bench cuda`: every Numba CUDA kernel of the project compiled for real GPUs (sm_80,
sm_90) by NVVM, with the argument types the trainer launches it with, and the registers per
thread and spills ptxas reports -- on a machine without a GPU.

    hpcsgd bench cuda [--cc 80,90] [--kernels NAMES] [--json FILE]

No GPU has run this project's CUDA kernels (none was lent to it); Numba's simulator runs them
(every test) but does not compile them. So this:
  1. records: a child process under NUMBA_ENABLE_CUDASIM=1 runs the GPU paths of the trainer
     itself -- a GPU DNN's and BLSTM's forward, backward and posteriors, the step with the striped
     exchange and every codec, the float32 and float16 allreduce, the optimizer's kernels --
     on tiny shapes, and notes the Numba type of every argument of every kernel launch;
  2. compiles each (kernel, signature) with numba.cuda.compile_ptx for each target, and links
     the PTX with nvJitLink (-verbose: ptxas's report of registers, spill stores and loads).
Every module-level CUDA kernel of hpcsgd must appear among the launches: a kernel the
recording does not reach is an error, not a silent gap. Needs the NVVM/NVRTC/nvJitLink wheels
(`pip install "numba-cuda[cu13]"`, in the test extra); no GPU, no CUDA driver.
"""
import json
import os
import re
import subprocess
import sys

KERNEL_MODULES = ("hpcsgd.device", "hpcsgd.optim", "hpcsgd.model.kernels_cuda",
                  "hpcsgd.model.kernels_ctc_cuda", "hpcsgd.model.kernels_rnnt_cuda",
                  "hpcsgd.model.kernels_joint_cuda",
                  "hpcsgd.codecs.onebit", "hpcsgd.codecs.kbit",
                  "hpcsgd.codecs.dettmers", "hpcsgd.codecs.floats", "hpcsgd.half")
USAGE = __doc__.split("\n\n")[0] + "\n\n    hpcsgd bench cuda [--cc 80,90] [--kernels NAMES] [--json FILE]"
EXAMPLES = """examples:
  hpcsgd bench cuda                     every kernel for sm_80 and sm_90
  hpcsgd bench cuda --cc 90 --json cuda.json
  hpcsgd bench cuda --kernels codecs.onebit,optim     only the kernels you changed"""


def add_arguments(parser):
    parser.add_argument("--small", action="store_true", help="the same (it takes seconds)")
    parser.add_argument("--cc", default="80,90",
                        help="compute capabilities to compile for, e.g. 80,90 (A100, H100)")
    parser.add_argument("--kernels", metavar="NAMES",
                        help="compile only the kernels whose name contains one of these "
                             "comma-separated parts, e.g. codecs.onebit,optim (default: all; "
                             "the recording still has to reach every kernel)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds for the recording")
    parser.add_argument("--launches", metavar="JSON",
                        help="the recorded launches: read from this file if it exists, else "
                             "recorded and written to it (a second run compiles them again "
                             "without the minute in the simulator)")


# ---- 1. recording, in the simulator (a child process) --------------------------------------

def _arg_type(arg):
    """(dtype name, ndim, layout) for an array argument, or ("scalar", numba type name)."""
    import numpy as np
    if hasattr(arg, "_ary"):          # the simulator's device arrays wrap a NumPy array
        arg = arg._ary
    if isinstance(arg, np.ndarray):
        layout = "C" if arg.flags.c_contiguous else ("F" if arg.flags.f_contiguous else "A")
        return [arg.dtype.name, arg.ndim, layout]
    import numba
    return ["scalar", str(numba.typeof(arg))]


def record(out_path):
    """Run the trainer's GPU paths under the simulator; write {kernel: [signature, ...]}."""
    assert os.environ.get("NUMBA_ENABLE_CUDASIM") == "1", "record() runs in the simulator"
    import numpy as np
    from mpi4py import MPI
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    seen = {}
    launch = FakeCUDAKernel.__call__

    def recording(self, *args):
        from numba.cuda.simulator import kernel as sim
        if not self._device and not sim._kernel_context:   # a launch from the host
            key = f"{self.fn.__module__}.{self.fn.__name__}"
            sig = [_arg_type(a) for a in args]
            if sig not in seen.setdefault(key, []):
                seen[key].append(sig)
        return launch(self, *args)
    FakeCUDAKernel.__call__ = recording

    from hpcsgd.codecs import make_codec
    from hpcsgd.comm.exchange import Allreduce, Striped
    from hpcsgd.model.dnn import dnn
    from hpcsgd.optim import Optimizer
    from hpcsgd.step import Phases, Step, exchange_update, gradient_buffers

    rng = np.random.default_rng(0)
    n = 8
    x = rng.standard_normal((n, 6)).astype(np.float32)
    y = rng.integers(0, 3, n).astype(np.int32)
    # every codec once: bit widths, range rules and Dettmers' types are run-time values of
    # the same argument types (and the simulator runs each CUDA thread as a Python thread)
    codecs = [("onebit", {}), ("float32", {}), ("float16", {}), ("kbit", {"bits": 4}),
              ("dettmers", {"dtype": "dynamic_tree"})]
    # the argument types do not depend on the activation, the AdaGrad placement or the
    # values (those are run-time ints and floats): one model, and one step per exchange,
    # AdaGrad "local" where it adds its own kernel, "aggregate" elsewhere
    model = dnn(6, [5], 3, "sigmoid", max_batch=n, device="cuda")
    params = model.new_params()
    model.init(params, np.random.default_rng(1))
    model.forward(params, x, n, log=True)
    model.forward(params, x, n, log=False)
    exchanges = [Allreduce(MPI.COMM_SELF, params.size, dtype, device="cuda")
                 for dtype in ("float32", "float16")]
    exchanges += [Striped(MPI.COMM_SELF, params.matrices, make_codec(name, "cuda", **kw),
                          device="cuda") for name, kw in codecs]
    # the whole step once (model kernels, AdaGrad "local"), then each exchange and its update
    # on that gradient (the model's launches would only repeat)
    opt = Optimizer(params.size, momentum_time_constant=100.0, adagrad="local",
                    weight_decay=1e-4, post_size=exchanges[0].state_size, device="cuda")
    step = Step(model, params, gradient_buffers(model, False), opt, exchanges[0], device="cuda")
    step.run(lambda k: (x[:k], y[:k]), np.array([n]), 0, 1e-3)
    opt.fused_update(params.flat, step.grads[0].flat, 1e-3)   # bench train's no-exchange step
    # mixed precision with a loss scale (hpcsgd/half.py's kernels)
    from hpcsgd.loss_scale import Static
    mixed = dnn(6, [5], 3, "sigmoid", max_batch=n, device="cuda", precision="mixed")
    mixed_params = mixed.new_params()
    mixed.init(mixed_params, np.random.default_rng(1))
    Step(mixed, mixed_params, gradient_buffers(mixed, False),
         Optimizer(mixed_params.size, device="cuda"), exchanges[0], device="cuda",
         scaler=Static(2.0 ** 10)).run(lambda k: (x[:k], y[:k]), np.array([n]), 0, 1e-3)
    # bf16 (no loss scale): bfloat16 storage (uint16 arrays: the kernels' bfloat16 signatures,
    # the weights' and input's conversion) and the rounding kernel in unscale
    bf16 = dnn(6, [5], 3, "sigmoid", max_batch=n, device="cuda", precision="bf16")
    bf16_params = bf16.new_params()
    bf16.init(bf16_params, np.random.default_rng(1))
    Step(bf16, bf16_params, gradient_buffers(bf16, False),
         Optimizer(bf16_params.size, device="cuda"), exchanges[0],
         device="cuda").run(lambda k: (x[:k], y[:k]), np.array([n]), 0, 1e-3)
    # a BLSTM step (hpcsgd/model/lstm.py: the step kernels on strided views, the masked
    # softmax, the column sums), then its posteriors; clipping on
    from hpcsgd.model.lstm import lstm
    steps = 2
    blstm = lstm(6, [3], 3, True, [4], "sigmoid", steps=steps, max_batch=n, device="cuda")
    blstm_params = blstm.new_params()
    blstm.init(blstm_params, np.random.default_rng(1))
    y_seq = y.copy()
    y_seq[0] = -1
    Step(blstm, blstm_params, gradient_buffers(blstm, False),
         Optimizer(blstm_params.size, device="cuda"), exchanges[0], device="cuda",
         clip=1e-3).run(lambda k: (x[:k], y_seq[:k]), np.array([n]), 0, 1e-3)
    blstm.forward(blstm_params, x, n, log=True)
    # the same BLSTM in mixed precision and bf16: float16 and bfloat16 (uint16) storage, so
    # every LSTM, softmax and column sums kernel's 16-bit signatures
    # (hpcsgd/model/kernels_cuda.py); its forward is float32
    for precision, scaler in (("mixed", Static(2.0 ** 10)), ("bf16", None)):
        half_blstm = lstm(6, [3], 3, True, [4], "sigmoid", steps=steps, max_batch=n,
                          device="cuda", precision=precision)
        half_blstm_params = half_blstm.new_params()
        half_blstm.init(half_blstm_params, np.random.default_rng(1))
        Step(half_blstm, half_blstm_params, gradient_buffers(half_blstm, False),
             Optimizer(half_blstm_params.size, device="cuda"), exchanges[0], device="cuda",
             scaler=scaler).run(lambda k: (x[:k], y_seq[:k]), np.array([n]), 0, 1e-3)
    # quantization-aware training (hpcsgd/model/quantize.py): learned clips on weights and
    # inputs (the backward's reductions), dynamic SAWB ranges (the statistics), the BLSTM's
    # quantized hidden state on strided views
    from hpcsgd.model import build
    for shape, qat in ((dict(input_dim=6, hidden=[5], num_labels=3, activation="sigmoid"),
                        dict(weights="pact", weight_bits=4, activations="pact", activation_bits=4)),
                       (dict(input_dim=6, hidden=[5], num_labels=3, activation="sigmoid"),
                        dict(weights="sawb", weight_bits=4, weight_scale="channel")),
                       (dict(type="lstm", input_dim=6, cells=[3], num_labels=3,
                             bidirectional=True, bottleneck=[4], activation="sigmoid",
                             steps=steps),
                        dict(weights="sawb", weight_bits=4, activations="sawb", activation_bits=4))):
        quantized = build({**shape, "qat": qat}, max_batch=n, device="cuda")
        q_params = quantized.new_params()
        quantized.init(q_params, np.random.default_rng(1))
        quantized.forward_backward(q_params, quantized.new_params(), x, y, n)
    # a CTC model's step in float32, mixed and bf16 (the sequence kernels: unfold, fold,
    # mask: a second convolution has an input gradient; the CTC loss's float32, float16 and
    # bfloat16 signatures; dropout between the encoder's layers), then its posteriors
    from hpcsgd.data.utterances import Targets
    from hpcsgd.model.ctc import ctc
    frames = np.array([5, 3], np.int64)   # two utterances, time-major (5 steps x 2)
    targets = Targets(frames, np.array([1, 2, 2], np.int32), np.array([0, 2, 3], np.int64),
                      np.array([7, 8], np.uint64))
    x_seq = x[:5].repeat(2, axis=0)
    # an RNN-T model the same way (the joint's kernels and the loss on float16 and bfloat16
    # storage), its joint in sub-batches of one utterance (the output layer's gradient summed
    # over them)
    from hpcsgd.model.transducer import rnnt

    def rnnt_one_utterance_a_joint(**kw):
        model = rnnt(6, ["conv 3 k3 s2", "blstm 2"], 4, predictor=["lstm 2"], embed=2, joint=3,
                     **kw)
        model.layers[-1].joint_budget = 1
        return model
    for build_seq in (lambda **kw: ctc(6, ["conv 3 k3 s2", "conv 3 k3", "blstm 2"], 3, **kw),
                      rnnt_one_utterance_a_joint):
        for precision, scaler in (("float32", None), ("mixed", Static(2.0 ** 10)),
                                  ("bf16", None)):
            model_seq = build_seq(max_batch=n + 2, device="cuda", precision=precision)
            model_seq.set_dropout(0.2)
            seq_params = model_seq.new_params()
            model_seq.init(seq_params, np.random.default_rng(1))
            Step(model_seq, seq_params, gradient_buffers(model_seq, False),
                 Optimizer(seq_params.size, device="cuda"), exchanges[0], device="cuda",
                 scaler=scaler).run(lambda k: (x_seq, targets), np.array([8]), 0, 1e-3)
        model_seq.forward(seq_params, x_seq, len(x_seq), lengths=frames)
    for ex in exchanges[1:]:
        opt = Optimizer(params.size, momentum_time_constant=100.0, adagrad="aggregate",
                        weight_decay=1e-4, post_size=ex.state_size, device="cuda")
        opt.begin_step(n, n)
        exchange_update(ex, opt, params.flat, step.grads[0].flat, 1e-3, Phases("cuda"))
    with open(out_path, "w") as f:
        json.dump(seen, f, indent=1, sort_keys=True)


# ---- 2. compiling, for real targets (this process) -----------------------------------------

def project_kernels():
    """{module.name: CUDA dispatcher} of every module-level kernel (not device function)."""
    import importlib

    from numba.cuda.dispatcher import CUDADispatcher

    from hpcsgd.lazy_cuda import load
    modules = [importlib.import_module(name) for name in KERNEL_MODULES]
    load()   # the deferred kernels made, and rebound in their modules
    out = {}
    for module in modules:
        for attr, obj in vars(module).items():
            if isinstance(obj, CUDADispatcher) and not obj.targetoptions.get("device"):
                out[f"{obj.py_func.__module__}.{obj.py_func.__name__}"] = obj
    return out


def numba_signature(sig):
    from numba import types
    out = []
    for arg in sig:
        if arg[0] == "scalar":
            out.append(getattr(types, arg[1]) if hasattr(types, arg[1])
                       else types.boolean if arg[1] == "bool" else None)
        else:
            dtype, ndim, layout = arg
            out.append(types.Array(getattr(types, dtype), ndim, layout))
    if None in out:
        raise ValueError(f"cannot type {sig}")
    return tuple(out)


def ptxas_report(ptx, cc):
    """Link PTX for sm_<cc> with nvJitLink; ptxas's registers, spill stores and loads."""
    from cuda.bindings import nvjitlink
    handle = nvjitlink.create(3, [f"-arch=sm_{cc}", "-verbose", "-O3"])
    try:
        data = ptx.encode()
        nvjitlink.add_data(handle, nvjitlink.InputType.PTX, data, len(data), "kernel.ptx")
        nvjitlink.complete(handle)
        log = bytearray(nvjitlink.get_info_log_size(handle))
        nvjitlink.get_info_log(handle, log)
        cubin = nvjitlink.get_linked_cubin_size(handle)
    finally:
        nvjitlink.destroy(handle)
    text = log.decode(errors="replace")
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_stores": int(spills.group(1)) if spills else None,
            "spill_loads": int(spills.group(2)) if spills else None, "cubin_bytes": cubin}


class _Target:
    """What numba-cuda asks the current device for when it compiles the device functions a
    kernel calls (its compute capability); here there is no device, so the target answers."""
    compute_capability = (9, 0)


def _compile_one(task):
    """One (kernel, signature, cc) -> its row: PTX from NVVM, then ptxas's report."""
    from numba import cuda
    name, sig, cc = task
    nsig = numba_signature(sig)
    _Target.compute_capability = divmod(cc, 10)
    ptx, _ = cuda.compile_ptx(project_kernels()[name].py_func, nsig, cc=divmod(cc, 10))
    return {"kernel": name, "signature": [str(t) for t in nsig], "cc": cc,
            "fusable_muls": fusable_muls(ptx), **ptxas_report(ptx, cc)}


# A floating multiply without a rounding modifier: PTX lets ptxas fuse it with a following add
# into an FMA (one rounding where the CPU kernels round twice), so a kernel whose results must
# equal the CPU's bit for bit has none (hpcsgd/device.py: mul_rn). `fma.` written out counts too.
FUSABLE = re.compile(r"^\s*(mul(\.ftz)?\.f(32|64)|fma\.\S+)\s", re.M)


def fusable_muls(ptx):
    """How many floating multiplies of this PTX ptxas may contract into an FMA."""
    return len(FUSABLE.findall(ptx))


def _compile_many(tasks):
    return [_compile_one(t) for t in tasks]


def compile_all(recorded, ccs, workers=None, only=None):
    """Every recorded (kernel, signature) for every target. Each target in its own forked
    processes (a device function compiled for one target is cached and would be reused for
    the next: the cubin sizes then depend on the order), as many as this process may use
    cores (each compilation independent, NVVM single-threaded)."""
    import concurrent.futures
    import multiprocessing

    from numba.cuda import dispatcher

    from hpcsgd.threads import affinity
    dispatcher.get_current_device = lambda: _Target
    kernels = project_kernels()
    missing = sorted(set(kernels) - set(recorded))
    if missing:
        raise SystemExit(f"hpcsgd bench cuda: kernels no recorded launch reached: {missing}")
    workers = workers or len(affinity())
    if only:
        recorded = {k: v for k, v in recorded.items() if any(part in k for part in only)}
        if not recorded:
            raise SystemExit(f"hpcsgd bench cuda: no kernel name contains any of {only}")
    rows = []
    fork = multiprocessing.get_context("fork")
    for cc in ccs:
        tasks = [(name, sig, cc) for name in sorted(recorded) for sig in recorded[name]]
        n = min(workers, len(tasks))
        with concurrent.futures.ProcessPoolExecutor(n, mp_context=fork) as pool:
            done = list(pool.map(_compile_many, [tasks[i::n] for i in range(n)]))
        ordered = [None] * len(tasks)
        for i, share in enumerate(done):   # share i holds tasks i, i + n, i + 2n, ...
            ordered[i::n] = share
        rows += ordered
    return rows


def run(args):
    import tempfile
    ccs = [int(c) for c in args.cc.split(",")]
    with tempfile.TemporaryDirectory(prefix="hpcsgd-cuda-") as tmp:
        out = args.launches or os.path.join(tmp, "launches.json")
        if not os.path.exists(out):
            env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
            proc = subprocess.run([sys.executable, "-m", "hpcsgd.bench.cuda", "--record", out],
                                  env=env, capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0:
                print(proc.stdout[-2000:] + proc.stderr[-4000:], file=sys.stderr)
                return 1
        with open(out) as f:
            recorded = json.load(f)
    only = [part for part in (args.kernels or "").split(",") if part]
    rows = compile_all(recorded, ccs, only=only)
    recorded = sorted({r["kernel"] for r in rows})
    print(f"hpcsgd bench cuda: {len(recorded)} kernels, {len(rows)} compilations "
          f"(signatures as launched x sm_{', sm_'.join(map(str, ccs))})")
    print(f"{'kernel':<46s} {'args':>4s} {'cc':>3s} {'regs':>5s} {'spill st':>8s} {'spill ld':>8s}"
          f" {'fusable':>7s}")
    worst = {}
    for r in rows:   # the worst signature of each kernel and target
        key = (r["kernel"], r["cc"])
        if key not in worst or (r["registers"] or 0) > (worst[key]["registers"] or 0):
            worst[key] = r
    for (name, cc), r in sorted(worst.items()):
        print(f"{name.replace('hpcsgd.', ''):<46s} {len(r['signature']):>4d} {cc:>3d} "
              f"{r['registers']:>5} {r['spill_stores']:>8} {r['spill_loads']:>8}"
              f" {max(x['fusable_muls'] for x in rows if x['kernel'] == name):>7}")
    spilling = [r for r in rows if r["spill_stores"] or r["spill_loads"]]
    print(f"spills: {len(spilling)} of {len(rows)} compilations")
    return {"kernels": recorded, "ccs": ccs, "compilations": rows,
            "spilling": len(spilling)}


def figures(result):
    """The register count of each kernel's heaviest signature per target (as a float, like
    every figure --compare shows)."""
    out = {}
    for r in result["compilations"]:
        key = f"{r['kernel']} sm_{r['cc']} registers"
        out[key] = max(out.get(key, 0.0), float(r["registers"]))
    return out


if __name__ == "__main__":
    if sys.argv[1:2] == ["--record"]:
        record(sys.argv[2])
