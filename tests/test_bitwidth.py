"""The adaptive bit width (hpcsgd/bitwidth.py): MQGrad's smoothing, slope, reward, SARSA update
and policy against hand computations; the Oland & Raj reconstruction on scripted norms; the
striped exchange switching widths; and under a real mpiexec, ranks that agree on the width at
every step and a run resumed across a width change that ends bit-identical."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from conftest import run_train
from hpcsgd import bitwidth as bw
from hpcsgd.codecs import make_codec
from hpcsgd.comm.exchange import Striped
from hpcsgd.model.flat import FlatParams, ParamSpec
from hpcsgd.optim import Optimizer
from hpcsgd.step import Phases, exchange_update
from test_train import final_params, synth, train_args  # noqa: F401 (a fixture)


def test_slope_is_the_least_squares_slope():
    assert bw.slope([3.0, 2.8, 2.6, 2.4, 2.2]) == pytest.approx(-0.2, rel=1e-12)
    y = np.array([1.0, 4.0, 2.0, 5.0, 3.5, 0.5])
    assert bw.slope(y) == pytest.approx(np.polyfit(np.arange(6), y, 1)[0], rel=1e-12)
    assert bw.slope([2.0, 2.0, 2.0]) == 0.0


def test_smoothing_carries_across_decisions_as_eq_1():
    first = bw.smooth(None, [4.0, 2.0], 0.25)          # starts from the first loss
    assert first.tolist() == [4.0, 0.25 * 2.0 + 0.75 * 4.0]
    second = bw.smooth(first[-1], [1.0], 0.25)
    assert second.tolist() == [0.25 * 1.0 + 0.75 * 3.5]


def test_reward_is_minus_slope_times_scale_over_time():
    assert bw.reward([3.0, 2.5, 2.0], 20.0, 300.0) == pytest.approx(0.5 * 300 / 20)
    assert bw.model_seconds(4) == 25.0


def test_sarsa_update_equals_a_hand_computation():
    q = {"W1": np.array([[1.0, -1.0], [0.5, 0.5], [-2.0, 0.0]]), "b1": np.array([0.0, 0.1, 0.0]),
         "W2": np.arange(21, dtype=np.float64).reshape(7, 3) / 10, "b2": np.full(7, 0.2)}
    s = np.array([2.0, 1.0])
    # by hand: pre = [1, 1.6, -4], h = [1, 1.6, 0]; Q[3] = 0.9*1 + 1.0*1.6 + 1.1*0 + 0.2 = 2.7
    assert bw.q_forward(q, s)[0][3] == pytest.approx(2.7)
    before = {k: v.copy() for k, v in q.items()}
    td = bw.sarsa_update(q, s, out=3, r=1.0, q_next=2.0, lr=0.1, discount=0.9)
    assert td == pytest.approx(1.0 + 0.9 * 2.0 - 2.7)     # 0.1
    step = 0.1 * td
    want_W2 = before["W2"].copy()
    want_W2[3] += step * np.array([1.0, 1.6, 0.0])          # dQ3/dW2[3] = h
    want_b2 = before["b2"].copy()
    want_b2[3] += step
    dh = before["W2"][3] * np.array([1.0, 1.0, 0.0])        # ReLU passes units 0 and 1
    np.testing.assert_allclose(q["W2"], want_W2, rtol=1e-15)
    np.testing.assert_allclose(q["b2"], want_b2, rtol=1e-15)
    np.testing.assert_allclose(q["W1"], before["W1"] + step * np.outer(dh, s), rtol=1e-15)
    np.testing.assert_allclose(q["b1"], before["b1"] + step * dh, rtol=1e-15)


def test_the_epsilon_greedy_policy_on_a_scripted_q():
    qv = np.array([0.0, 1.0, 0.5, 0.7, 0.0, 0.0, 0.0])   # widths 2..8
    assert bw.choose(qv, 2, 0.1, u=0.5) == 1      # Q[3] > Q[2]: increase
    assert bw.choose(qv, 2, 0.1, u=0.05) == 0     # u < epsilon: the other choice
    assert bw.choose(qv, 3, 0.1, u=0.5) == 0      # Q[4] < Q[3]: keep
    assert bw.choose(qv, 3, 0.1, u=0.09) == 1
    assert bw.choose(qv, 8, 1.0, u=0.0) == 0      # never past 8 bits


def mqgrad(**kw):
    args = dict(start=2, every=5, alpha=0.1, epsilon=0.3, lr=0.05, discount=0.9, hidden=10,
                scale=300.0, seed=7)
    args.update(kw)
    return bw.MQGrad(**args)


def test_mqgrad_bits_only_grow_and_stay_in_2_to_8():
    c, rng, seen = mqgrad(epsilon=0.5), np.random.default_rng(0), []
    for t in range(200):
        losses = 3.0 * np.exp(-0.01 * (5 * t + np.arange(5))) + rng.normal(0, 0.01, 5)
        seen.append(c.decide(losses, None, bw.model_seconds(c.bits)))
    assert np.all(np.diff(seen) >= 0) and np.all(np.diff(seen) <= 1)
    assert seen[0] in (2, 3) and seen[-1] == 8 and min(seen) >= 2


def test_mqgrad_state_resumes_through_json_to_the_same_choices():
    a, losses = mqgrad(), [np.linspace(3, 2.9, 5) - 0.1 * t for t in range(30)]
    for x in losses[:10]:
        a.decide(x, None, 12.0)
    b = mqgrad(seed=99)   # another seed: everything must come from the state
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert [a.decide(x, None, 12.0) for x in losses[10:]] == \
           [b.decide(x, None, 12.0) for x in losses[10:]]
    np.testing.assert_array_equal(a.q["W1"], b.q["W1"])


def test_oland_raj_reconstruction_on_scripted_norms():
    c = bw.OlandRaj(start=4)
    assert c.decide(None, [1.0, 1.0], None) == 4      # the first norm is the reference
    assert c.decide(None, [2.0, 2.0], None) == 5      # twice the norm: one bit more
    assert c.decide(None, [2.5], None) == 6           # ceil(log2 2.5) = 2
    assert c.decide(None, [0.3], None) == 3           # ceil(log2 0.3) = -1
    assert c.decide(None, [0.05], None) == 2          # 4 - 4 = 0, clipped to 2
    assert c.decide(None, [1000.0], None) == 8        # 4 + 10, clipped to 8


# --- the striped exchange switching widths ----------------------------------------------------

LAYOUT = [("W0", (5, 70)), ("b0", (1, 70)), ("W1", (70, 9)), ("b1", (1, 9))]


class RankOf:
    """Rank r of K for the exchange's byte layout, which needs only these two numbers."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size


