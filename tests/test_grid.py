"""hpcsgd.comm.grid under a real mpiexec: D data x M model ranks, consecutive ranks one model
group, each communicator summing over the ranks it should."""
import json

import pytest

from conftest import run_mpi

CODE = """
import json, sys
import numpy as np
from mpi4py import MPI
from hpcsgd.comm.grid import Grid
M = int(sys.argv[1])
g = Grid(MPI.COMM_WORLD, model_size=M)
one = np.array([g.rank], np.int64)
data_sum, model_sum = np.empty(1, np.int64), np.empty(1, np.int64)
g.data.Allreduce(one, data_sum)
g.model.Allreduce(one, model_sum)
row = dict(rank=g.rank, data=[g.data_rank, g.data_size, g.data.Get_rank(), g.data.Get_size()],
           model=[g.model_rank, g.model_size, g.model.Get_rank(), g.model.Get_size()],
           node=[g.node_rank, g.node_size], sums=[int(data_sum[0]), int(model_sum[0])])
rows = g.world.gather(row)
if g.rank == 0:
    print("GRID " + json.dumps(rows))
g.free()
"""


@pytest.mark.parametrize("ranks, M", [(4, 1), (4, 2), (2, 2), (3, 1)])
def test_data_and_model_groups(ranks, M):
    proc = run_mpi(ranks, ["-c", CODE, str(M)], timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(proc.stdout.split("GRID ", 1)[1])
    D = ranks // M
    for row in rows:
        w = row["rank"]
        assert row["data"] == [w // M, D, w // M, D]
        assert row["model"] == [w % M, M, w % M, M]
        assert row["node"] == [w, ranks]    # one node here
        # data group: the ranks with my model rank; model group: M consecutive ranks
        assert row["sums"][0] == sum(r for r in range(ranks) if r % M == w % M)
        assert row["sums"][1] == sum(range(w - w % M, w - w % M + M))


def test_a_grid_that_does_not_divide_the_job_is_refused():
    proc = run_mpi(3, ["-c", CODE, "2"], timeout=60)
    assert proc.returncode != 0 and "not a whole number of model groups" in proc.stderr
