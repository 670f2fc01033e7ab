"""Atomic checkpoints of the full training state, so a resumed run continues bit-exactly.

A checkpoint is one HDF5 file `RUN/checkpoints/ckpt-<frames>.h5`: every array of the state
(parameters, optimizer state, codec residuals, ...) as a dataset, and a JSON attribute `meta`
(counters, loader positions, config, model shape, label-inventory hash). It is written under a
temporary name, fsync'ed and renamed; `RUN/checkpoints/latest` then names it. A failed write
(disk full, killed) leaves the previous checkpoint and `latest` untouched.
"""
import json
import os

import h5py
import numpy as np

from hpcsgd.errors import UserError

LATEST = "latest"


def checkpoint_dir(run_dir):
    return os.path.join(run_dir, "checkpoints")


def save(run_dir, frames, arrays, meta, keep=3):
    """Write the state; return its path. Raises UserError (previous checkpoint intact) on failure."""
    directory = checkpoint_dir(run_dir)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"ckpt-{frames:014d}.h5")
    tmp = path + f".tmp.{os.getpid()}"
    try:
        with h5py.File(tmp, "w") as f:
            for name, array in arrays.items():
                f.create_dataset(name, data=np.asarray(array))
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
        reason = getattr(err, "strerror", None) or str(err).splitlines()[0]
        raise UserError(f"checkpoint {path}: write failed ({reason}); the previous "
                        f"checkpoint {previous or '(none)'} is intact") from None
    for old in sorted(n for n in os.listdir(directory)
                      if n.startswith("ckpt-") and n.endswith(".h5"))[:-keep]:
        os.unlink(os.path.join(directory, old))
    return path


def latest(run_dir):
    """Path of the newest complete checkpoint of a run, or None."""
    pointer = os.path.join(checkpoint_dir(run_dir), LATEST)
    if not os.path.isfile(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(checkpoint_dir(run_dir), f.read().strip())
    return path if os.path.isfile(path) else None


def load(path):
    """(arrays dict, meta dict) of a checkpoint, with a clear error for a bad file."""
    try:
        with h5py.File(path, "r") as f:
            arrays = {}
            f.visititems(lambda name, obj: arrays.__setitem__(name, obj[()])
                         if isinstance(obj, h5py.Dataset) else None)
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
