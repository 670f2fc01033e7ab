"""A trained model from disk, for eval, infer, decode, export and fine-tuning: a checkpoint, a
run directory (its latest checkpoint) or an integer model written by `hpcsgd export`; and the
check that an archive fits it.

One module reads both kinds, so that evaluate.py and export.py need not import each other.
The integer file's layout is in export.py's docstring; its int4 packing is here, beside its
inverse.

`eval`, `infer` and `decode` run their forward on the host (--device cpu) or on the rank's GPU
(--device cuda): load_model(..., device="cuda", comm=...) binds the GPU as the trainer does
(one per local rank; ranks that share one are fine: inference needs no NCCL), builds the
network there, and copies the float32 weights to it once. The network then keeps its
preallocated device buffers (max_batch rows, sized once): per minibatch the frames go host ->
device and the outputs device -> host (hpcsgd/model/network.py: forward).
"""
import json
import os

import h5py
import numpy as np

from hpcsgd import checkpoint
from hpcsgd.data import archive
from hpcsgd.data.sequences import sequence_steps  # noqa: F401 (eval, infer, decode read it here)
from hpcsgd.device import DEVICES, assign
from hpcsgd.errors import UserError
from hpcsgd.families import of_model
from hpcsgd.model import build
from hpcsgd.model.flat import FlatParams
from hpcsgd.model.legacy_names import legacy_names

EVAL_BATCH = 1024
FORMAT = "hpcsgd-int"   # an exported model's attrs["format"]


def add_device_argument(parser):
    """--device, for the commands that run a model's forward (eval, infer, decode)."""
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="run the network on the host, or on this rank's GPU (one per "
                             "local rank, as the trainer binds them; docs/gpu.md)")


def bind_device(device, comm=None):
    """--device cuda: select this rank's GPU before anything is allocated on one (its rank on
    the node, from comm's shared-memory split, modulo the GPUs visible; comm None: one
    process, local rank 0). A UserError naming the reason when there is no GPU to run on.
    -> (GPU index, GPUs visible), or None for the host."""
    if device not in DEVICES:
        raise UserError(f"--device {device!r}: expected one of {', '.join(DEVICES)}")
    if device == "cpu":
        return None
    from numba import cuda

    from hpcsgd.comm.gpu import bind_gpu
    why = None
    if not cuda.is_available():   # the simulator (NUMBA_ENABLE_CUDASIM=1) says it is
        try:
            len(cuda.gpus)
            why = "numba.cuda finds no usable GPU"
        except Exception as err:   # CudaSupportError: no driver, no device
            why = " ".join(str(err).split()).rstrip(" :")
    # a job's ranks agree first, so that each names the failure before the first one's exit
    # aborts the job (and a rank with a GPU says which ranks have none)
    if comm is not None and comm.Get_size() > 1:
        whys = comm.allgather(why)   # lowercase: one small object per rank, once
        lacking = [r for r, w in enumerate(whys) if w is not None]
        if lacking and why is None:
            raise UserError(f"--device cuda: rank(s) {lacking} of the job have no CUDA GPU "
                            f"({whys[lacking[0]]}); run with --device cpu")
    if why is not None:
        raise UserError(f"--device cuda: no CUDA GPU is available to this process ({why}); "
                        f"run with --device cpu")
    node_rank = 0
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        node_rank = node.Get_rank()
        node.Free()
    try:
        return bind_gpu(node_rank)
    except RuntimeError as err:
        raise UserError(f"--device cuda: {err}") from None


def load_model(path, max_batch=EVAL_BATCH, device="cpu", comm=None):
    """(model, params, meta) from a checkpoint file, a run directory (its latest one) or a
    model written by `hpcsgd export` (integer weights). device "cuda": the rank's GPU is bound
    (bind_device; comm: the job's communicator, for the local rank), the network built on it,
    and params are device arrays holding the same float32 weights (one host -> device copy)."""
    bind_device(device, comm)
    if is_exported(path):
        model, params, meta = load_exported(path, max_batch, device)
        model.steps = sequence_steps(meta["data"])
        return model, params, meta
    if os.path.isdir(path):
        found = checkpoint.latest(path)
        if found is None:
            raise UserError(f"{path}: no checkpoint in {checkpoint.checkpoint_dir(path)}")
        path = found
    arrays, meta = checkpoint.load(path, names=("params",))   # not the per-rank residuals
    if "params" not in arrays:
        raise UserError(f"checkpoint {path}: no 'params' dataset")
    # the family's fewest rows a pass needs (models of whole utterances: the longest and more)
    max_batch = max(max_batch, of_model(meta["model"]).EVAL_ROWS)
    model = build(meta["model"], max_batch=max_batch, device=device)
    model.steps = sequence_steps(meta["data"])
    params = model.new_params()
    if arrays["params"].shape != params.flat.shape:
        raise UserError(f"checkpoint {path}: {arrays['params'].size} parameters, the model "
                        f"{meta['model']} needs {params.size}")
    assign(params.flat, arrays["params"])
    meta["path"] = path
    return model, params, meta


