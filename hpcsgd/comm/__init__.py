"""Cross-rank communication: the gradient exchange (hpcsgd/comm/exchange.py).

    ex = make_exchange(cfg, comm, grads.matrices)   # buffers preallocated here, once
    update = ex.step(grads.flat, params.flat, opt)   # sum over ranks + post-processing
    opt.apply(params.flat, update, lr)

See docs/exchange.md for the algorithms, buffer layouts and measured costs.
"""
from hpcsgd.comm.exchange import Allreduce, Striped, make_exchange  # noqa: F401
