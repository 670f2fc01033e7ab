"""hpcsgd.checkpoint: one file per rank and a manifest written last, atomic (a failed write
leaves the previous checkpoint and nothing half-written), a lost rank named, the format-1
single file still readable; and the parallel write under a real mpiexec."""
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np
import pytest

from conftest import run_mpi
from hpcsgd import checkpoint
from hpcsgd.errors import UserError

ENV = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")


def test_a_checkpoint_is_a_directory_of_per_rank_files_and_a_manifest(tmp_path):
    run = str(tmp_path)
    path = checkpoint.save(run, 100, {"params": np.arange(5, dtype=np.float32)},
                           {"frames": 100, "epoch": 0},
                           rank_arrays={"exchange/residual1": np.ones(3, np.float32)})
    assert os.path.isdir(path) and checkpoint.latest(run) == path
    assert sorted(os.listdir(path)) == ["manifest.json", "rank0000.h5", "shared.h5"]
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert manifest["format"] == 2 and manifest["world"] == 1 and manifest["meta"]["frames"] == 100
    arrays, meta = checkpoint.load(path)
    assert sorted(arrays) == ["params", "rank0000/exchange/residual1"] and meta["epoch"] == 0
    np.testing.assert_array_equal(arrays["params"], np.arange(5))
    assert checkpoint.load(path, names=("params",))[0].keys() == {"params"}
    assert checkpoint.read_meta(path) == meta


def test_old_checkpoints_beyond_keep_are_removed(tmp_path):
    run = str(tmp_path)
    for frames in (1, 2, 3, 4):
        checkpoint.save(run, frames, {"params": np.zeros(2, np.float32)}, {"frames": frames},
                        keep=2)
    assert [os.path.basename(p) for p in checkpoint.all_checkpoints(run)] == [
        "ckpt-00000000000003", "ckpt-00000000000004"]


def test_a_format_1_single_file_checkpoint_still_loads(tmp_path):
    """What checkpoints were before one file per rank: one HDF5 file, every rank's arrays
    under rankNNNN/, the meta as a JSON attribute."""
    directory = checkpoint.checkpoint_dir(str(tmp_path))
    os.makedirs(directory)
    path = os.path.join(directory, "ckpt-00000000000100.h5")
    with h5py.File(path, "w") as f:
        f["params"] = np.ones(4, np.float32)
        f["rank0001/exchange/residual1"] = np.full(2, 7, np.float32)
        f.attrs["meta"] = json.dumps({"frames": 100, "world": 2})
    with open(os.path.join(directory, "latest"), "w") as f:
        f.write("ckpt-00000000000100.h5\n")
    assert checkpoint.latest(str(tmp_path)) == path
    arrays, meta = checkpoint.load(path, rank=1)
    assert meta["world"] == 2 and arrays["rank0001/exchange/residual1"][0] == 7
    assert "rank0001/exchange/residual1" not in checkpoint.load(path, rank=0)[0]


def test_failed_checkpoint_write_keeps_the_previous_one(tmp_path):
    """A real failed write: the file-size limit makes the second (larger) save fail (EFBIG)."""
    code = f"""
import resource, signal, numpy as np
from hpcsgd import checkpoint
from hpcsgd.errors import UserError
run = {str(tmp_path)!r}
first = checkpoint.save(run, 100, {{"params": np.ones(1000, np.float32)}}, {{"frames": 100}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
try:
    checkpoint.save(run, 200, {{"params": np.ones(1_000_000, np.float32)}}, {{"frames": 200}})
except UserError as err:
    print("ERROR", err)
print("LATEST", checkpoint.latest(run) == first)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=ENV)
    assert "ERROR" in proc.stdout and "is intact" in proc.stdout, proc.stdout + proc.stderr
    assert "LATEST True" in proc.stdout
    names = os.listdir(checkpoint.checkpoint_dir(str(tmp_path)))
    assert not [n for n in names if ".tmp" in n], names
    arrays, meta = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert meta["frames"] == 100 and arrays["params"].sum() == 1000


def test_a_rank_lost_during_a_checkpoint_is_named_and_the_previous_one_kept(tmp_path):
    """Rank 0 waiting for a rank's word that its file is written gets MPI's error (that rank
    died): the message names that rank, not the disk, and nothing half-written is left."""
    from mpi4py import MPI
    run = str(tmp_path)
    first = checkpoint.save(run, 100, {"params": np.ones(10, np.float32)}, {"frames": 100})

    class LostRank2:   # rank 0 of 3 whose rank 2 is gone: MPI reports it on the receive
        def Get_size(self):
            return 3

        def Get_rank(self):
            return 0

        def bcast(self, obj, root):
            return obj

        def recv(self, source, tag):
            if source == 2:
                raise MPI.Exception(MPI.ERR_OTHER)
            return None   # rank 1 wrote its file

    with pytest.raises(UserError, match=r"rank 2 failed or was killed before writing its state"
                                        r".*previous checkpoint .*ckpt-00000000000100 is intact"):
        checkpoint.save(run, 200, {"params": np.ones(10, np.float32)}, {"frames": 200},
                        comm=LostRank2(), rank_arrays={"exchange/residual1": np.zeros(4, np.float32)})
    assert checkpoint.latest(run) == first
    assert sorted(os.listdir(checkpoint.checkpoint_dir(run))) == sorted(
        [checkpoint.LATEST, os.path.basename(first)])


def test_every_rank_writes_its_own_file_under_mpiexec(tmp_path):
    """Three ranks save twice; rank 2's disk is full the second time: every rank raises the
    same error naming rank 2, and the first checkpoint stays the latest, whole."""
    code = f"""
import sys, numpy as np
from mpi4py import MPI
from hpcsgd import checkpoint
from hpcsgd.errors import UserError
comm = MPI.COMM_WORLD
r = comm.Get_rank()
run = {str(tmp_path)!r}
first = checkpoint.save(run, 100, {{"params": np.arange(6, dtype=np.float32)}}, {{"frames": 100}},
                        comm=comm, rank_arrays={{"exchange/residual1": np.full(3, r, np.float32)}})
if r == 2:   # this rank's disk is full: a file-size limit (EFBIG) below its state's size
    import resource, signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000))
comm.Barrier()
try:
    checkpoint.save(run, 200, {{"params": np.zeros(6, np.float32)}}, {{"frames": 200}}, comm=comm,
                    rank_arrays={{"exchange/residual1": np.zeros(1_000_000, np.float32)}})
except UserError as err:
    print(f"rank {{r}} ERROR {{err}}", flush=True)
print(f"rank {{r}} LATEST {{checkpoint.latest(run) == first}}", flush=True)
"""
    proc = run_mpi(3, ["-c", code], timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for r in range(3):
        assert f"rank {r} LATEST True" in proc.stdout, proc.stdout + proc.stderr
    errors = re.findall(r"rank (\d) ERROR (.*?is intact)", proc.stdout)
    assert sorted(r for r, _ in errors) == ["0", "1", "2"], proc.stdout
    assert all("rank 2: write failed" in e and "File too large" in e for _, e in errors)
    arrays, meta = checkpoint.load(checkpoint.latest(str(tmp_path)))
    assert meta["frames"] == 100
    for r in range(3):
        np.testing.assert_array_equal(arrays[f"rank{r:04d}/exchange/residual1"], [r, r, r])
    assert not [n for n in os.listdir(checkpoint.checkpoint_dir(str(tmp_path))) if ".tmp" in n]
