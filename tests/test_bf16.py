"""train.precision=bf16 (docs/precision.md): the bfloat16 rounding kernels against the NumPy
reference at every bfloat16 boundary and against round-to-nearest-even by value; unscale in
bfloat16; every value a bf16 DNN or BLSTM stores in a 16-bit format is bfloat16; the config's
rules; 2 ranks under mpiexec learning with every stored value bfloat16 (tests/mpi/
bf16_ranks.py) and a bf16 run under the CLI; and, in the CUDA simulator (a child pytest
process, as tests/test_model_cuda.py), the CUDA kernel against the reference and a GPU
rank's bf16 gradient against the CPU's within a bound derived from the roundings."""
import json
import os

import numpy as np
import pytest

from conftest import REPO, run_cuda_tests_in_child, run_mpi, run_train

CHILD = os.environ.get("HPCSGD_CUDASIM_CHILD") == "1"

# the low 16 bits that decide a rounding: exact, just above exact, just below the tie, the
# tie, just above it, the largest
LOWS = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], np.uint32)


def with_lows(uppers, lows=LOWS):
    """float32 values with these upper 16 bits (every sign, exponent and bfloat16 significand
    in `uppers`) and these low halves."""
    uppers = np.asarray(uppers, np.uint32)
    return ((uppers[:, None] << 16) | lows[None, :]).reshape(-1).view(np.float32)


def every_bf16_boundary():
    """All 2^16 upper patterns (every bfloat16: +-0, subnormals, normals, the largest finite,
    Inf, NaNs) with each low half of LOWS, and random low halves."""
    rng = np.random.default_rng(0)
    uppers = np.arange(1 << 16, dtype=np.uint32)
    random_lows = rng.integers(0, 1 << 16, (1 << 16)).astype(np.uint32)
    return np.concatenate([with_lows(uppers),
                           ((uppers << 16) | random_lows).view(np.float32)])


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def nearest_even_by_value(v):
    """The bits of float32(bfloat16(v)) for finite float32 v, from the values: the bfloat16
    neighbours below and above |v| (the one above the largest finite is 2^128: IEEE's rounding
    with an unbounded exponent, then an overflow to Inf), the nearer one in float64 (exact for
    these), a tie to the one whose last significand bit is 0."""
    b = bits(v).astype(np.uint64)
    lo = b & 0xFFFF0000                 # toward zero
    hi = lo + 0x10000                   # away from zero (0x7F80... = Inf: its value 2^128)
    sign = np.where(b >> 31, -1.0, 1.0)

    def value(x):
        mag = (x & 0x7FFFFFFF).astype(np.uint32).view(np.float32).astype(np.float64)
        return sign * np.where((x & 0x7FFFFFFF) == 0x7F800000, 2.0 ** 128, mag)
    x = v.astype(np.float64)
    d_lo, d_hi = np.abs(x - value(lo)), np.abs(value(hi) - x)
    even_lo = ((lo >> 16) & 1) == 0
    return np.where(d_lo < d_hi, lo, np.where(d_hi < d_lo, hi, np.where(even_lo, lo, hi))
                    ).astype(np.uint32)


def bf16_everywhere(a):
    """Indices of values of a that are not bfloat16 (low 16 bits not zero)."""
    return np.flatnonzero(bits(a) & 0xFFFF)


