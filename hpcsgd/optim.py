"""Optimizer: SGD with momentum, AdaGrad at the three points of Seide et al. 2014 (Table 3),
weight decay, and learning-rate schedules; element-wise Numba kernels over flat slices.

Conventions (CNTK's, which the paper uses):
- A gradient g is SUMMED over the n frames of the minibatch (n = all ranks' frames together
  after the exchange). The learning rate lr is PER SAMPLE: the step is lr * g, so doubling n
  doubles the step, as n per-sample SGD steps would.
- Momentum is a time constant T in samples (0 = off). Per minibatch of n frames the coefficient
  is m = exp(-n / T), and the smoothing has unit gain:
      v <- m * v + (1 - m) * g ;   W <- W - lr * v
  so a constant gradient moves W by lr * g per minibatch whatever T is. This equals the classic
  "v <- mu v + g; W <- W - eta v" with mu = m and eta = lr * (1 - m); T = -n / ln(mu), e.g.
  mu = 0.9 at n = 1024 is T = 9719 samples. Changing n keeps T, so the smoothing spans the same
  number of frames.
- AdaGrad divides the gradient by the RMS of its per-sample average over time ("normalize
  gradients by their standard deviation over time or recent samples", Sec. 4):
      s <- rho * s + c * (x / n)^2 ;  q <- rho * q + c  (q a scalar, the total weight)
      x <- x / (sqrt(s / q) + eps)
  with rho = exp(-n / T_a) and c = 1 - rho for a time constant T_a in samples ("recent
  samples"), or rho = 1 and c = n for T_a = inf (all history, weighted by frames). s / q is a
  mean square of per-sample gradients, so the normalised x keeps the scale of n (x ~ n *
  mean / rms) and lr stays per sample; eps (default 1e-8) is in per-sample gradient units and
  only guards 0 / 0 for parameters that never get a gradient. The first step has s / q =
  (x / n)^2, i.e. it moves every parameter by lr * n (sign SGD); q removes the start-up bias.
- Weight decay wd is per sample (L2, CNTK's L2RegWeight): g <- g + wd * n * W, on the
  aggregate gradient, before AdaGrad ("aggregate") and momentum.

AdaGrad placement (`adagrad=`):
  "local"          on each rank's raw local gradient before quantization/exchange (Table 3
                   "partial gradients"); n is the rank's own frame count, s is per rank.
  "aggregate"      on the summed gradient after the exchange, before momentum (Table 3's best).
  "after_momentum" on the momentum-smoothed gradient v (v itself stays unnormalised).
  "off"

Adam's second moment (`adam_variance=`):
  "owner"          Adam whole where the sum is (the owner of a stripe): m and v of the summed
                   gradient. Under a lossy codec v learns the decoded sum's squares, the
                   codec's error included (a 1-bit column: two values whatever each element's
                   own magnitude).
  "local"          v of each rank's own float32 gradient, before the codec, as AdaGrad
                   "local" (the same kernel: rho = beta2, c = 1 - beta2, per step):
                       v_k <- b2 v_k + (1 - b2) (g_k / n_k)^2 ;  g_k <- g_k / (sqrt(v_k / q) + eps)
                   then the owner keeps only m, of the normalised sum's per-sample mean:
                       m <- b1 m + (1 - b1) x / n ;  update = n m / (1 - b1^t)
                   The codec sees values of about one scale (what 1-bit's two values per column
                   suit) and v never sees its error. With one rank it is Adam with m taken after
                   the division (the same while v moves slowly); with K ranks v_k is the
                   variance of N/K frames' mean, up to K times the whole batch's.

A step, distributed (slices [lo:hi) are flat ranges; all updates are element-wise):
    opt.begin_step(n, n_local)            # every rank, once: per-step scalars
    opt.pre_exchange(grad)                # every rank, its whole local gradient ("local" only)
    ... exchange: the owner of a stripe gets the summed gradient agg[lo:hi) ...
    opt.post_exchange(agg, params, lo, hi)  # owner only, per stripe range: agg -> update
    ... gather the updates ...
    opt.apply(params, update, lr)         # every rank: W -= lr * update
Momentum and the AdaGrad state of the "aggregate"/"after_momentum" placements are then only
touched on the owner's stripe: with post_size = the owner's stripe length they are compact
(1/K of the model), and the owner passes its compact aggregate buffer to post_exchange
(hpcsgd/comm/exchange.py does). The "local" AdaGrad state stays full-size (every rank
normalises its whole local gradient).
Single process: opt.step(params, grad, lr, n) does all of it in one fused pass.

GPU ranks (device="cuda"): the state lives in Numba device arrays and the same element
arithmetic (one plain Python function per update, compiled by both @njit and @cuda.jit) runs
as CUDA kernels over device slices, on the default stream without synchronizing. Results equal
the CPU's to float tolerance (the GPU may fuse a multiply-add), and are bit-reproducible.
"""
import math

