"""Loss scaling (OpenSeq2Seq, Kuchaiev et al. 2018; Micikevicius et al. 2017): the loss gradient
is multiplied by a scale S at the top layer so that small gradients survive float16, and every
gradient is divided by S in float32 (hpcsgd/half.py: unscale) before anything else reads it.
Config `train.loss_scale`: none | static | backoff | logmax (docs/precision.md).

Each scaler sees, after every step, whether any rank's gradient overflowed and the global
max |gradient| after unscaling (one small Allreduce: hpcsgd/step.py), and sets the scale of
the next step. A step that overflowed is skipped on every rank (every scaler). Scales are
powers of two, so scaling and unscaling are exact in float32 (no rounding, no bit changed:
tested), until a value leaves the float32 range.

  static   S fixed (train.loss_scale_init); an overflowing step is skipped, S unchanged.
  backoff  OpenSeq2Seq's BackoffScaler: start at train.loss_scale_init (2^24), halve on an
           overflow (not below train.loss_scale_min), double after train.loss_scale_window
           (2000) steps without one (not above train.loss_scale_max).
  logmax   OpenSeq2Seq's LogMaxScaler: x = log2 of the unscaled max |gradient|; bias-corrected
           moving averages mu (beta1 0.99) of x and, slow (beta2 0.999), of x and x^2 give
           sigma; S = 2^(log_max - (mu + 3.09 sigma)) clipped to [min, max] (log_max 16: the
           max sits 3.09 sigma below float16's 2^16). Where we differ from their code
           (automatic_loss_scaler.py), each a choice stated in docs/precision.md:
           * an overflow enters x = log_max - log2(S), the smallest log2 max |g| that overflows
             at scale S; their code enters 2^log_max = 65536 as if it were a log2, which pins
             S at its minimum for thousands of steps after a single overflow;
           * the exponent is rounded down to an integer (S a power of two: exact scaling);
             theirs is any real power of 2, so scaling rounds;
           * their cutoff hard-codes 16 where it means log_max; we use log_max.
           * a step whose gradient is all zero (max 0: log2 undefined) leaves the averages.
"""
import math

SCALERS = ("none", "static", "backoff", "logmax")


def _pow2_clip(log2_scale, lo, hi):
    """2^floor(log2_scale) clipped to [lo, hi] (both powers of two by validation)."""
    if not math.isfinite(log2_scale):
        return hi if log2_scale > 0 else lo
    return min(max(2.0 ** math.floor(min(max(log2_scale, -1000.0), 1000.0)), lo), hi)


class Static:
    name = "static"

    def __init__(self, init, **_):
        self.scale = float(init)
        self.steps, self.skipped, self.in_a_row = 0, 0, 0   # in_a_row: skips since a step

    def update(self, overflow, amax):
        self.steps += 1
        self.skipped += bool(overflow)
        self.in_a_row = self.in_a_row + 1 if overflow else 0

    def state_dict(self):
        return {"name": self.name, "scale": self.scale, "steps": self.steps,
                "skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, d):
        self.scale, self.steps = float(d["scale"]), int(d["steps"])
        self.skipped, self.in_a_row = int(d["skipped"]), int(d["in_a_row"])


class Backoff(Static):
    name = "backoff"

    def __init__(self, init, lo, hi, window, factor=2.0, **_):
        super().__init__(init)
        self.lo, self.hi, self.window, self.factor = float(lo), float(hi), int(window), factor
        self.last_overflow = -1   # the step of the last overflow (OpenSeq2Seq: -1 at start)

    def update(self, overflow, amax):
        step = self.steps
        super().update(overflow, amax)
        if overflow:
            self.scale = min(max(self.scale / self.factor, self.lo), self.hi)
            self.last_overflow = step
        elif (step - self.last_overflow) % self.window == 0:
            self.scale = min(max(self.scale * self.factor, self.lo), self.hi)

    def state_dict(self):
        return {**super().state_dict(), "last_overflow": self.last_overflow}

    def load_state_dict(self, d):
        super().load_state_dict(d)
        self.last_overflow = int(d["last_overflow"])


class LogMax(Static):
    name = "logmax"

    def __init__(self, lo, hi, log_max=16.0, beta1=0.99, beta2=0.999, sigmas=3.09, **_):
        super().__init__(1.0)   # OpenSeq2Seq starts at 1
        self.lo, self.hi, self.log_max = float(lo), float(hi), float(log_max)
        self.beta1, self.beta2, self.sigmas = beta1, beta2, sigmas
        self.x_hat = self.slow_x_hat = self.x2_hat = 0.0
        self.b1 = self.b2 = 1.0   # beta1^t, beta2^t (the bias corrections)

    def update(self, overflow, amax):
        scale = self.scale
        super().update(overflow, amax)
        if overflow:
            x = self.log_max - math.log2(scale)
        elif amax > 0:
            x = math.log2(amax)
        else:
            return
        self.x_hat = self.beta1 * self.x_hat + (1 - self.beta1) * x
        self.slow_x_hat = self.beta2 * self.slow_x_hat + (1 - self.beta2) * x
        self.x2_hat = self.beta2 * self.x2_hat + (1 - self.beta2) * x * x
        self.b1, self.b2 = self.b1 * self.beta1, self.b2 * self.beta2
        mu = self.x_hat / (1 - self.b1)
        slow_mu, e_x2 = self.slow_x_hat / (1 - self.b2), self.x2_hat / (1 - self.b2)
        sigma = math.sqrt(max(e_x2 - slow_mu * slow_mu, 0.0))
        self.scale = _pow2_clip(self.log_max - (mu + self.sigmas * sigma), self.lo, self.hi)

    def state_dict(self):
        return {**super().state_dict(), "x_hat": self.x_hat, "slow_x_hat": self.slow_x_hat,
                "x2_hat": self.x2_hat, "b1": self.b1, "b2": self.b2}

    def load_state_dict(self, d):
        super().load_state_dict(d)
        for k in ("x_hat", "slow_x_hat", "x2_hat", "b1", "b2"):
            setattr(self, k, float(d[k]))


def from_config(cfg):
    """The run's scaler, or None (train.loss_scale = none: a non-finite gradient stays fatal)."""
    kind = cfg["train.loss_scale"]
    if kind == "none":
        return None
    args = {"init": cfg["train.loss_scale_init"], "lo": cfg["train.loss_scale_min"],
            "hi": cfg["train.loss_scale_max"], "window": cfg["train.loss_scale_window"]}
    return {"static": Static, "backoff": Backoff, "logmax": LogMax}[kind](**args)
