"""The gradient exchange's bit width chosen at run time (exchange.bits = oland_raj | mqgrad),
every exchange.bits_every_steps = T steps, identically on every rank.

Both rules read only what every rank agrees on. Each rank records, per step, its cross-entropy
sum and frames, the squared norm of its stripe of the summed gradient (the owner's decoded sum
before the optimizer: sum over owners = the global gradient's squared norm) and its step
seconds; at a decision one Allreduce of those T rows gives every rank the same global numbers,
and the controller, seeded and deterministic given them, gives every rank the same width.

MQGrad (Cui et al. 2018; `../shared/seeds/002_*`; details the paper lost taken from the
authors' public code, as facts): a decision every T steps (paper 5). The state is the
current width n and the last T smoothed global losses (Eq. 1: exponential smoothing carried
across decisions, alpha: paper 0.01, code 0.1 -- our default, since a decision every 5 steps
at 0.01 barely moves). Actions: keep, or +1 bit (never fewer), within 2..8. Q is an MLP:
T smoothed losses -> H ReLU units (paper 10) -> 7 outputs, Q(s, a) = output[n + a - 2].
Semi-gradient SARSA (Alg. 2): v += lr [r + gamma Q(s', a') - Q(s, a)] dQ(s, a)/dv, gamma 0.9
and lr 0.05 (the code's). Policy: increase when Q[n+1] > Q[n], else keep; with probability
epsilon (0.1) the other choice. Reward for the T steps just run at width b:
-(least-squares slope of the T smoothed losses) x 300 / time(b). time(b): `step` = the mean
measured step seconds over the T steps at that width (every rank's, averaged; like the code's
model, compute plus communication), `exchange` = the measured seconds of the exchange's phases
alone per step, or `model` = the authors' code's 5 + 5b (deterministic: a rerun makes the same
choices).

Oland & Raj (2015): "more bits for a larger gradient norm". Not in our seeds and with no
public code, so this is a RECONSTRUCTION of the documented reading, labelled as such:
b = clip(b0 + ceil(log2(|g| / |g_ref|)), 2, 8), |g| the mean global gradient norm over the
last T steps, |g_ref| that of the first T steps, b0 = exchange.bits_start. It may go down.
"""
import math
import time

import numpy as np

MIN_BITS, MAX_BITS = 2, 8
RULES = ("oland_raj", "mqgrad")


# ---------------------------------------------------------------- MQGrad, plain functions
def smooth(previous, losses, alpha):
    """Eq. 1: the smoothed sequence of `losses`, carried on from `previous` (the last smoothed
    value; None: start from the first loss)."""
    out = np.empty(len(losses))
    s = losses[0] if previous is None else previous
    for i, loss in enumerate(losses):
        s = alpha * loss + (1 - alpha) * s
        out[i] = s
    return out


def slope(values):
    """Least-squares slope of values against 0, 1, ..., T-1."""
    y = np.asarray(values, np.float64)
    x = np.arange(y.size, dtype=np.float64) - (y.size - 1) / 2
    return float((x * (y - y.mean())).sum() / max((x * x).sum(), 1e-300))


def reward(smoothed, seconds, scale):
    """-(slope of the smoothed losses) x scale / seconds per step."""
    return -slope(smoothed) * scale / seconds


def model_seconds(bits):
    """The authors' code's time per iteration at a width: 5 + 5b (relative units)."""
    return 5.0 + 5.0 * bits


def init_q(rng, inputs, hidden):
    """Q's weights: He-scaled normal first layer, small normal output layer, zero biases."""
    return {"W1": rng.standard_normal((hidden, inputs)) * math.sqrt(2.0 / inputs),
            "b1": np.zeros(hidden),
            "W2": rng.standard_normal((MAX_BITS - MIN_BITS + 1, hidden)) * 0.1,
            "b2": np.zeros(MAX_BITS - MIN_BITS + 1)}


def q_forward(q, s):
    """(Q values, one per width 2..8; the hidden activations) of input s."""
    h = np.maximum(q["W1"] @ s + q["b1"], 0.0)
    return q["W2"] @ h + q["b2"], h


def q_gradient(q, s, out):
    """d Q[out] / d weights at input s (the gradient of one output)."""
    pre = q["W1"] @ s + q["b1"]
    h = np.maximum(pre, 0.0)
    dh = q["W2"][out] * (pre > 0)
    g = {k: np.zeros_like(v) for k, v in q.items()}
    g["W2"][out] = h
    g["b2"][out] = 1.0
    g["W1"] = np.outer(dh, s)
    g["b1"] = dh
    return g


def sarsa_update(q, s, out, r, q_next, lr, discount):
    """Semi-gradient SARSA: q += lr [r + discount q_next - Q(s)[out]] dQ(s)[out]/dq, in
    place; returns the TD error."""
    td = r + discount * q_next - q_forward(q, s)[0][out]
    for k, g in q_gradient(q, s, out).items():
        q[k] += lr * td * g
    return td


def choose(qvalues, bits, epsilon, u):
    """The action (0 keep, 1 one more bit) at width `bits`: greedy increase when
    Q[bits+1] > Q[bits], and the other choice when u < epsilon (u uniform in [0, 1)).
    Never past MAX_BITS."""
    if bits >= MAX_BITS:
        return 0
    greedy = int(qvalues[bits + 1 - MIN_BITS] > qvalues[bits - MIN_BITS])
    return 1 - greedy if u < epsilon else greedy


