"""Atomic checkpoints: one file per rank, written in parallel, and a manifest written last.

    RUN/checkpoints/ckpt-<frames>/      a checkpoint (format 2)
        shared.h5        arrays every rank holds alike (parameters, replicated optimizer state),
                         written by rank 0
        rank0000.h5 ...  each rank's own state (error-feedback residuals, an owner's optimizer
                         stripe, an exchange in flight), written by that rank
        manifest.json    format, ranks, files and the JSON meta (counters, loader positions,
                         config, model shape, label-inventory hash); written last
    RUN/checkpoints/latest               names the newest complete checkpoint

Writing (save, a collective over the ranks): rank 0 makes `ckpt-<frames>.tmp/` (a stale one
from a killed attempt is removed first); every rank writes its own file in it under a
temporary name, fsyncs and renames it, and reports to rank 0; rank 0 writes the manifest,
renames the directory to its final name and then rewrites `latest`. A failed write (disk
full, a rank killed) leaves the previous checkpoint and `latest` untouched and no
`*.tmp` behind, and every rank raises the same error naming the rank and the reason. No array
crosses MPI and no rank waits for another's disk writes, so a 64-rank job's checkpoint does
not serialise on rank 0 (format 1 funnelled every rank's state through it).

Reading (load) accepts both formats: format 1 is one HDF5 file `ckpt-<frames>.h5` with the
shared arrays, every rank's arrays under `rankNNNN/` and a JSON attribute `meta`. Either way
load() returns the same names: "params", "opt/...", "rankNNNN/exchange/residual1", ...
"""
import json
import os
import shutil

import h5py
import numpy as np

from hpcsgd.errors import UserError

LATEST = "latest"
MANIFEST = "manifest.json"
SHARED = "shared.h5"
FORMAT = 2
TAG_STATUS = 71


def checkpoint_dir(run_dir):
    return os.path.join(run_dir, "checkpoints")


def rank_prefix(rank):
    """Group of rank `rank`'s own arrays in a checkpoint's names."""
    return f"rank{rank:04d}/"


def rank_file(rank):
    return f"rank{rank:04d}.h5"