import numpy as np
from numba import njit, prange

from hpcsgd.device import DEVICES, assign, host_copy, is_device, one_thread_each, zeros
from hpcsgd.lazy_cuda import cuda

ADAGRAD_PLACES = ("off", "local", "aggregate", "after_momentum")
AGGREGATE, AFTER_MOMENTUM = 1, 2   # kernel codes of the post-exchange AdaGrad placements
ADAM = 3                           # ... and of Adam (optim.type=adam), computed there too
ADAM_LOCAL = 4                     # ... Adam's first moment only (adam_variance="local")
TYPES = ("sgd", "adam")
ADAM_VARIANCES = ("owner", "local")


def momentum_per_minibatch(time_constant, n):
    """CNTK's momentum time constant (samples) -> per-minibatch coefficient exp(-n / T)."""
    return 0.0 if time_constant <= 0 else math.exp(-n / time_constant)


def momentum_time_constant(mu, n):
    """The inverse: per-minibatch coefficient mu at minibatch size n -> T = -n / ln(mu)."""
    return 0.0 if mu <= 0 else -n / math.log(mu)


# ---- element arithmetic: plain functions, compiled for the CPU (inlined) and as CUDA device
# functions, so both targets do the same operations in the same order


def _adagrad(g, s, i, rho, c, inv_n, inv_q, eps):
    """Element i of g (a flat slice), in place: s = rho s + c (g/n)^2; g /= sqrt(s / q) + eps."""
    x = g[i] * inv_n
    si = rho * s[i] + c * (x * x)
    s[i] = si
    g[i] = g[i] / (math.sqrt(si * inv_q) + eps)


def _update(g, w, v, s, i, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m, adam_k):
    """The post-exchange arithmetic of element i: decay -> [AdaGrad] -> momentum -> [AdaGrad],
    or decay -> Adam (v, s its moments of the per-sample gradient; m = beta1, rho = beta2,
    c = 1 - beta2, inv_q = 1 / (1 - beta2^t), adam_k = n / (1 - beta1^t)), or decay -> Adam's
    first moment of a sum the ranks have normalised by their own second moments (ADAM_LOCAL).
    Scalars are float64; the result is rounded to the buffers' dtype."""
    x = g[i] + wd_n * w[i]
    if ada == ADAM:
        y = x * inv_n
        mi = m * v[i] + (1.0 - m) * y
        v[i] = mi
        si = rho * s[i] + c * (y * y)
        s[i] = si
        return w.dtype.type(adam_k * mi / (math.sqrt(si * inv_q) + eps))
    if ada == ADAM_LOCAL:
        mi = m * v[i] + (1.0 - m) * (x * inv_n)
        v[i] = mi
        return w.dtype.type(adam_k * mi)
    if ada == AGGREGATE:
        y = x * inv_n
        si = rho * s[i] + c * (y * y)
        s[i] = si
        x = x / (math.sqrt(si * inv_q) + eps)
    if use_momentum:
        x = m * v[i] + (1.0 - m) * x
        v[i] = x
    if ada == AFTER_MOMENTUM:
        y = x * inv_n
        si = rho * s[i] + c * (y * y)
        s[i] = si
        x = x / (math.sqrt(si * inv_q) + eps)
    return w.dtype.type(x)


# post_element_cpu is public: the 1-bit codec's fused owner pass (hpcsgd/codecs/onebit_owner.py)
# runs it inside its own per-column kernel, so both paths give the same bits
_adagrad_cpu, post_element_cpu = njit(inline="always")(_adagrad), njit(inline="always")(_update)
_adagrad_cuda, _update_cuda = cuda.jit(device=True)(_adagrad), cuda.jit(device=True)(_update)


# ---- Numba CPU kernels


