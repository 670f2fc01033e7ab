"""Cross-rank communication: the process grid (grid.py), the stripes each data rank owns
(stripes.py), the gradient exchange (exchange.py), GPU binding, CUDA-aware MPI and NCCL
(gpu.py), and a progress thread for a nonblocking collective (progress.py).

    grid = Grid(MPI.COMM_WORLD)
    ex = make_exchange(cfg, grid.data, params.matrices)   # buffers preallocated here, once
    exchange_update(ex, opt, params.flat, grads.flat, lr, phases)   # hpcsgd/step.py

See docs/exchange.md for the algorithms, buffer layouts and measured costs, and
docs/architecture.md for where they sit.
"""
from hpcsgd.comm.exchange import Allreduce, Striped, make_exchange  # noqa: F401