def _fsync_path(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_h5(path, arrays):
    """arrays -> an HDF5 file at path, via a temporary name, fsync'ed."""
    tmp = path + ".tmp"
    with h5py.File(tmp, "w") as f:
        for name, array in arrays.items():
            f.create_dataset(name, data=np.asarray(array))
    _fsync_path(tmp)
    os.replace(tmp, path)


def _reason(err):
    lines = str(err).strip().splitlines() or [type(err).__name__]
    return getattr(err, "strerror", None) or lines[0]


def save(run_dir, frames, arrays, meta, keep=3, comm=None, rank_arrays=None):
    """Write the state; return its path. Raises UserError (previous checkpoint intact) on
    failure, on every rank.

    arrays: shared state (rank 0's copy is written). rank_arrays: this rank's own state,
    loaded back under rank_prefix(rank). With a communicator of K > 1 ranks this is a
    collective: every rank calls it and gets the path back once the checkpoint is complete (a
    cross-rank sync point)."""
    rank_arrays = rank_arrays or {}
    world = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    directory = checkpoint_dir(run_dir)
    name = f"ckpt-{frames:014d}"
    path, tmp = os.path.join(directory, name), os.path.join(directory, name + ".tmp")
    error = None
    if rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)   # a killed attempt's leftovers
            os.makedirs(tmp)
        except OSError as err:
            error = f"rank 0 could not create {tmp} ({_reason(err)})"
    if world > 1:
        error = comm.bcast(error, root=0)   # the directory exists before anyone writes into it
    if error is None:
        try:
            if rank == 0:
                _write_h5(os.path.join(tmp, SHARED), arrays)
            _write_h5(os.path.join(tmp, rank_file(rank)), rank_arrays)
        except (OSError, RuntimeError) as err:   # h5py reports a failed flush as RuntimeError
            error = f"rank {rank}: write failed ({_reason(err)})"
    if rank != 0:
        comm.send(error, dest=0, tag=TAG_STATUS)   # lowercase: a short status
        outcome = comm.bcast(None, root=0)        # rank 0 has renamed the directory, or not
        if isinstance(outcome, UserError):
            raise outcome
        return outcome
    src = None
    try:
        for src in range(1, world):   # every rank's file is complete, or why not
            status = comm.recv(source=src, tag=TAG_STATUS)
            error = error or status
    except Exception as err:   # an MPI error: that rank, not the disk
        lines = str(err).strip().splitlines() or [type(err).__name__]
        mpi = lines[0] + (f" ... {lines[-1].strip()}" if len(lines) > 1 else "")
        error = f"rank {src} failed or was killed before writing its state (MPI: {mpi})"
    if error is None:
        try:
            manifest = {"format": FORMAT, "world": world, "frames": frames, "meta": meta,
                        "files": [SHARED] + [rank_file(r) for r in range(world)]}
            with open(os.path.join(tmp, MANIFEST), "w") as f:
                json.dump(manifest, f)
                f.flush()
                os.fsync(f.fileno())
            shutil.rmtree(path, ignore_errors=True)   # the same frames written again
            os.replace(tmp, path)
            _fsync_path(directory)
            latest_tmp = os.path.join(directory, LATEST + ".tmp")
            with open(latest_tmp, "w") as f:
                f.write(name + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(latest_tmp, os.path.join(directory, LATEST))
        except OSError as err:
            error = f"rank 0: {_reason(err)}"
    if error is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        outcome = UserError(f"checkpoint {path}: not written: {error}; the previous checkpoint "
                            f"{latest(run_dir) or '(none)'} is intact")
    else:
        _remove_old(directory, keep)
        outcome = path
    if world > 1:
        comm.bcast(outcome, root=0)
    if isinstance(outcome, UserError):
        raise outcome
    return outcome


def save_model(path, params, meta):
    """A model file: weights and meta alone, in format 1 (one HDF5 file, what load and
    model_io.load_model read), written under a temporary name and renamed."""
    tmp = path + ".tmp"
    try:
        with h5py.File(tmp, "w") as f:
            f.create_dataset("params", data=params)
            f.attrs["meta"] = json.dumps(meta)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except OSError as err:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise UserError(f"{path}: not written ({_reason(err)})") from None


def _remove_old(directory, keep):
    names = sorted(n for n in os.listdir(directory)
                   if n.startswith("ckpt-") and not n.endswith(".tmp"))
    for old in names[:-keep]:
        full = os.path.join(directory, old)
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            os.unlink(full)


def latest(run_dir):
    """Path of the newest complete checkpoint of a run, or None."""
    pointer = os.path.join(checkpoint_dir(run_dir), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(checkpoint_dir(run_dir), f.read().strip())
    return path if os.path.exists(path) else None


def verify(path, ranks=None):
    """None when the checkpoint at `path` reads back whole -- its manifest, shared.h5 and the
    rank files of `ranks` (None: all), every dataset read to its last byte -- else why not
    (a truncated or corrupt file, named)."""
    name = path
    try:
        if not os.path.isdir(path):   # format 1: one file
            files = [path]
        else:
            name = os.path.join(path, MANIFEST)   # named in the reason if it is what fails
            with open(name) as f:
                manifest = json.load(f)
            files = [os.path.join(path, SHARED)] + [
                os.path.join(path, rank_file(r)) for r in range(manifest["world"])
                if ranks is None or r in ranks]
        for name in files:
            with h5py.File(name, "r") as f:
                f.visititems(lambda _, obj: obj[()] if isinstance(obj, h5py.Dataset) else None)
    except (OSError, KeyError, ValueError, RuntimeError) as err:
        return f"{_reason(err)} ({name})"
    return None


def newest_intact(run_dir, comm=None):
    """The newest checkpoint of a run that reads back whole on every rank, and the newer ones
    skipped, with the reason: [(path, reason)]. Each of K ranks reads the manifest, the shared
    file and the rank files r = its rank, rank + K, ... (all of them between the ranks; a
    collective with K > 1 ranks, all of which get the same answer)."""
    rank, world = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    skipped = []
    for path in reversed(all_checkpoints(run_dir)):
        reason = verify(path, ranks=range(rank, 1 << 30, world) if world > 1 else None)
        if world > 1:   # the first rank's reason that is not None (small: a string or None)
            reason = next((r for r in comm.allgather(reason) if r), None)
        if reason is None:
            return path, skipped
        skipped.append((path, reason))
    return None, skipped


def all_checkpoints(run_dir):
    """Paths of a run's complete checkpoints, oldest first."""
    directory = checkpoint_dir(run_dir)
    if not os.path.isdir(directory):
        return []
    return [os.path.join(directory, n) for n in sorted(os.listdir(directory))
            if n.startswith("ckpt-") and not n.endswith(".tmp")]


def _read_h5(path, prefix, wanted, arrays):
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: arrays.__setitem__(prefix + name, obj[()])
                     if isinstance(obj, h5py.Dataset) and wanted(prefix + name) else None)


def read_meta(path):
    """The meta dict of a checkpoint (either format) without reading any array."""
    try:
        if os.path.isdir(path):
            with open(os.path.join(path, MANIFEST)) as f:
                return json.load(f)["meta"]
        with h5py.File(path, "r") as f:
            return json.loads(f.attrs["meta"])
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"checkpoint {path}: unreadable ({err})") from None


def load(path, rank=None, names=None):
    """(arrays dict, meta dict) of a checkpoint, with a clear error for a bad file.
    rank: read the shared arrays and only this rank's (under rank_prefix(rank)); None = all.
    names: read only these arrays (e.g. ("params",) for evaluation)."""
    def wanted(name):
        if names is not None:
            return name in names
        return rank is None or not name.startswith("rank") or name.startswith(rank_prefix(rank))

    arrays = {}
    try:
        if not os.path.isdir(path):   # format 1: one file
            _read_h5(path, "", wanted, arrays)
            return arrays, read_meta(path)
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
        _read_h5(os.path.join(path, SHARED), "", wanted, arrays)
        for r in range(manifest["world"]):
            if rank is None or r == rank or (names is not None and any(
                    n.startswith(rank_prefix(r)) for n in names)):
                _read_h5(os.path.join(path, rank_file(r)), rank_prefix(r), wanted, arrays)
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"checkpoint {path}: unreadable ({err})") from None
    return arrays, manifest["meta"]


def check_compatible(path, meta, expected):
    """Refuse a checkpoint whose model shape or label inventory differs from this run's."""
    for key, want in expected.items():
        got = meta.get(key)
        if got != want:
            raise UserError(f"checkpoint {path}: {key} is {got!r} but this run has {want!r}; "
                            f"use a fresh train.run_dir or the matching config/archive")