@njit(parallel=True, cache=True)
def _adagrad_kernel(g, s, rho, c, inv_n, inv_q, eps):
    """In place on g (a flat slice): AdaGrad "local" (see _adagrad)."""
    for i in prange(g.size):
        _adagrad_cpu(g, s, i, rho, c, inv_n, inv_q, eps)


# Two kernels, not one with a "write the update" flag: a conditional store in the loop made
# Numba's parallel loop 100x slower (3 s instead of 25 ms over 46M values). For the same
# reason the common cases -- momentum without AdaGrad, AdaGrad on the sum with momentum,
# Adam -- have their own loops, where the inlined post_element_cpu sees constant flags and
# its branches fold away: the same arithmetic, so the same bits, 10x faster (1.4 against
# 13 ms over 5.9M values with momentum, measured; Adam: docs/benchmarks.md).
@njit(parallel=True, cache=True)
def _post_kernel(g, w, v, s, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m, adam_k):
    """g (a flat slice of the summed gradient) -> the update, in place; w read for decay.
    4-6 streams over memory (g, w, v, s): bandwidth-bound."""
    if ada == 0 and use_momentum:
        for i in prange(g.size):
            g[i] = post_element_cpu(g, w, v, s, i, wd_n, 0, rho, c, inv_n, inv_q, eps, True,
                                    m, adam_k)
    elif ada == ADAM:
        for i in prange(g.size):
            g[i] = post_element_cpu(g, w, v, s, i, wd_n, ADAM, rho, c, inv_n, inv_q, eps,
                                    False, m, adam_k)
    elif ada == ADAM_LOCAL:
        for i in prange(g.size):
            g[i] = post_element_cpu(g, w, v, s, i, wd_n, ADAM_LOCAL, rho, c, inv_n, inv_q, eps,
                                    False, m, adam_k)
    elif ada == AGGREGATE and use_momentum:
        for i in prange(g.size):
            g[i] = post_element_cpu(g, w, v, s, i, wd_n, AGGREGATE, rho, c, inv_n, inv_q, eps,
                                    True, m, adam_k)
    else:
        for i in prange(g.size):
            g[i] = post_element_cpu(g, w, v, s, i, wd_n, ada, rho, c, inv_n, inv_q, eps,
                                    use_momentum, m, adam_k)


@njit(parallel=True, cache=True)
def _step_kernel(g, w, v, s, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m, adam_k,
                 lr):
    """Single process, fused: W -= lr * update, g left unchanged. 5 streams with momentum."""
    if ada == 0 and use_momentum:
        for i in prange(g.size):
            x = post_element_cpu(g, w, v, s, i, wd_n, 0, rho, c, inv_n, inv_q, eps, True, m,
                                 adam_k)
            w[i] = w[i] - lr * x
    elif ada == ADAM:
        for i in prange(g.size):
            x = post_element_cpu(g, w, v, s, i, wd_n, ADAM, rho, c, inv_n, inv_q, eps, False,
                                 m, adam_k)
            w[i] = w[i] - lr * x
    elif ada == ADAM_LOCAL:
        for i in prange(g.size):
            x = post_element_cpu(g, w, v, s, i, wd_n, ADAM_LOCAL, rho, c, inv_n, inv_q, eps,
                                 False, m, adam_k)
            w[i] = w[i] - lr * x
    elif ada == AGGREGATE and use_momentum:
        for i in prange(g.size):
            x = post_element_cpu(g, w, v, s, i, wd_n, AGGREGATE, rho, c, inv_n, inv_q, eps,
                                 True, m, adam_k)
            w[i] = w[i] - lr * x
    else:
        for i in prange(g.size):
            x = post_element_cpu(g, w, v, s, i, wd_n, ada, rho, c, inv_n, inv_q, eps,
                                 use_momentum, m, adam_k)
            w[i] = w[i] - lr * x


@njit(parallel=True, cache=True)
def _apply_kernel(w, u, lr):
    """W -= lr * update over a flat slice."""
    for i in prange(w.size):
        w[i] = w[i] - lr * u[i]


def apply_update(w, u, lr, device="cpu"):
    """w -= lr * u over flat slices, on the host or the device (Optimizer.apply's arithmetic;
    also the striped exchange's for the matrices beside a fused codec)."""
    if device == "cpu":
        _apply_kernel(w, u, float(lr))
    else:
        _launch_cuda(_apply_kernel, w, u, float(lr))


