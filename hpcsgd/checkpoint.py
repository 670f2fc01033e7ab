"""Atomic checkpoints of the full training state, so a resumed run continues bit-exactly.

A checkpoint is one HDF5 file `RUN/checkpoints/ckpt-<frames>.h5`: every array of the state
(parameters, optimizer state, codec residuals, ...) as a dataset, and a JSON attribute `meta`
(counters, loader positions, config, model shape, label-inventory hash). It is written under a
temporary name, fsync'ed and renamed; `RUN/checkpoints/latest` then names it. A failed write
(disk full, killed) leaves the previous checkpoint and `latest` untouched.

State that differs between ranks (the striped exchange's residuals and each owner's optimizer
stripe) lives in the same file under `rank0000/`, `rank0001/`, ...: with K ranks every rank
calls save(); rank 0 writes the shared arrays and its own, then receives the other ranks'
arrays one at a time over MPI (point-to-point, uppercase Send/Recv), so rank 0 holds at most
one other rank's array in memory at a time and the file stays a single atomic rename. Cost: the
per-rank state crosses to rank 0 (for the 46M model with 1-bit SGD, ~184 MB residual + ~1/K
of that per rank) and one disk writes it all; at cluster scale a directory with one file per
rank written in parallel would scale better. load(path, rank=r) reads the shared arrays and
only rank r's.
"""
import json
import os

import h5py
import numpy as np

from hpcsgd.errors import UserError

LATEST = "latest"


def checkpoint_dir(run_dir):
    return os.path.join(run_dir, "checkpoints")


def rank_prefix(rank):
    """Group of rank `rank`'s own arrays in a checkpoint."""
    return f"rank{rank:04d}/"


def save(run_dir, frames, arrays, meta, keep=3, comm=None, rank_arrays=None):
    """Write the state; return its path. Raises UserError (previous checkpoint intact) on failure.

    arrays: shared state (rank 0's copy is written). rank_arrays: this rank's own state, saved
    under rank_prefix(rank). With a communicator of K > 1 ranks this is a collective: every
    rank calls it and gets the path back once the file is complete (a cross-rank sync point);
    if rank 0 fails, it raises and the trainer's handler aborts the job.
    """
    rank_arrays = rank_arrays or {}
    world = comm.Get_size() if comm is not None else 1
    if world > 1 and comm.Get_rank() != 0:
        comm.send([(name, np.asarray(a).shape, np.asarray(a).dtype.str)
                   for name, a in rank_arrays.items()], dest=0, tag=71)   # lowercase: metadata
        for a in rank_arrays.values():
            comm.Send(np.ascontiguousarray(a), dest=0, tag=72)
        return comm.bcast(None, root=0)   # cross-rank sync point: rank 0 has renamed the file
    directory = checkpoint_dir(run_dir)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"ckpt-{frames:014d}.h5")
    tmp = path + f".tmp.{os.getpid()}"
    src = None   # the rank whose state is being received
    try:
        with h5py.File(tmp, "w") as f:
            for name, array in arrays.items():
                f.create_dataset(name, data=np.asarray(array))
            for name, array in rank_arrays.items():
                f.create_dataset(rank_prefix(0) + name, data=np.asarray(array))
            for src in range(1, world):   # one array in flight at a time
                for name, shape, dtype in comm.recv(source=src, tag=71):
                    buf = np.empty(shape, np.dtype(dtype))
                    comm.Recv(buf, source=src, tag=72)
                    f.create_dataset(rank_prefix(src) + name, data=buf)
            src = None
            f.attrs["meta"] = json.dumps(meta)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        latest_tmp = os.path.join(directory, LATEST + ".tmp")
        with open(latest_tmp, "w") as f:
            f.write(os.path.basename(path) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(latest_tmp, os.path.join(directory, LATEST))
    except (OSError, RuntimeError) as err:  # h5py reports a failed flush on close as RuntimeError
        if os.path.exists(tmp):
            os.unlink(tmp)
        previous = latest(run_dir)
        lines = str(err).strip().splitlines() or [type(err).__name__]
        if src is not None:   # an MPI error receiving a rank's state: that rank, not the disk
            mpi = lines[0] + (f" ... {lines[-1].strip()}" if len(lines) > 1 else "")
            raise UserError(f"checkpoint {path}: not written: rank {src} failed or was killed "
                            f"before sending its state (MPI: {mpi}); the previous checkpoint "
                            f"{previous or '(none)'} is intact") from None
        reason = getattr(err, "strerror", None) or lines[0]
        raise UserError(f"checkpoint {path}: write failed ({reason}); the previous "
                        f"checkpoint {previous or '(none)'} is intact") from None
    for old in sorted(n for n in os.listdir(directory)
                      if n.startswith("ckpt-") and n.endswith(".h5"))[:-keep]:
        os.unlink(os.path.join(directory, old))
    if world > 1:
        comm.bcast(path, root=0)
    return path


def latest(run_dir):
    """Path of the newest complete checkpoint of a run, or None."""
    pointer = os.path.join(checkpoint_dir(run_dir), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(checkpoint_dir(run_dir), f.read().strip())
    return path if os.path.isfile(path) else None


def load(path, rank=None, names=None):
    """(arrays dict, meta dict) of a checkpoint, with a clear error for a bad file.
    rank: read the shared arrays and only this rank's (under rank_prefix(rank)); None = all.
    names: read only these arrays (e.g. ("params",) for evaluation)."""
    def wanted(name):
        if names is not None:
            return name in names
        return rank is None or not name.startswith("rank") or name.startswith(rank_prefix(rank))

    try:
        with h5py.File(path, "r") as f:
            arrays = {}
            f.visititems(lambda name, obj: arrays.__setitem__(name, obj[()])
                         if isinstance(obj, h5py.Dataset) and wanted(name) else None)
            meta = json.loads(f.attrs["meta"])
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"checkpoint {path}: unreadable ({err})") from None
    return arrays, meta


def check_compatible(path, meta, expected):
    """Refuse a checkpoint whose model shape or label inventory differs from this run's."""
    for key, want in expected.items():
        got = meta.get(key)
        if got != want:
            raise UserError(f"checkpoint {path}: {key} is {got!r} but this run has {want!r}; "
                            f"use a fresh train.run_dir or the matching config/archive")
