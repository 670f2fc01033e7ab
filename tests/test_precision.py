"""Mixed precision and loss scaling (docs/precision.md): the float16 kernels against NumPy, the
scalers' rules, exact power-of-two scaling, the collective skip on an overflow, the float32
master weight, and a mixed run under the CLI (skips logged, bit-exact resume). K mixed ranks
= one mixed rank: tests/test_exchange.py."""
import json
import math
import os

import numpy as np
import pytest

from conftest import REPO, run_mpi
from hpcsgd import half, loss_scale
from test_step import N, batches, setup
from test_train import final_params, hpcsgd, synth, train_args  # noqa: F401 (fixture)



def every_half_and_tie():
    """Every finite float16, the midpoints between neighbours (ties), one float32 ulp either
    side of each midpoint, and values beyond the range."""
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    h = np.sort(h[np.isfinite(h)].astype(np.float64))
    mid = (h[:-1] + h[1:]) / 2
    mid32 = mid.astype(np.float32)
    return np.concatenate([h.astype(np.float32), mid32, np.nextafter(mid32, np.inf),
                           np.nextafter(mid32, -np.inf),
                           np.float32([65520.0, -65520.0, 65519.996, 1e30, np.inf, -np.inf,
                                       np.nan, 1e-30, -0.0])])


def test_round_half_equals_numpy_at_every_half_and_tie():
    v = every_half_and_tie()
    ref = np.empty_like(v)
    half.round_half_ref(v, ref)
    out = np.full_like(v, 7.0)
    half.round_half(v, out)
    np.testing.assert_array_equal(out.view(np.uint32)[~np.isnan(ref)],
                                  ref.view(np.uint32)[~np.isnan(ref)])
    assert np.isnan(out[np.isnan(ref)]).all()
    inplace = v.copy()
    half.round_half(inplace, inplace)
    np.testing.assert_array_equal(np.isnan(inplace), np.isnan(ref))


@pytest.mark.parametrize("half_first", [True, False])
@pytest.mark.parametrize("scale", [1.0, 2.0 ** 10, 2.0 ** -3, 3.0])
def test_unscale_equals_numpy_and_counts_what_is_not_finite(half_first, scale):
    rng = np.random.default_rng(0)
    g = (rng.standard_normal(70_000) * 2000).astype(np.float32)
    g[[5, 40_000]] = [np.inf, np.nan]
    g[123] = 70_000.0          # overflows float16 only
    ref = g.copy()
    bad_ref, amax_ref = half.unscale_ref(ref, scale, half_first)
    bad, amax = half.unscale(g, scale, half_first)
    np.testing.assert_array_equal(g.view(np.uint32)[np.isfinite(ref)],
                                  ref.view(np.uint32)[np.isfinite(ref)])
    assert (bad, amax) == (bad_ref, amax_ref) and bad == 2 + half_first


# --- the scalers' rules -------------------------------------------------------------------

def test_backoff_halves_on_overflow_to_its_floor_and_doubles_after_a_clean_window():
    s = loss_scale.Backoff(init=2.0 ** 4, lo=2.0, hi=2.0 ** 5, window=3)
    scales = []
    for overflow in [1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0]:
        s.update(bool(overflow), 1.0)
        scales.append(s.scale)
    # 16 -> 8 -> 4 -> 2 -> 2 (floor); 3 clean steps -> 4, 3 more -> 8, -> 16, then 8 on an overflow
    assert scales == [8, 4, 2, 2, 2, 2, 4, 4, 4, 8, 8, 8, 16, 8, 8]
    assert s.skipped == 5 and s.in_a_row == 0


def test_backoff_uses_openseq2seqs_defaults_but_the_floor():
    """OpenSeq2Seq's floor of 1 is for a mean loss; hpcsgd's is summed over the minibatch's
    frames, so 2^-16 (a scale of 1 on the mean of 2^16 frames)."""
    from hpcsgd import config
    cfg = config.load(None, ["data.train=x", "train.loss_scale=backoff"])
    s = loss_scale.from_config(cfg)
    assert (s.scale, s.lo, s.hi, s.window, s.factor) == (2.0 ** 24, 2.0 ** -16, 2.0 ** 24, 2000,
                                                          2.0)


