"""`hpcsgd average`: the mean of a run's last checkpoints' weights, as one model file.

    hpcsgd average RUN_DIR --last N --out MODEL.h5       the run's N newest checkpoints
    hpcsgd average CKPT CKPT ... --out MODEL.h5          these checkpoints
    hpcsgd decode MODEL.h5 --data ARCHIVE ...            (and eval, infer, export, init_from)

Averaging the weights of the last epochs (icefall's --avg, fairseq's average_checkpoints)
smooths the noise of the last steps' updates out of the weights; a model trained to a small
final learning rate moves little in its last epochs, so N of about a quarter to a third of the
epochs is usual (train.keep_checkpoints must keep them). The mean is taken in float64 and
rounded once to float32. Only the weights are averaged: the file is a model, not a state to
resume (train.resume refuses it; train.init_from takes it).

Every checkpoint must describe the same model (model config, token or label inventory); the
first that does not is named. The file is written under a temporary name and renamed.
"""
import os

import numpy as np

from hpcsgd import checkpoint
from hpcsgd.errors import UserError

EXAMPLES = """examples:
  hpcsgd average runs/ctc/f32_drop03_e100 --last 20 --out runs/ctc/f32_drop03_e100/avg20.h5
  hpcsgd decode runs/ctc/f32_drop03_e100/avg20.h5 --data runs/so762/archive_ctc/cv --greedy"""

SAME = ("model", "data", "tokens", "label_inventory_hash")   # meta keys that must agree


def add_arguments(parser):
    parser.add_argument("sources", nargs="+", metavar="RUN_DIR|CHECKPOINT",
                        help="one run directory (with --last), or the checkpoints to average")
    parser.add_argument("--last", type=int, default=None,
                        help="average the run directory's N newest checkpoints")
    parser.add_argument("--out", required=True, help="the averaged model (HDF5)")


def checkpoints_of(sources, last):
    """The checkpoint paths that the arguments name, oldest first."""
    if last is None:
        for path in sources:
            if not os.path.isfile(path) and not os.path.isfile(
                    os.path.join(path, checkpoint.MANIFEST)):
                raise UserError(f"{path}: not a checkpoint (a run directory needs --last N)")
        return list(sources)
    if len(sources) != 1 or not os.path.isdir(sources[0]):
        raise UserError("--last N takes one run directory")
    found = checkpoint.all_checkpoints(sources[0])
    if last < 1 or last > len(found):
        raise UserError(f"{sources[0]}: --last {last}, but it has {len(found)} checkpoint(s) "
                        f"in {checkpoint.checkpoint_dir(sources[0])} (train.keep_checkpoints "
                        f"sets how many a run keeps)")
    return found[-last:]


def average(paths):
    """(float32 params, meta) of the mean of the checkpoints' weights; the meta is the newest
    checkpoint's, with "averaged": the checkpoints' paths."""
    total, first, first_meta = None, None, None
    for path in paths:
        arrays, meta = checkpoint.load(path, names=("params",))
        if "params" not in arrays:
            raise UserError(f"checkpoint {path}: no 'params' dataset")
        params = arrays["params"]
        if total is None:
            total, first, first_meta, dtype = np.zeros(params.shape), path, meta, params.dtype
        for key in SAME:
            if meta.get(key) != first_meta.get(key):
                raise UserError(f"checkpoint {path}: its {key} ({meta.get(key)!r}) differs "
                                f"from {first}'s ({first_meta.get(key)!r}); average checkpoints "
                                f"of one model")
        if params.shape != total.shape:
            raise UserError(f"checkpoint {path}: {params.size} parameters, {first} has "
                            f"{total.size}")
        total += params
    meta = dict(meta, averaged=[os.path.abspath(p) for p in paths])
    return (total / len(paths)).astype(dtype), meta


def run(args):
    if not args.out.endswith((".h5", ".hdf5")):
        raise UserError(f"--out {args.out}: expected an .h5 file name")
    paths = checkpoints_of(args.sources, args.last)
    params, meta = average(paths)
    checkpoint.save_model(args.out, params, meta)
    print(f"wrote {args.out}: the mean of {len(paths)} checkpoint(s), "
          f"{os.path.basename(paths[0])} .. {os.path.basename(paths[-1])}")
    return 0
