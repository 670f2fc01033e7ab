"""Cross-rank communication: the gradient exchange (hpcsgd/comm/exchange.py).

    ex = make_exchange(cfg, comm, grads.matrices)   # buffers preallocated here, once
    ex.step(grads.flat, params.flat, opt, lr)        # sum, post-process, W -= lr * update

See docs/exchange.md for the algorithms, buffer layouts and measured costs.
"""
from hpcsgd.comm.exchange import Allreduce, Striped, make_exchange  # noqa: F401