def test_logmax_follows_its_formula_on_a_scripted_sequence():
    """mu: bias-corrected EMA (0.99) of x = log2 max|g|; sigma from the slow EMAs (0.999) of x
    and x^2; S = 2^floor(16 - (mu + 3.09 sigma)) clipped; an overflow enters 16 - log2 S."""
    s = loss_scale.LogMax(lo=1.0, hi=2.0 ** 24)
    amaxes = [2.0 ** -3, 0.5, 3.0, 0.01, None, 1e-3, 0.0, 40.0]   # None: an overflow
    m1 = m2 = m3 = 0.0
    b1 = b2 = 1.0
    scale = 1.0
    for a in amaxes:
        overflow = a is None
        before = s.scale
        s.update(overflow, 0.0 if overflow else a)
        if not overflow and a == 0.0:       # no information: the scale stays
            assert s.scale == before
            continue
        x = 16.0 - math.log2(before) if overflow else math.log2(a)
        # the same operations in the same order (a scale sits on a floor() boundary)
        m1 = 0.99 * m1 + (1 - 0.99) * x
        m2 = 0.999 * m2 + (1 - 0.999) * x
        m3 = 0.999 * m3 + (1 - 0.999) * x * x
        b1, b2 = b1 * 0.99, b2 * 0.999
        mu = m1 / (1 - b1)
        slow, ex2 = m2 / (1 - b2), m3 / (1 - b2)
        sigma = math.sqrt(max(ex2 - slow * slow, 0.0))
        scale = min(max(2.0 ** math.floor(16 - (mu + 3.09 * sigma)), 1.0), 2.0 ** 24)
        assert s.scale == scale, (a, s.scale, scale)
    assert s.skipped == 1 and s.scale == scale


def test_logmax_state_round_trips_through_json():
    s = loss_scale.LogMax(lo=1.0, hi=2.0 ** 24)
    for a in (0.3, 0.7, 5.0):
        s.update(False, a)
    t = loss_scale.LogMax(lo=1.0, hi=2.0 ** 24)
    t.load_state_dict(json.loads(json.dumps(s.state_dict())))
    s.update(False, 0.2)
    t.update(False, 0.2)
    assert s.state_dict() == t.state_dict()


@pytest.mark.parametrize("key,value", [("train.loss_scale_min", "3"),
                                       ("train.loss_scale_max", "1000")])
def test_a_scale_bound_that_is_not_a_power_of_two_is_refused(key, value):
    from hpcsgd import config
    from hpcsgd.errors import UserError
    with pytest.raises(UserError, match=f"{key}.*power of two"):
        config.load(None, ["data.train=x", f"{key}={value}"])


# --- the step --------------------------------------------------------------------------------

def run_steps(step, steps=6, lr=0.05):
    batch = batches()
    return [step.run(batch, np.array([N - s]), 0, lr) for s in range(steps)]


@pytest.mark.parametrize("exchange", ["allreduce", "onebit"])
@pytest.mark.parametrize("scale", [2.0 ** 12, 2.0 ** -5])
def test_a_power_of_two_static_scale_in_float32_changes_no_bit(exchange, scale):
    _, p0, opt0, ex0, step0 = setup(exchange=exchange)
    _, p1, opt1, ex1, step1 = setup(exchange=exchange, scaler=loss_scale.Static(scale))
    np.testing.assert_array_equal(run_steps(step0), run_steps(step1))
    np.testing.assert_array_equal(p0.flat, p1.flat)
    np.testing.assert_array_equal(opt0.velocity, opt1.velocity)
    for k, v in ex0.state_dict().items():
        np.testing.assert_array_equal(v, ex1.state_dict()[k])
    assert step1.scaler.skipped == 0


def test_a_non_finite_gradient_without_a_scaler_is_still_an_error():
    model, params, opt, ex, step = setup(exchange="onebit")
    params.views["out.w"][0, 0] = np.inf
    with pytest.raises(Exception, match="(?i)non-finite|nan|inf"):
        run_steps(step, steps=1)