if not CHILD:
    from hpcsgd import half

    def test_round_bf16_equals_the_reference_at_every_bfloat16_boundary():
        v = every_bf16_boundary()
        ref = np.empty_like(v)
        half.round_bf16_ref(v, ref)
        out = np.full_like(v, 7.0)
        half.round_bf16(v, out)
        np.testing.assert_array_equal(bits(out), bits(ref))          # NaNs included, bit for bit
        inplace = v.copy()
        half.round_to("bfloat16")(inplace, inplace)
        np.testing.assert_array_equal(bits(inplace), bits(ref))
        assert not (bits(out) & 0xFFFF).any()                        # bfloat16 values only
        again = out.copy()
        half.round_bf16(again, again)                                # idempotent
        np.testing.assert_array_equal(bits(again), bits(out))
        nan = np.isnan(v)
        assert nan.sum() > 1000
        np.testing.assert_array_equal(np.isnan(out), nan)            # NaN stays NaN, only NaN
        assert (np.signbit(out[nan]) == np.signbit(v[nan])).all()     # ... with its sign

    def test_the_rounding_is_round_to_nearest_even_by_value_with_ieee_overflow():
        v = every_bf16_boundary()
        out = np.empty_like(v)
        half.round_bf16(v, out)
        finite = np.isfinite(v)
        np.testing.assert_array_equal(bits(out)[finite], nearest_even_by_value(v[finite]))
        inf = np.isinf(v)
        np.testing.assert_array_equal(out[inf], v[inf])
        # the classes by name: the largest finite bfloat16 (0x7F7F) plus half its ulp is a tie
        # whose even neighbour is Inf; just below it stays finite; subnormals and -0 round
        # like any value (no flush to zero)
        top = np.float32(np.uint32(0x7F7F0000).view(np.float32))
        cases = {0x7F7F8000: np.inf, 0x7F7F7FFF: top, 0xFF7F8000: -np.inf,
                 0x00008000: 0.0, 0x00018000: np.uint32(0x00020000).view(np.float32),
                 0x00008001: np.uint32(0x00010000).view(np.float32), 0x80000000: -0.0,
                 0x3F808000: 1.0, 0x3F818000: np.uint32(0x3F820000).view(np.float32)}
        for b, want in cases.items():
            got = np.empty(1, np.float32)
            half.round_bf16(np.array([b], np.uint32).view(np.float32), got)
            assert bits(got)[0] == bits(np.float32([want]))[0], (hex(b), got, want)

    @pytest.mark.parametrize("scale", [1.0, 2.0 ** 3])
    def test_unscale_in_bfloat16_equals_the_reference_and_counts_overflows(scale):
        rng = np.random.default_rng(1)
        g = (rng.standard_normal(70_000) * 1e3).astype(np.float32)
        g[[5, 40_000]] = [np.inf, np.nan]
        g[123] = np.uint32(0x7F7FA000).view(np.float32)   # finite, rounds to Inf in bfloat16
        g[124] = np.float32(1e30)                         # beyond float16, fine in bfloat16
        ref = g.copy()
        want = half.unscale_ref(ref, scale, "bfloat16")
        got = half.unscale(g, scale, "bfloat16")
        finite = np.isfinite(ref)
        np.testing.assert_array_equal(bits(g)[finite], bits(ref)[finite])
        assert got == want and got[0] == 3
        assert not bf16_everywhere(g[finite] / np.float32(1.0 / scale)).size

    def test_round_to_names_the_two_formats_and_refuses_others():
        assert half.round_to("float16") is half.round_half
        assert half.round_to("bfloat16") is half.round_bf16
        with pytest.raises(ValueError, match="bf16"):
            half.round_to("bf16")
        with pytest.raises(ValueError, match="rounding"):
            half.unscale(np.zeros(3, np.float32), 1.0, "float8")

    # --- the model: every value stored in a 16-bit format is bfloat16 -------------------------

    class CheckedOps:
        """A model's ops whose calls each check that every float32 array they read is
        bfloat16 (the bias and its gradient excepted: float32 by design). Sits inside HalfOps:
        a GEMM output has been rounded by then; a kernel's output is rounded after the call
        (checked where the next kernel reads it, and after the pass)."""

        FLOAT32 = {"b", "gb"}

        def __init__(self, ops):
            self.ops, self.calls = ops, {}

        def __getattr__(self, name):
            method = getattr(self.ops, name)
            code = method.__func__.__code__
            names = code.co_varnames[1:code.co_argcount]

            def arrays(named):
                for n, a in named:
                    if isinstance(a, tuple):   # a BLSTM's two directions
                        sub = getattr(self.ops, "lstm_step" if name == "lstm_step2"
                                      else "lstm_step_backward").__func__.__code__
                        yield from arrays(zip(sub.co_varnames[1:sub.co_argcount], a))
                    elif isinstance(a, np.ndarray) and a.dtype == np.float32 \
                            and n not in self.FLOAT32:
                        yield n, a

            def call(*args):
                if name != "scale":   # the loss gradient, rounded once after its scaling
                    for n, a in arrays(zip(names, args)):
                        bad = bf16_everywhere(a)
                        assert not bad.size, f"{name}({n}) reads {bad.size} non-bfloat16 values"
                self.calls[name] = self.calls.get(name, 0) + 1
                return method(*args)
            return call

    def bf16_model(kind):
        from hpcsgd.model.dnn import dnn
        from hpcsgd.model.lstm import lstm
        if kind == "dnn":
            return dnn(6, [7, 5], 3, "sigmoid", max_batch=12, precision="bf16"), None
        return lstm(6, [4], 3, True, [5], "sigmoid", steps=3, max_batch=12,
                    precision="bf16"), 3

    @pytest.mark.parametrize("kind", ["dnn", "blstm"])
    def test_every_value_a_bf16_model_stores_is_bfloat16(kind):
        from hpcsgd.model.ops import HalfOps
        model, steps = bf16_model(kind)
        assert model.rounding == "bfloat16" and model.half_ops.kind == "bfloat16"
        checked = CheckedOps(model.ops)
        model.half_ops.ops = checked
        params, grads = model.new_params(), model.new_params()
        model.init(params, np.random.default_rng(2))
        rng = np.random.default_rng(3)
        params.flat[...] += rng.standard_normal(params.size).astype(np.float32) * 0.1
        x = (rng.standard_normal((12, 6)) * 3).astype(np.float32)
        y = rng.integers(0, 3, 12).astype(np.int32)
        ce, _ = model.forward_backward(params, grads, x, y, 12)
        assert np.isfinite(ce) and isinstance(model.half_ops, HalfOps)
        assert model.unscale(grads, 1.0) == (0, float(np.abs(grads.flat).max()))
        stored = {"x16": model.x16[:12], "w16": model.w16.flat, "delta": model.delta,
                  "gradient": grads.flat, **{f"acts{i}": a for i, a in enumerate(model.acts)},
                  **{f"{i}.{k}": v for i, ws in enumerate(model.workspaces) if ws
                     for k, v in ws.items()}}
        for name, a in stored.items():
            assert not bf16_everywhere(a).size, name
        want = {"bias_act", "act_backward", "softmax_xent"} | (
            {"lstm_step2", "lstm_step_backward2"} if steps else set())
        assert want <= set(checked.calls), checked.calls

    def test_bf16_gradient_is_the_float32_gradient_to_bfloat16_precision():
        """The same model and data in float32 and bf16: relative to the gradient's size, bf16
        differs from float32 by the bfloat16 roundings (unit roundoff 2^-8, a few stores deep:
        well under 2^-3) and by more than float32 roundings (it does round)."""
        from hpcsgd.model.dnn import dnn
        rng = np.random.default_rng(4)
        x = rng.standard_normal((64, 6)).astype(np.float32)
        y = rng.integers(0, 3, 64).astype(np.int32)
        out = {}
        for precision in ("float32", "bf16"):
            model = dnn(6, [16], 3, "sigmoid", max_batch=64, precision=precision)
            params, grads = model.new_params(), model.new_params()
            model.init(params, np.random.default_rng(1))
            model.forward_backward(params, grads, x, y, 64)
            model.unscale(grads, 1.0)
            out[precision] = grads.flat.astype(np.float64)
        rel = np.linalg.norm(out["bf16"] - out["float32"]) / np.linalg.norm(out["float32"])
        assert 2.0 ** -20 < rel < 2.0 ** -3, rel

    # --- the config -------------------------------------------------------------------------

    def test_the_config_takes_bf16_and_refuses_a_loss_scale_qat_and_a_model_split():
        from hpcsgd import config
        from hpcsgd.errors import UserError
        cfg = config.load(None, ["data.train=x", "train.precision=bf16"])
        assert cfg["train.precision"] == "bf16" and cfg["train.loss_scale"] == "none"
        with pytest.raises(UserError, match="bf16 and train.loss_scale=backoff.*exponent range"):
            config.load(None, ["data.train=x", "train.precision=bf16", "train.loss_scale=backoff"])
        with pytest.raises(UserError, match="qat.*float32"):
            config.load(None, ["data.train=x", "train.precision=bf16", "qat.weights=sawb"])
        with pytest.raises(UserError, match="model.parallel"):
            config.load(None, ["data.train=x", "train.precision=bf16", "model.parallel=2"])
        with pytest.raises(UserError, match="bf16"):
            config.load(None, ["data.train=x", "train.precision=bfloat16"])

    # --- ranks under mpiexec ----------------------------------------------------------------

    def test_two_bf16_ranks_learn_and_store_only_bfloat16_values():
        proc = run_mpi(2, [os.path.join(REPO, "tests", "mpi", "bf16_ranks.py")], timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert proc.stdout.count("bf16 ok") == 2, proc.stdout

    def test_a_bf16_run_under_the_cli_learns_and_says_it_scales_no_loss(tmp_path):
        from test_train import train_args
        from conftest import make_archive
        data = str(tmp_path / "synth")
        make_archive(data, num_shards=2, utts_per_shard=10)
        run = str(tmp_path / "run")
        proc = run_train(2, train_args(data, run, "train.precision=bf16")[1:], timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        log = open(os.path.join(run, "logs", "rank0000.log")).read()
        assert "precision bf16, loss scaling none (bfloat16 has float32's exponent range" in log
        assert "a bfloat16 copy computes" in log and "skipped" not in log
        records = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
        epochs = [r for r in records if r.get("kind") == "epoch"]
        assert len(epochs) == 2 and epochs[-1]["train_ce"] < epochs[0]["train_ce"]
        assert "precision: bf16" in open(os.path.join(run, "config.yaml")).read()

    def test_bf16_kernels_in_simulator_subprocess():
        run_cuda_tests_in_child(__file__)   # the simulator, or a GPU with HPCSGD_TEST_GPU=1

else:
    from numba import cuda

    from hpcsgd import half
    from hpcsgd.bfloat16 import values

    def as_values(a):
        """A stored array's float32 values: a uint16 array (bfloat16 storage) holds bits."""
        return values(a) if a.dtype == np.uint16 else a

    def boundary_sample():
        """Every sign and exponent with an even and an odd last significand bit, the largest
        significand (its carry reaches the exponent) and the smallest, each with every low
        half of LOWS: 6,144 values (the simulator runs a Python thread per value)."""
        uppers = [(s << 15) | (e << 7) | m for s in (0, 1) for e in range(256)
                  for m in (0x00, 0x01, 0x7E, 0x7F)]
        return with_lows(uppers)

    def test_the_cuda_rounding_equals_the_reference_bit_for_bit():
        v = boundary_sample()
        ref = np.empty_like(v)
        half.round_bf16_ref(v, ref)
        dev = cuda.to_device(v)
        out = cuda.to_device(np.full_like(v, 7.0))
        half.round_bf16(dev, out)
        np.testing.assert_array_equal(bits(out.copy_to_host()), bits(ref))
        half.round_bf16(dev, dev)                                   # in place
        np.testing.assert_array_equal(bits(dev.copy_to_host()), bits(ref))

    def test_unscale_in_bfloat16_on_the_device_equals_the_cpu():
        rng = np.random.default_rng(5)
        g = (rng.standard_normal(700) * 5e4).astype(np.float32)
        g[[3, 9, 11]] = [np.nan, -np.inf, np.uint32(0x7F7FC000).view(np.float32)]
        cpu = g.copy()
        want = half.unscale(cpu, 1.0, "bfloat16")
        dev = cuda.to_device(g)
        assert half.unscale(dev, 1.0, "bfloat16") == want and want[0] == 3
        ok = np.isfinite(cpu)
        np.testing.assert_array_equal(bits(dev.copy_to_host())[ok], bits(cpu)[ok])

    def ulp(v):
        """The spacing of bfloat16 at |v| (8 significant bits; subnormals 2^-133)."""
        v = np.maximum(np.abs(v), 2.0 ** -126)
        return 2.0 ** (np.floor(np.log2(v)) - 7)

    def rounded(e, v):
        """How far apart two roundings to bfloat16 of values e apart near v can land: e plus
        one ulp (each is within half an ulp of its value)."""
        return e + ulp(np.abs(v) + e)

    def gamma(k):
        """float32's bound on a k-term dot product in any order: k 2^-24 (plus its square)."""
        return k * 2.0 ** -24 * 1.01

    def test_a_gpu_ranks_bf16_gradient_is_the_cpus_within_the_rounding_bound():
        """The same bf16 step on a GPU rank and a CPU rank. Both round the same float32
        master and frames to the same bfloat16 copies (integer arithmetic: bit for bit, tested
        above). After that the GEMMs may sum in another order (cuBLAS; gamma) and the kernels
        differ in float32's last bits (exp: 2^-20 here); each stored value then rounds to
        bfloat16 from float32 values that close, so the two copies land on the same bfloat16
        value or on neighbours: one ulp, plus whatever came from upstream. Propagating those
        per-element bounds through the step (ReLU's mask may differ only where the
        preactivation is within its bound of 0; softmax moves p_j by at most p_j (e^{2E} - 1)
        for logits E apart) gives a bound for every gradient element and the cross-entropy;
        magnitudes come from a NumPy
        emulation of the step, and the check allows twice the first-order bound. Worst-case
        per element, it is loose where a sum cancels (the first layer's weight gradient: up to
        about its own size); the bits of the copies and every store being bfloat16 are checked
        exactly. In the simulator the GEMMs are the same NumPy calls and the two gradients
        came out equal bit for bit (not assumed: the kernels' exp differ); on a GPU
        (HPCSGD_TEST_GPU=1) the bound is what covers cuBLAS's order of sums."""
        from hpcsgd.model.dnn import dnn
        n = 9
        rng = np.random.default_rng(6)
        x = (rng.standard_normal((n, 6)) * 2).astype(np.float32)
        y = rng.integers(0, 3, n).astype(np.int32)
        out = {}
        for device in ("cpu", "cuda"):
            model = dnn(6, [5], 3, "relu", max_batch=n, device=device, precision="bf16")
            params, grads = model.new_params(), model.new_params()
            if device == "cpu":
                model.init(params, np.random.default_rng(1))
                bias = np.random.default_rng(7).standard_normal(8).astype(np.float32) * 0.3
                params.views["enc.0.b"][...] = bias[:5]
                params.views["out.b"][...] = bias[5:]
            else:   # the CPU's master weights
                params.flat.copy_to_device(out["cpu"]["params"])
            ce, _ = model.forward_backward(params, grads, x, y, n)
            bad, _ = model.unscale(grads, 1.0)
            # GPU ranks store bfloat16 bits in uint16 arrays: their values, to compare
            get = (lambda a: a) if device == "cpu" else (lambda a: as_values(a.copy_to_host()))
            stored = [get(model.x16)[:n], get(model.w16.flat), get(model.delta),
                      get(grads.flat), *[get(a)[:n] for a in model.acts]]
            for a in stored:   # every 16-bit store of either device is bfloat16
                assert not bf16_everywhere(a).size
            out[device] = {"ce": ce, "bad": bad, "grads": get(grads.flat).copy(),
                           "params": get(params.flat).copy(), "w16": get(model.w16.flat),
                           "x16": get(model.x16)[:n].astype(np.float64)}
        cpu, gpu = out["cpu"], out["cuda"]
        np.testing.assert_array_equal(bits(gpu["w16"]), bits(cpu["w16"]))
        np.testing.assert_array_equal(bits(gpu["x16"].astype(np.float32)),
                                      bits(cpu["x16"].astype(np.float32)))
        assert cpu["bad"] == gpu["bad"] == 0

        # magnitudes: the step emulated in NumPy (float64 between bfloat16 roundings)
        def r(a):
            a32 = np.asarray(a, np.float32)
            o = np.empty_like(a32)
            half.round_bf16_ref(a32, o)
            return o.astype(np.float64)
        specs = dnn(6, [5], 3, "relu", max_batch=n, precision="bf16").new_params()
        specs.flat[...] = cpu["w16"]
        W0, b0, W1, b1 = (specs.views[k].astype(np.float64) for k in ("enc.0.w", "enc.0.b",
                                                                  "out.w", "out.b"))
        x16 = cpu["x16"]
        onehot = np.eye(3)[y]
        z1 = r(x16 @ W0)
        h1 = r(np.maximum(z1 + b0, 0))
        z2 = r(h1 @ W1)
        s = np.exp(z2 + b1 - (z2 + b1).max(1, keepdims=True))
        p = s / s.sum(1, keepdims=True)
        dz2 = r(p - onehot)
        dx = r(dz2 @ W1.T)
        dz1 = dx * (h1 > 0)
        A = np.abs
        kernel = 2.0 ** -20   # a float32 kernel's result on the two devices (exp, log, sums)
        e_z1 = rounded(gamma(6) * A(x16) @ A(W0), z1)
        e_h1 = rounded(e_z1 + 2.0 ** -23 * A(h1), h1)
        e_z2 = rounded(e_h1 @ A(W1) + gamma(5) * A(h1) @ A(W1), z2)
        E = e_z2.max(1, keepdims=True)                      # per row: the logits' distance
        e_p = p * np.expm1(2 * E) + kernel
        e_dz2 = rounded(e_p, dz2)
        bound = {
            "out.w": rounded(e_h1.T @ (A(dz2) + e_dz2) + A(h1).T @ e_dz2
                          + gamma(n) * A(h1).T @ A(dz2), h1.T @ dz2),
            "out.b": rounded(e_p.sum(0, keepdims=True) + gamma(n) * A(p - onehot).sum(0), dz2.sum(0)),
        }
        e_dx = rounded(e_dz2 @ A(W1).T + gamma(3) * A(dz2) @ A(W1).T, dx)
        flip = A(z1 + b0) <= e_z1 + 2.0 ** -23 * A(z1 + b0)  # ReLU's mask may differ there
        e_dz1 = e_dx + flip * (A(dx) + e_dx)
        bound["enc.0.w"] = rounded(A(x16).T @ e_dz1 + gamma(n) * A(x16).T @ A(dz1), x16.T @ dz1)
        bound["enc.0.b"] = rounded(e_dz1.sum(0, keepdims=True) + gamma(n) * A(dz1).sum(0),
                              dz1.sum(0, keepdims=True))
        want = {}
        for flat, key in ((gpu["grads"], "gpu"), (cpu["grads"], "cpu")):
            specs.flat[...] = flat
            want[key] = {k: specs.views[k].astype(np.float64).copy() for k in bound}
        for k, b in bound.items():
            diff = A(want["gpu"][k] - want["cpu"][k])
            assert (diff <= 2 * b).all(), (k, diff.max(), b[diff > 2 * b])
        e_ce = (2 * E + kernel * np.maximum(1.0, -np.log(p[np.arange(n), y]))[:, None]).sum()
        assert abs(gpu["ce"] - cpu["ce"]) <= 2 * e_ce