def check_archive(archive_dir, meta):
    """The archive must match the model's features and label inventory (a CTC model: its
    token inventory, when the archive has that kind of tokens)."""
    index = archive.read_index(archive_dir)
    tokens = meta.get("tokens")
    if tokens:
        kind = tokens["kind"]
        have = index["tokens"].get(kind)
        if have is not None and have["inventory_hash"] != tokens["inventory_hash"]:
            raise UserError(f"{archive_dir}: its {kind} token inventory "
                            f"({have['inventory_hash']}) differs from the model's "
                            f"({tokens['inventory_hash']}); prep it with --token-inventory "
                            f"TRAIN_ARCHIVE")
    elif index["label_inventory_hash"] != meta["label_inventory_hash"]:
        raise UserError(f"{archive_dir}: label inventory {index['label_inventory_hash']} differs "
                        f"from the model's ({meta['label_inventory_hash']}); prep it with the "
                        f"training labels.txt")
    want = meta["model"]["input_dim"] // (2 * meta["data"]["context"] + 1)
    if index["feature_dim"] != want:
        raise UserError(f"{archive_dir}: feature dim {index['feature_dim']}, the model expects {want}")
    return index


def is_exported(path):
    if not os.path.isfile(path):
        return False
    try:
        with h5py.File(path, "r") as f:
            return f.attrs.get("format") == FORMAT
    except OSError:
        return False


def load_exported(path, max_batch, device="cpu"):
    """(model, params, meta) of an exported file: the weights s * k, marked as on their grid
    (model.quant.exported: not quantized again). device "cuda": decoded on the host, then
    copied to the device once."""
    try:
        with h5py.File(path, "r") as f:
            meta = json.loads(f.attrs["meta"])
            bits = int(f.attrs["bits"])
            max_batch = max(max_batch, of_model(meta["model"]).EVAL_ROWS)
            model = build(meta["model"], max_batch=max_batch, device=device)
            params = FlatParams(model.specs, model.dtype)   # on the host
            legacy = legacy_names(model.layers)   # a file written before today's names

            def stored(kind, name):
                key = f"{kind}/{name}"
                return key if key in f or name not in legacy else f"{kind}/{legacy[name]}"
            for spec in model.specs:
                if spec.name in model.quant.weights:
                    d = f[stored("int", spec.name)]
                    size = spec.shape[0] * spec.shape[1]
                    codes = unpack_int4(d[()], size) if bits == 4 else d[()].reshape(-1)
                    step = (f[stored("step", spec.name)][()] if stored("step", spec.name) in f
                            else np.float32(d.attrs["step"]))
                    params[spec.name][...] = codes.astype(np.float32).reshape(spec.shape) * step
                else:
                    params[spec.name][...] = f[stored("float", spec.name)][()]
    except (OSError, KeyError, ValueError) as err:
        raise UserError(f"exported model {path}: unreadable ({err})") from None
    if device != "cpu":
        host, params = params, model.new_params()
        assign(params.flat, host.flat)
    model.quant.exported = True
    meta["path"] = path
    return model, params, meta


def pack_int4(codes):
    """int codes in [-8, 7] (any shape) -> uint8, two per byte, the first in the low nibble."""
    flat = codes.reshape(-1).astype(np.int8)
    if len(flat) % 2:
        flat = np.append(flat, np.int8(0))
    nib = (flat.view(np.uint8) & 0xF)
    return (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)


def unpack_int4(packed, size):
    """pack_int4's inverse: the first `size` codes as int8."""
    nib = np.empty(2 * len(packed), np.uint8)
    nib[0::2], nib[1::2] = packed & 0xF, packed >> 4
    return ((nib[:size].astype(np.int8) ^ 8) - 8).astype(np.int8)