# ---- CUDA kernels: the same, one grid-stride loop each (element-wise, so the launch
# configuration does not change any result). On a GPU, NVVM may contract w - lr * x into an
# FMA: GPU ranks agree with each other bit for bit, with CPU ranks to float tolerance.

THREADS, MAX_BLOCKS = 256, 65535


@cuda.jit
def _adagrad_cuda_kernel(g, s, rho, c, inv_n, inv_q, eps):
    for i in range(cuda.grid(1), g.size, cuda.gridsize(1)):
        _adagrad_cuda(g, s, i, rho, c, inv_n, inv_q, eps)


@cuda.jit
def _post_cuda_kernel(g, w, v, s, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m,
                      adam_k):
    for i in range(cuda.grid(1), g.size, cuda.gridsize(1)):
        g[i] = _update_cuda(g, w, v, s, i, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum,
                            m, adam_k)


@cuda.jit
def _step_cuda_kernel(g, w, v, s, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m,
                      adam_k, lr):
    for i in range(cuda.grid(1), g.size, cuda.gridsize(1)):
        x = _update_cuda(g, w, v, s, i, wd_n, ada, rho, c, inv_n, inv_q, eps, use_momentum, m,
                         adam_k)
        w[i] = w[i] - lr * x


@cuda.jit
def _apply_cuda_kernel(w, u, lr):
    for i in range(cuda.grid(1), w.size, cuda.gridsize(1)):
        w[i] = w[i] - lr * u[i]


_CUDA = {_adagrad_kernel: _adagrad_cuda_kernel, _post_kernel: _post_cuda_kernel,
         _step_kernel: _step_cuda_kernel, _apply_kernel: _apply_cuda_kernel}


def _launch_cuda(kernel, first, *args):
    """The CUDA twin of a CPU kernel over device arrays; `first` (a flat slice) sets the
    grid. Floats are passed as float64, as the GPU types them (the simulator would
    otherwise compute with float32 where a Python float meets a float32 value)."""
    if first.size == 0:          # an empty stripe: nothing to launch
        return
    args = [np.float64(a) if type(a) is float else a for a in args]
    blocks, threads = one_thread_each(first.size, THREADS)   # grid-stride past MAX_BLOCKS
    _CUDA[kernel][min(blocks, MAX_BLOCKS), threads](first, *args)


