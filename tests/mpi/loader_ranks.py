"""Run under `mpiexec -n K`: every frame of an epoch exactly once across ranks, rank-disjoint.

Each rank streams its share with its local minibatch size (changing it mid-epoch, as the
minibatch-size search will), then rank 0 gathers the centre-frame ids and checks them.
Exit code 0 and a line `OK frames=... per_rank=...` when everything holds.
"""
import sys

import numpy as np
from mpi4py import MPI

from hpcsgd.data.loader import FrameLoader, local_batch_size

archive_dir, epoch, context = sys.argv[1], int(sys.argv[2]), 2
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
loader = FrameLoader(archive_dir, rank, world, context=context, cmvn="none", seed=7,
                     max_batch=256, block_frames=500, buffer_frames=1500)
expected = loader.plan.rank_frames(epoch)
loader.start_epoch(epoch)
ids, step = [], 0
while True:
    global_batch = 256 if step < 5 else 100      # the global minibatch changes mid-epoch
    x, y = loader.next_batch(local_batch_size(global_batch, rank, world))
    if len(y) == 0:
        break
    ids.append(x[:, context * loader.feature_dim].astype(np.int64))  # centre frame, column 0
    step += 1
mine = np.concatenate(ids)
assert len(mine) == expected[rank], (rank, len(mine), expected[rank])
everything = comm.gather(mine, root=0)
if rank == 0:
    flat = np.concatenate(everything)
    total = loader.index["total_frames"]
    assert len(flat) == total, (len(flat), total)
    assert len(np.unique(flat)) == total, "a frame was streamed twice"
    sets = [set(e.tolist()) for e in everything]
    for a in range(world):
        for b in range(a + 1, world):
            assert not sets[a] & sets[b], f"ranks {a} and {b} share frames"
    print(f"OK frames={total} per_rank={[len(e) for e in everything]}", flush=True)
loader.close()