# ---------------------------------------------------------------- the controllers
class MQGrad:
    def __init__(self, start, every, alpha, epsilon, lr, discount, hidden, scale, seed):
        self.every, self.alpha, self.epsilon, self.lr = every, alpha, epsilon, lr
        self.discount, self.scale = discount, scale
        self.rng = np.random.default_rng([seed, 0x4D51])   # its own stream, from the seed
        self.q = init_q(self.rng, every, hidden)
        self.bits = start
        self.last_smoothed = None   # the smoothed loss carried across decisions (Eq. 1)
        self.prev = None            # (state input, output index) of the last action taken

    def decide(self, losses, norms, seconds):
        """The width for the next T steps, from the last T global losses and the mean seconds
        per step they took at the current width."""
        s = smooth(self.last_smoothed, losses, self.alpha)
        self.last_smoothed = float(s[-1])
        qvalues = q_forward(self.q, s)[0]
        action = choose(qvalues, self.bits, self.epsilon, self.rng.random())
        out = self.bits + action - MIN_BITS
        if self.prev is not None:   # the reward of the T steps just run, for the last action
            r = reward(s, seconds, self.scale)
            sarsa_update(self.q, self.prev[0], self.prev[1], r, qvalues[out], self.lr,
                         self.discount)
        self.prev = (s, out)
        self.bits += action
        return self.bits

    def state_dict(self):
        return {"bits": self.bits, "q": {k: v.tolist() for k, v in self.q.items()},
                "last_smoothed": self.last_smoothed,
                "prev": None if self.prev is None else [self.prev[0].tolist(), self.prev[1]],
                "rng": self.rng.bit_generator.state}

    def load_state_dict(self, d):
        self.bits, self.last_smoothed = d["bits"], d["last_smoothed"]
        self.q = {k: np.array(v, np.float64) for k, v in d["q"].items()}
        self.prev = None if d["prev"] is None else (np.array(d["prev"][0]), d["prev"][1])
        self.rng.bit_generator.state = d["rng"]


class OlandRaj:
    """The reconstruction described in the module docstring."""

    def __init__(self, start):
        self.start, self.bits, self.ref = start, start, None

    def decide(self, losses, norms, seconds):
        norm = float(np.mean(norms))
        if self.ref is None:
            self.ref = norm
        if norm > 0 and self.ref > 0:
            self.bits = int(min(max(self.start + math.ceil(math.log2(norm / self.ref)),
                                    MIN_BITS), MAX_BITS))
        return self.bits

    def state_dict(self):
        return {"bits": self.bits, "ref": self.ref}

    def load_state_dict(self, d):
        self.bits, self.ref = d["bits"], d["ref"]


def make_controller(cfg):
    rule, start = cfg["exchange.bits"], cfg["exchange.bits_start"]
    if rule == "mqgrad":
        return MQGrad(start, cfg["exchange.bits_every_steps"], cfg["exchange.mqgrad_alpha"],
                      cfg["exchange.mqgrad_epsilon"], cfg["exchange.mqgrad_lr"],
                      cfg["exchange.mqgrad_discount"], cfg["exchange.mqgrad_hidden"],
                      cfg["exchange.mqgrad_reward_scale"], cfg["train.seed"])
    return OlandRaj(start)


# ---------------------------------------------------------------- the decision in the loop
class BitWidth:
    """Per-step records and the decision every T steps (collective over the data ranks).

        bw = BitWidth(cfg, comm)
        bw.record(sums, norm_sq, step_s, exchange_s)   after every step (local numbers)
        if bw.due(): new = bw.decide()          every T steps: the same width on every rank
    """

    def __init__(self, cfg, comm):
        self.comm, self.every = comm, cfg["exchange.bits_every_steps"]
        self.time_rule = cfg["exchange.bits_time"]
        self.controller = make_controller(cfg)
        self.rows = np.zeros((self.every, 4))   # per step: CE sum, frames, norm^2, seconds
        self.filled = 0
        self.total = np.zeros_like(self.rows)
        self.seconds = 0.0   # spent deciding (for the < 1% of a step claim)

    @property
    def bits(self):
        return self.controller.bits

    def record(self, sums, norm_sq, step_seconds, exchange_seconds):
        seconds = exchange_seconds if self.time_rule == "exchange" else step_seconds
        self.rows[self.filled] = sums[0], sums[2], norm_sq, seconds
        self.filled += 1

    def due(self):
        return self.filled == self.every

    def decide(self):
        """One Allreduce of the T rows, then the controller: returns the new width."""
        t0 = time.perf_counter()
        if self.comm.Get_size() > 1:
            from mpi4py import MPI
            self.comm.Allreduce(self.rows, self.total, op=MPI.SUM)   # cross-rank sync point
        else:
            self.total[:] = self.rows
        ce, frames, norm_sq, seconds = self.total.T
        losses = ce / np.maximum(frames, 1)
        step_seconds = (float(seconds.mean()) / self.comm.Get_size()
                        if self.time_rule != "model" else model_seconds(self.bits))
        bits = self.controller.decide(losses, np.sqrt(norm_sq) / np.maximum(frames, 1),
                                      step_seconds)
        self.filled = 0
        self.seconds += time.perf_counter() - t0
        return bits

    def state_dict(self):
        return {"controller": self.controller.state_dict(),
                "rows": self.rows[:self.filled].tolist()}

    def load_state_dict(self, d):
        self.controller.load_state_dict(d["controller"])
        self.filled = len(d["rows"])
        if self.filled:
            self.rows[:self.filled] = np.array(d["rows"])