class Optimizer:
    """Optimizer state (flat buffers + scalars) and its per-step update functions.

    size: parameters (the flat buffer's length). post_size: length of the buffers that
    post_exchange sees (default size; the striped exchange passes its stripe length, so
    momentum and post-exchange AdaGrad state are 1/K of the model). momentum_time_constant:
    T in samples, 0 = off. adagrad: one of ADAGRAD_PLACES; kind: "sgd" or "adam";
    adam_variance: one of ADAM_VARIANCES (where Adam's second moment is learned);
    adagrad_time_constant: T_a in samples (math.inf = all history); adagrad_eps;
    weight_decay: per sample. device: "cpu" (NumPy state, Numba CPU kernels) or "cuda"
    (device state; params, grads and updates passed in are device arrays).
    State for checkpoints: `velocity` and `sqr` (flat, like the params), `sqr_weight` (scalar
    q); see state_dict/host_state_dict/load_state_dict.
    """

    def __init__(self, size, momentum_time_constant=0.0, adagrad="off",
                 adagrad_time_constant=math.inf, adagrad_eps=1e-8, weight_decay=0.0,
                 dtype=np.float32, post_size=None, device="cpu", kind="sgd", beta1=0.9,
                 beta2=0.999, adam_eps=1e-8, adam_variance="owner"):
        if device not in DEVICES:
            raise ValueError(f"device={device!r}: expected one of {DEVICES}")
        if kind not in TYPES:
            raise ValueError(f"kind={kind!r}: expected one of {TYPES}")
        if kind == "adam" and (adagrad != "off" or momentum_time_constant):
            raise ValueError("Adam keeps its own moments: adagrad must be 'off' and the "
                             "momentum time constant 0")
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1 and adam_eps >= 0):
            raise ValueError("Adam: beta1, beta2 in [0, 1), eps >= 0")
        if adam_variance not in ADAM_VARIANCES:
            raise ValueError(f"adam_variance={adam_variance!r}: expected one of "
                             f"{ADAM_VARIANCES}")
        self.kind, self.beta1, self.beta2, self.adam_eps = kind, float(beta1), float(beta2), \
            float(adam_eps)
        self.adam_p = 0.0   # Adam: 1 - beta1^t (its first moment's total weight)
        self.variance_frozen = False   # Adam: freeze_variance() was called
        if adagrad not in ADAGRAD_PLACES:
            raise ValueError(f"adagrad={adagrad!r}: expected one of {ADAGRAD_PLACES}")
        if momentum_time_constant < 0 or adagrad_time_constant <= 0 or adagrad_eps < 0 \
                or weight_decay < 0:
            raise ValueError("optimizer constants must be >= 0 (adagrad_time_constant > 0)")
        self.momentum_time_constant = float(momentum_time_constant)
        self.adagrad = adagrad
        self.adagrad_time_constant = float(adagrad_time_constant)
        self.adagrad_eps = float(adagrad_eps)
        self.weight_decay = float(weight_decay)
        self.use_momentum = self.momentum_time_constant > 0
        self.device = device
        post_size = size if post_size is None else post_size
        adam = kind == "adam"   # Adam's moments: velocity (first), sqr (second)
        self.adam_variance = adam_variance if adam else "owner"
        # every rank normalises its own whole gradient before the exchange (pre_exchange),
        # by a second moment of its own: AdaGrad "local", Adam's local variance
        self.local = adagrad == "local" or self.adam_variance == "local"
        self.velocity = zeros(post_size if self.use_momentum or adam else 1, dtype, device)
        self.sqr = zeros((size if self.local else post_size)
                         if adagrad != "off" or adam else 1, dtype, device)
        self.sqr_weight = 0.0
        self._k = None   # per-step scalars from begin_step

    # ---- per step --------------------------------------------------------------------------

    def begin_step(self, n, n_local=None):
        """Per-minibatch scalars, once per step on every rank before pre/post_exchange.
        n: frames of the whole minibatch (all ranks); n_local: this rank's (for "local")."""
        n_ada = (n if n_local is None else n_local) if self.local else n
        adam_k = 0.0
        if self.kind == "adam" and self.variance_frozen:   # s and its weight stay as they are
            rho, c = 1.0, 0.0
            self.adam_p = self.beta1 * self.adam_p + (1.0 - self.beta1)
            adam_k = n / self.adam_p
        elif self.kind == "adam":   # the moments' total weights: the bias corrections
            rho, c = self.beta2, 1.0 - self.beta2
            self.sqr_weight = rho * self.sqr_weight + c
            self.adam_p = self.beta1 * self.adam_p + (1.0 - self.beta1)
            adam_k = n / self.adam_p
        elif self.adagrad != "off":
            if math.isinf(self.adagrad_time_constant):
                rho, c = 1.0, float(n_ada)
            else:
                rho = math.exp(-n_ada / self.adagrad_time_constant)
                c = 1.0 - rho
            self.sqr_weight = rho * self.sqr_weight + c
        else:
            rho, c = 1.0, 0.0
        self._k = dict(
            # a rank with no frames this step (epoch tail, "local" placement) has a zero
            # gradient: rho = 1, c = 0 leave its AdaGrad state as it was (Adam's local v
            # decays by beta2, as Adam's does under a zero gradient); pre_inv_n: 1 / this
            # rank's frames for pre_exchange, inv_n: 1 / the sum's for post_exchange
            n=n, wd_n=self.weight_decay * n, rho=rho, c=c, inv_n=1.0 / n if n else 0.0,
            pre_inv_n=1.0 / n_ada if n_ada else 0.0,
            inv_q=1.0 / self.sqr_weight if self.sqr_weight > 0 else 0.0,
            m=self.beta1 if self.kind == "adam"
            else momentum_per_minibatch(self.momentum_time_constant, n), adam_k=adam_k)
        return self._k

    def freeze_variance(self):
        """Adam: from the next step on, the second moment (and its bias correction) stays as
        it is -- 1-bit Adam's rule (Tang et al. 2021, DeepSpeed): once the exchange is lossy,
        the decoded gradient's squares are the codec's (a 1-bit column's two values, whatever
        each element's own magnitude), and a variance learned from them would turn Adam's
        per-element scaling into a per-column one. The first moment keeps learning."""
        if self.kind != "adam" or self.local:
            raise ValueError("freeze_variance: Adam's second moment at the owner only "
                             "(optim.type=adam, adam_variance='owner')")
        self.variance_frozen = True

    def pre_exchange(self, grad, lo=0, hi=None):
        """AdaGrad "local" or Adam's local variance: normalise this rank's raw gradient
        grad[lo:hi] in place by its own second moment. No-op for the other placements."""
        if not self.local:
            return
        k = self._k
        sl = slice(lo, grad.size if hi is None else hi)
        eps = self.adam_eps if self.kind == "adam" else self.adagrad_eps
        self._run(_adagrad_kernel, grad[sl], self.sqr[sl], k["rho"], k["c"], k["pre_inv_n"],
                  k["inv_q"], eps)

    def post_exchange(self, agg, params, lo=0, hi=None):
        """Summed gradient agg[lo:hi] -> the update, in place (weight decay, AdaGrad
        "aggregate"/"after_momentum", momentum); params[lo:hi] is read for weight decay.
        Returns the view agg[lo:hi]. Only the owner of the range needs to call it."""
        sl = slice(lo, agg.size if hi is None else hi)
        self._run(_post_kernel, agg[sl], params[sl], *self._state_slices(sl), *self._scalars())
        return agg[sl]

    def post_operands(self):
        """What post_exchange's kernel gets, for a kernel that runs post_element_cpu itself
        over the compact post-exchange state (the striped exchange's fused owner pass):
        (velocity, sqr, scalars), the arrays whole (1-element dummies where unused), the
        scalars in post_element_cpu's order (wd_n, ada, rho, c, inv_n, inv_q, eps,
        use_momentum, m, adam_k)."""
        v, s = self._state_slices(slice(0, None))
        return v, s, self._scalars()

    def apply(self, params, update, lr, lo=0, hi=None):
        """params[lo:hi] -= lr * update[lo:hi] (lr per sample; update summed over frames)."""
        sl = slice(lo, params.size if hi is None else hi)
        apply_update(params[sl], update[sl], lr, self.device)

    def step(self, params, grad, lr, n):
        """Single process: begin_step + pre_exchange + post_exchange + apply over the whole
        flat buffers in one fused pass (grad is left unchanged unless AdaGrad is "local")."""
        self.begin_step(n, n)
        self.pre_exchange(grad)
        self.fused_update(params, grad, lr)

    def fused_update(self, params, grad, lr):
        """post_exchange + apply over the whole flat buffers in one pass, W -= lr * update,
        with the per-step scalars of begin_step (grad is left unchanged)."""
        sl = slice(0, grad.size)
        self._run(_step_kernel, grad, params, *self._state_slices(sl), *self._scalars(),
                  float(lr))

    def _run(self, kernel, *args):
        """A CPU kernel, or on "cuda" its CUDA twin (queued on the default stream, no sync)."""
        if self.device == "cpu":
            kernel(*args)
        else:
            _launch_cuda(kernel, *args)

    def _state_slices(self, sl):
        """(velocity, sqr) views of the range; the unused ones are 1-element dummies."""
        adam = self.kind == "adam"
        v = self.velocity[sl] if self.use_momentum or adam else self.velocity
        s = self.sqr[sl] if self.adagrad in ("aggregate", "after_momentum") \
            or (adam and not self.local) else self.sqr
        return v, s

    def _scalars(self):
        k = self._k
        ada = {"aggregate": AGGREGATE, "after_momentum": AFTER_MOMENTUM}.get(self.adagrad, 0)
        eps = self.adagrad_eps
        if self.kind == "adam":
            ada, eps = ADAM_LOCAL if self.local else ADAM, self.adam_eps
        return (k["wd_n"], ada, k["rho"], k["c"], k["inv_n"], k["inv_q"], eps,
                self.use_momentum, k["m"], k["adam_k"])

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self):
        """Arrays (by reference: device arrays on "cuda") and scalars that make a resumed run
        bit-exact."""
        return {"velocity": self.velocity, "sqr": self.sqr, "sqr_weight": self.sqr_weight,
                "adam_p": self.adam_p}

    def host_state_dict(self):
        """state_dict with NumPy copies of the arrays (checkpoints, snapshots); on "cuda" a
        device-to-host copy, a sync point."""
        return {"velocity": host_copy(self.velocity), "sqr": host_copy(self.sqr),
                "sqr_weight": self.sqr_weight, "adam_p": self.adam_p}

    def load_state_dict(self, state):
        """Copy a state (host arrays, h5py datasets or device arrays) into the buffers."""
        for name in ("velocity", "sqr"):
            dst, src = getattr(self, name), state[name]
            src = src if is_device(src) else np.asarray(src)
            if tuple(src.shape) != tuple(dst.shape):
                raise ValueError(f"optimizer state {name}: shape {tuple(src.shape)}, "
                                 f"expected {tuple(dst.shape)}")
            assign(dst, src)
        self.sqr_weight = float(state["sqr_weight"])
        self.adam_p = float(state.get("adam_p", 0.0))


