"""Under mpiexec -n M: a DNN split over M model ranks against the same DNN unsplit, in float64.

    mpiexec -n M python tests/mpi/parallel_network.py HIDDEN LABELS ACTIVATION

Every rank builds both from the same seed (a split layer keeps its columns of the unsplit
draw). Checked on every rank, then "OK M=..." printed by rank 0:
  - the CE and correct frames equal the unsplit model's;
  - each rank's gradient slices equal its columns of the unsplit gradient (float64: the only
    differences are the reassociated sums of dx, far below 1e-9 of the gradient's norm);
  - the gathered log-posteriors of forward() equal the unsplit model's;
  - central finite differences of the group's CE match the split gradient, for elements of
    every parameter on every rank (rank r perturbs its own element; all ranks evaluate);
  - the bytes each rank sent and received equal the traffic formula of model/parallel.py;
  - to_whole / from_whole give back the unsplit model's parameters and this rank's slice.
"""
import sys

import numpy as np
from mpi4py import MPI

from hpcsgd.model.dnn import dnn
from hpcsgd.model.parallel import ModelGroup, from_whole, split_columns, to_whole

comm = MPI.COMM_WORLD
M, me = comm.Get_size(), comm.Get_rank()
hidden = [int(h) for h in sys.argv[1].split(",")]
labels, activation = int(sys.argv[2]), sys.argv[3]
D, n = 6, 37
group = ModelGroup(comm)
ref = dnn(D, hidden, labels, activation, max_batch=64, dtype=np.float64)
net = dnn(D, hidden, labels, activation, max_batch=64, dtype=np.float64, group=group)
assert net.parallel and not ref.parallel
p_ref, g_ref = ref.new_params(), ref.new_params()
p, g = net.new_params(), net.new_params()
ref.init(p_ref, np.random.default_rng(3))
net.init(p, np.random.default_rng(3))
rng = np.random.default_rng(11)
x = rng.normal(0, 1.5, (n, D))
y = rng.integers(0, labels, n).astype(np.int32)
y[5] = -1                                         # a frame outside the loss

ce_ref, correct_ref = ref.forward_backward(p_ref, g_ref, x, y, n)
ce, correct = net.forward_backward(p, g, x, y, n)
assert abs(ce - ce_ref) <= 1e-12 * abs(ce_ref), (ce, ce_ref)
assert correct == correct_ref, (correct, correct_ref)
for layer in net.layers:
    for name, (shape, (lo, hi)) in layer.whole().items():
        assert np.array_equal(p[name], p_ref[name][:, lo:hi]), name
        want = g_ref[name][:, lo:hi]
        err = np.abs(g[name] - want).max()
        assert err <= 1e-9 * max(np.abs(g_ref[name]).max(), 1e-30), (name, err)

post_ref = ref.forward(p_ref, x, n).copy()
post = net.forward(p, x, n)
assert np.abs(post - post_ref).max() <= 1e-12, np.abs(post - post_ref).max()

# traffic: one forward_backward and one forward so far
sent, received = group.sent, group.received
dims = [D, *hidden, labels]
ag_recv = ag_sent = rs_sent = rs_recv = 0
for i, n_out in enumerate(dims[1:]):
    b = split_columns(n_out, M)
    c = int(b[me + 1] - b[me])
    gathers = 2 if i < len(hidden) else 1        # hidden outputs twice; posteriors once
    ag_recv += gathers * n * (n_out - c)
    ag_sent += gathers * n * c * (M - 1)
for n_in in dims[1:-1]:                           # every layer's input gradient but the first's
    b = split_columns(n_in, M)
    c = int(b[me + 1] - b[me])
    rs_sent += n * (n_in - c)
    rs_recv += n * c * (M - 1)
B = 8   # bytes per float64 value
want = {"allgather": (B * ag_sent, B * ag_recv), "reduce_scatter": (B * rs_sent, B * rs_recv),
        "softmax": (B * 2 * n * 4 * (M - 1), B * 2 * n * 4 * (M - 1))}
assert group.traffic() == want, (group.traffic(), want)

# finite differences of the group's CE, element by element (every rank evaluates every one)
scratch = net.new_params()
eps = 1e-6
checked = 0
for r in range(M):
    for m in net.new_params().matrices:
        idx = [0, m.size // 2, m.size - 1]
        for k in idx:
            def loss(delta):
                if me == r:
                    p.flat[m.offset + k] += delta
                value, _ = net.forward_backward(p, scratch, x, y, n)
                if me == r:
                    p.flat[m.offset + k] -= delta
                return value
            numeric = (loss(eps) - loss(-eps)) / (2 * eps)
            if me == r:
                analytic = g.flat[m.offset + k]
                assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(analytic)), \
                    (m.name, k, numeric, analytic)
                checked += 1
assert checked == 3 * len(p.matrices)

whole = to_whole(net.layers, p.flat, group)
if me == 0:
    assert np.array_equal(whole, p_ref.flat)
else:
    assert whole is None
back = from_whole(net.layers, p_ref.flat, np.zeros_like(p.flat))
assert np.array_equal(back, p.flat)
comm.Barrier()
if me == 0:
    print(f"OK M={M}")