@pytest.mark.parametrize("K", [1, 3])
def test_bytes_per_step_are_the_packed_size_at_the_chosen_width(K):
    from hpcsgd.comm.stripes import stripe_ranges
    mats = FlatParams(LAYOUT).matrices
    for r in range(K):
        ex = Striped(RankOf(r, K), mats, make_codec("kbit", bits=2),
                     widest=make_codec("kbit", bits=8))
        allocated = ex.send_buf.size, ex.recv_buf.size
        for bits in (2, 5, 8, 3):   # down again: the layout follows
            codec = make_codec("kbit", bits=bits)
            ex.set_codec(codec)
            want = [sum(codec.packed_nbytes((hi - lo) // m.n_rows, m.n_rows)
                        for m, (lo, hi) in zip(mats, stripe_ranges(mats, j, K)) if hi > lo)
                    for j in range(K)]
            assert ex.counts.tolist() == want
            others = sum(want) - want[r]
            assert ex.bytes_on_wire() == others + (K - 1) * want[r]
            assert (ex.send_buf.size, ex.recv_buf.size) == allocated   # sized once, for 8 bits
        assert allocated == (sum(want_8 := [sum(make_codec("kbit", bits=8).packed_nbytes(
            (hi - lo) // m.n_rows, m.n_rows) for m, (lo, hi) in zip(mats, stripe_ranges(mats, j, K))
            if hi > lo) for j in range(K)]), K * want_8[r])


def test_a_switched_exchange_gives_the_bits_of_one_built_at_that_width():
    """Steps at widths 2, 2, 6, 6, 3 through one exchange (set_codec between steps) equal,
    step by step, an exchange built at each step's width and given the same residuals."""
    mats = FlatParams(LAYOUT).matrices
    size = sum(m.size for m in mats)
    rng = np.random.default_rng(3)
    switched = Striped(MPI.COMM_SELF, mats, make_codec("kbit", bits=2),
                       widest=make_codec("kbit", bits=8))
    p1, p2 = rng.standard_normal(size).astype(np.float32), None
    p2 = p1.copy()
    opt1, opt2 = Optimizer(size, post_size=switched.state_size), Optimizer(size)
    for t, bits in enumerate([2, 2, 6, 6, 3]):
        grad = rng.standard_normal(size).astype(np.float32)
        switched.set_codec(make_codec("kbit", bits=bits))
        fresh = Striped(MPI.COMM_SELF, mats, make_codec("kbit", bits=bits))
        fresh.load_state_dict({k: v.copy() for k, v in switched.state_dict().items()})
        opt2 = Optimizer(size, post_size=fresh.state_size)
        for ex, opt, p in ((switched, opt1, p1), (fresh, opt2, p2)):
            opt.begin_step(64, 64)
            exchange_update(ex, opt, p, grad.copy(), 0.01, Phases())
        np.testing.assert_array_equal(p1, p2, err_msg=f"step {t}, {bits} bits")
        for name in ("residual1", "residual2"):
            np.testing.assert_array_equal(switched.state_dict()[name], fresh.state_dict()[name])
    assert np.abs(switched.residual1).max() > 0   # the residuals carried something


# --- under a real mpiexec ---------------------------------------------------------------------

def bits_lines(run_dir, rank):
    text = open(os.path.join(run_dir, "logs", f"rank{rank:04d}.log")).read()
    return [line.split("] ", 1)[1] for line in text.splitlines() if "bit width " in line
            and " -> " in line]


@pytest.mark.parametrize("rule, db", [("mqgrad", False), ("oland_raj", False), ("mqgrad", True)])
def test_ranks_agree_on_the_width_and_resume_bit_exactly_across_a_change(synth, tmp_path, rule,
                                                                         db):
    """K = 2: the replicas' CRC agrees after every step (a rank at another width would send
    another byte count: the exchange could not even complete), both ranks log the same
    changes, and a run stopped mid-period (between two decisions) and resumed ends with the
    weights, widths and controller state of the uninterrupted run; with double buffering too
    (a change completes the exchange in flight first; the checkpoint holds one in flight).
    `hpcsgd plot` draws the widths."""
    extra = [f"exchange.double_buffering={str(db).lower()}",
             "exchange.aggregation=striped", "exchange.codec=kbit", f"exchange.bits={rule}",
             "exchange.bits_every_steps=3", "exchange.bits_time=model",
             "exchange.mqgrad_epsilon=0.5", "exchange.bits_start=4" if rule == "oland_raj"
             else "exchange.bits_start=2", "train.check_every_steps=1"]
    full, cut = str(tmp_path / "full"), str(tmp_path / "cut")
    proc = run_train(2, train_args(synth, full, *extra)[1:], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    changes = bits_lines(full, 0)
    assert changes and changes == bits_lines(full, 1)
    assert len(changes) >= 2
    # stop one step after a decision that changed the width, with a change still to come
    frame = int(changes[len(changes) // 2 - 1].split("frame ")[1].split(" ")[0].replace(",", ""))
    proc = run_train(2, train_args(synth, cut, *extra, f"train.stop_after_frames={frame + 1}")[1:],
                     timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stopped, meta = final_params(cut)
    assert meta["bitwidth"]["bits"] in range(2, 9)
    assert any(len(stopped[f"rank{r:04d}/bitwidth/rows"]) for r in range(2))  # mid-period
    before = bits_lines(cut, 0)
    assert before and before == changes[:len(before)] and len(before) < len(changes)
    proc = run_train(2, train_args(synth, cut, *extra)[1:], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    a, meta_a = final_params(full)
    b, meta_b = final_params(cut)
    np.testing.assert_array_equal(a["params"], b["params"])
    assert meta_a["bitwidth"] == meta_b["bitwidth"]
    assert bits_lines(cut, 0) == changes and bits_lines(cut, 1) == changes
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "plot", full], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and os.path.getsize(
        os.path.join(full, "plots", "learning_curves.png")) > 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("overrides", [["exchange.aggregation=allreduce"],
                                       ["exchange.aggregation=striped", "exchange.codec=onebit"]])
def test_a_rule_without_the_striped_kbit_exchange_is_refused(overrides):
    from hpcsgd import config
    from hpcsgd.comm.exchange import adaptive_bits
    from hpcsgd.errors import UserError
    cfg = config.load(None, ["data.train=x", "exchange.bits=mqgrad", *overrides])
    with pytest.raises(UserError, match="exchange.bits: mqgrad .* exchange.codec=kbit"):
        adaptive_bits(cfg)


def test_a_resume_at_another_k_keeps_the_width_and_restarts_the_period(synth, tmp_path):
    """2 ranks stopped between two decisions, resumed by 3: the width and the controller come
    back, the steps since the last decision (other ranks' numbers) restart, and it trains on."""
    extra = ["exchange.aggregation=striped", "exchange.codec=kbit", "exchange.bits=mqgrad",
             "exchange.bits_every_steps=3", "exchange.bits_time=model",
             "exchange.mqgrad_epsilon=0.5", "train.epochs=1"]
    run = str(tmp_path / "run")
    proc = run_train(2, train_args(synth, run, *extra, "train.stop_after_frames=700")[1:],
                     timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stopped_bits = final_params(run)[1]["bitwidth"]["bits"]
    proc = run_train(3, train_args(synth, run, *extra)[1:], timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = open(os.path.join(run, "logs", "rank0000.log")).read()
    assert "since the last decision restart at 3 ranks" in log
    resumed = log.split("resumed from")[1]
    first = [line for line in resumed.splitlines() if "bit width " in line and " -> " in line]
    assert not first or first[0].split("bit width ")[1].startswith(f"{stopped_bits} -> ")
    assert final_params(run)[1]["bitwidth"]["bits"] >= stopped_bits