def from_config(cfg, size, post_size=None, device="cpu"):
    """The optimizer the config's optim.* keys describe, over `size` parameters (post_size:
    the exchange's state_size, the owner's stripe in the striped exchange)."""
    adam = cfg["optim.type"] == "adam"
    return Optimizer(size, momentum_time_constant=0.0 if adam else cfg["optim.momentum_tc"],
                     adagrad=cfg["optim.adagrad"],
                     adagrad_time_constant=cfg["optim.adagrad_tc"] or math.inf,
                     adagrad_eps=cfg["optim.adagrad_eps"], weight_decay=cfg["optim.weight_decay"],
                     post_size=post_size, device=device, kind=cfg["optim.type"],
                     beta1=cfg["optim.adam_beta1"], beta2=cfg["optim.adam_beta2"],
                     adam_eps=cfg["optim.adam_eps"], adam_variance=cfg["optim.adam_variance"])


# ---- learning-rate schedules (lr per sample) ---------------------------------------------------

SCHEDULES = ("constant", "step", "newbob", "linear")


def step_decay_lr(lr0, frames, decay_frames, factor):
    """lr0 * factor ** (frames // decay_frames); frames = all ranks' frames trained so far."""
    return lr0 * factor ** (int(frames) // int(decay_frames))


def newbob_lr(lr0, cv_acc_history, threshold=0.005, factor=0.5):
    """The "newbob" decision, replayed from the history of cross-validation frame accuracies
    (fractions, one per epoch, oldest first; the first may be the untrained model's): keep lr0
    until an epoch improves CV accuracy by less than `threshold` (absolute, 0.005 = half a
    point), then multiply by `factor` at that and every later epoch (QuickNet/Kaldi ramping).
    Returns the learning rate for the next epoch. Stateless: the history is the state."""
    lr, ramping = lr0, False
    for prev, acc in zip(cv_acc_history[:-1], cv_acc_history[1:]):
        if ramping or acc - prev < threshold:
            ramping = True
            lr *= factor
    return lr


def linear_lr(lr0, frames, total_frames):
    """lr0 falling linearly to 0 at total_frames (the IBM paper's fine-tuning decay)."""
    return lr0 * max(0.0, 1.0 - int(frames) / max(int(total_frames), 1))


def learning_rate(schedule, lr0, frames=0, cv_acc_history=(), decay_frames=1, decay_factor=0.5,
                  newbob_threshold=0.005, total_frames=1, warmup_frames=0):
    """The per-sample learning rate now, for schedule "constant", "step", "newbob" or
    "linear" (total_frames: the run's frames, every epoch), times frames / warmup_frames
    while that is below 1 (a linear warm-up: a function of the frames, so a resume is in the
    same place)."""
    rate = _schedule_lr(schedule, lr0, frames, cv_acc_history, decay_frames, decay_factor,
                        newbob_threshold, total_frames)
    if warmup_frames and frames < warmup_frames:
        rate *= int(frames) / int(warmup_frames)
    return rate


def _schedule_lr(schedule, lr0, frames, cv_acc_history, decay_frames, decay_factor,
                 newbob_threshold, total_frames):
    if schedule == "constant":
        return lr0
    if schedule == "linear":
        return linear_lr(lr0, frames, total_frames)
    if schedule == "step":
        return step_decay_lr(lr0, frames, decay_frames, decay_factor)
    if schedule == "newbob":
        return newbob_lr(lr0, list(cv_acc_history), newbob_threshold, decay_factor)
    raise ValueError(f"schedule {schedule!r}: expected one of {SCHEDULES}")