def test_the_float16_copy_is_refreshed_and_the_master_keeps_updates_below_its_ulp():
    """One step at a tiny rate moves the float32 master by less than a float16 ulp: the
    float16 copy the next forward uses is unchanged, the master is not; enough such steps
    move the copy too."""
    model, params, opt, ex, step = setup(precision="mixed", scaler=loss_scale.Static(2.0 ** 10))
    w16_before = np.empty_like(params.flat)
    half.round_half(params.flat, w16_before)
    master_before = params.flat.copy()
    run_steps(step, steps=1, lr=1e-6)
    moved = params.flat != master_before
    ulp = np.abs(np.spacing(master_before.astype(np.float16)).astype(np.float32))
    small = moved & (np.abs(params.flat - master_before) < ulp / 4)
    assert small.sum() > 10                   # updates far below float16's resolution ...
    now16 = np.empty_like(params.flat)
    half.round_half(params.flat, now16)
    run_steps(step, steps=1, lr=0.0)          # ... and the next forward's copy is made anew
    np.testing.assert_array_equal(model.w16.flat, now16)
    assert (now16[small] == w16_before[small]).mean() > 0.9   # invisible in float16
    for _ in range(3000 // 50):                # accumulated: visible
        run_steps(step, steps=1, lr=2e-3)
    half.round_half(params.flat, now16)
    assert (now16[small] != w16_before[small]).any()


def test_mixed_loss_gradient_is_rounded_once_after_scaling():
    """The scaled dLoss/dz is stored as float16 once: a loss gradient below float16's
    smallest subnormal survives a large scale (it would be flushed by rounding first)."""
    from hpcsgd.model.ops import CpuOps, HalfOps
    ops = HalfOps(CpuOps(4, 8, np.float32))
    z = np.full((1, 4), 1e-9, np.float32)     # 1e-9 < 2^-24: float16 would flush it
    ops.scale(z, 2.0 ** 20)
    np.testing.assert_array_equal(z, np.float32(np.float16(1e-9 * 2 ** 20)))
    assert z[0, 0] > 0


@pytest.mark.parametrize("double_buffering", [False, True])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank_untouched(tmp_path,
                                                                      double_buffering):
    proc = run_mpi(3, [os.path.join(REPO, "tests", "mpi", "overflow_skip.py"),
                       str(int(double_buffering))], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("skip ok") == 3, proc.stdout


# --- the striped float16 codec with the loss scale ------------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_float16_codec_sends_v_times_the_scale_saturated_and_keeps_the_rest(backend):
    """float16(v * S) saturated to +-65504, decoded / S, residual v - decoded: the decoded
    value plus the residual is v exactly (S a power of two); gradients below float16's range
    survive a scale that lifts them (unscaled they flush to zero); what saturation cuts off
    stays in the residual; the reference and the kernel give the same bits."""
    from hpcsgd.codecs import make_codec
    rng = np.random.default_rng(3)
    g = (rng.standard_normal((40, 25)) * 1e-7).astype(np.float32)   # ~float16's subnormals
    g[0, :4] = [1.0, -3.0, 2e-3, 0.0]                               # beyond 65504 / S
    got = {}
    for scale in (1.0, 2.0 ** 20):
        codec = make_codec("float16", backend, scale=scale)
        r = np.zeros_like(g)
        packed = np.zeros(codec.packed_nbytes(*g.shape), np.uint8)
        if scale == 1.0:
            g1 = g.copy()
            g1[0, :2] = 0.0      # unscaled, 1.0 and 3.0 fit and 1e-7 flushes
            codec.encode(g1, r, packed)
        else:
            codec.encode(g, r, packed)
        dec = np.zeros_like(g)
        codec.decode(packed, dec)
        got[scale] = dec, r, packed
    dec, r, packed = got[2.0 ** 20]
    np.testing.assert_array_equal(dec + r, g)                        # exact, saturation included
    assert dec[0, 0] == np.float32(65504.0 / 2 ** 20) and r[0, 0] == 1.0 - dec[0, 0]
    assert dec[0, 1] == -np.float32(65504.0 / 2 ** 20)
    small = np.abs(g) < 2.9e-8           # below half float16's smallest subnormal: flushed
    assert (got[1.0][0][small] == 0).all() and (dec[small & (g != 0)] != 0).all()
    ref = make_codec("float16", "reference", scale=2.0 ** 20)
    r2, p2 = np.zeros_like(g), np.zeros_like(packed)
    ref.encode(g, r2, p2)
    np.testing.assert_array_equal(p2, packed)
    np.testing.assert_array_equal(r2, r)


def test_the_float16_codec_refuses_a_scale_not_a_power_of_two_and_names_a_nan():
    from hpcsgd.codecs import make_codec
    g = np.ones((3, 4), np.float32)
    packed = np.zeros(make_codec("float16", "cpu").packed_nbytes(3, 4), np.uint8)
    with pytest.raises(ValueError, match="power of two"):
        make_codec("float16", "cpu", scale=3.0).encode(g, np.zeros_like(g), packed)
    g[2, 1] = np.nan
    with pytest.raises(ValueError, match="column 2"):
        make_codec("float16", "cpu", scale=2.0 ** 10).encode(g, np.zeros_like(g), packed)


def test_the_striped_exchange_gives_the_float16_codec_the_loss_scale():
    _, _, _, ex, step = setup(exchange="float16", precision="mixed",
                              scaler=loss_scale.Static(2.0 ** 12))
    run_steps(step, steps=2)
    assert ex.codec.scale == 2.0 ** 12 and np.isfinite(ex.residual1).all()
    assert step.scaler.skipped == 0


# --- mixed runs under the CLI --------------------------------------------------------------------

MIXED = ("train.precision=mixed", "train.loss_scale=backoff", "train.loss_scale_window=20",
         "optim.momentum_tc=500")


def test_a_mixed_run_learns_logs_its_skips_and_resumes_bit_exactly(synth, tmp_path):
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    hpcsgd(*train_args(synth, full, *MIXED))
    total = json.load(open(os.path.join(synth, "index.json")))["total_frames"]
    hpcsgd(*train_args(synth, cut, *MIXED, f"train.stop_after_frames={total * 3 // 2}"))
    stopped, meta = final_params(cut)
    assert meta["loss_scaler"]["name"] == "backoff" and meta["loss_scaler"]["skipped"] > 0
    hpcsgd(*train_args(synth, cut, *MIXED))
    (a, ma), (b, mb) = final_params(full), final_params(cut)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    assert ma["loss_scaler"] == mb["loss_scaler"]
    # from 2^24 the scale halves on each overflow: logged, in the metrics, every step skipped
    records = [json.loads(line) for line in open(os.path.join(full, "metrics.jsonl"))]
    skips = [r for r in records if r.get("kind") == "skip"]
    assert len(skips) == ma["loss_scaler"]["skipped"] >= 8
    assert skips[0]["scale"] == 2.0 ** 24 and skips[0]["new_scale"] == 2.0 ** 23
    assert "skipped on every rank" in open(os.path.join(full, "logs", "rank0000.log")).read()
    epochs = [r for r in records if r.get("kind") == "epoch"]
    assert epochs[-1]["train_ce"] < epochs[0]["train_ce"]   # it learns (so762: docs/results.md)
    assert "loss_scale.png" in hpcsgd("plot", full).stdout
    assert os.path.getsize(os.path.join(full, "plots", "loss_scale.png")) > 1000


def test_a_mixed_run_with_the_scaled_float16_codec_resumes_mid_exchange_bit_exactly(synth,
                                                                                   tmp_path):
    """The striped float16 codec sends g * S; cut with an exchange in flight (double
    buffering), the resumed run decodes it with the scale it was sent with (checkpointed)."""
    extra = (*MIXED, "exchange.aggregation=striped", "exchange.codec=float16",
             "exchange.double_buffering=true")
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    hpcsgd(*train_args(synth, full, *extra))
    total = json.load(open(os.path.join(synth, "index.json")))["total_frames"]
    hpcsgd(*train_args(synth, cut, *extra, f"train.stop_after_frames={total * 3 // 2}"))
    arrays, meta = final_params(cut)
    assert meta["pending"] and any(k.endswith("exchange_pending_scale") for k in arrays)
    hpcsgd(*train_args(synth, cut, *extra))
    (a, _), (b, _) = final_params(full), final_params(cut)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)


# --- the float16 allreduce ------------------------------------------------------------------------

def test_the_float16_allreduce_kernels_equal_numpy():
    rng = np.random.default_rng(7)
    g = every_half_and_tie()
    g = g[np.isfinite(g)]
    bits = np.empty(g.size, np.uint16)
    with np.errstate(over="ignore"):
        want = (g * np.float32(0.5)).astype(np.float16)
    bad = half.to_half_cpu(g, np.float32(0.5), bits)
    np.testing.assert_array_equal(bits, want.view(np.uint16))
    assert bad == int((~np.isfinite(want)).sum())
    with np.errstate(over="ignore"):   # some beyond the range: Inf parts, Inf sums
        parts = (rng.standard_normal((3, 50_001)) * 3e4).astype(np.float16).view(np.uint16)
    out = np.empty(50_001, np.uint16)
    bad = half.sum_halves_cpu(parts, np.float32(1 / 3), out)
    ref = half.sum_halves_ref(parts, np.float32(1 / 3))
    np.testing.assert_array_equal(out, ref.view(np.uint16))
    assert bad == int((~np.isfinite(ref)).sum())
    back = np.empty(out.size, np.float32)
    half.from_half_cpu(out, np.float32(3.0), back)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(back[finite], ref[finite].astype(np.float32) * np.float32(3))


@pytest.mark.parametrize("ranks,size,scale,blocking", [(1, 1000, 0, 1), (2, 100_003, 0, 0),
                                                       (3, 100_003, 256, 0), (4, 7, 0, 1),
                                                       (3, 2, 16, 1)])
def test_the_float16_allreduce_is_its_definition_bit_for_bit(ranks, size, scale, blocking):
    proc = run_mpi(ranks, [os.path.join(REPO, "tests", "mpi", "half_allreduce.py"), str(size),
                           str(scale), str(blocking)], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("half ok") == ranks
