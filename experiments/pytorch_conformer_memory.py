"""Activation memory of a Conformer-CTC training pass, hpcsgd beside PyTorch, on the same
batch: jobs/configs/so762_conformer_ctc.yaml's model, B utterances of T frames (default 10 x
400: the bench's N = 4000).

    python experiments/pytorch_conformer_memory.py [B] [T]

hpcsgd: every buffer a training pass runs in (Network.activation_buffers(): the layers'
outputs, their workspaces, the dropout copies, and the attention's (nb, H, T, T) buffers the
blocks grow), for a model built as the trainer builds it for such batches (max_batch = B x T
rows, max_sequences = B). PyTorch: the bytes of the distinct storages autograd saves for the
backward pass (torch.autograd.graph.saved_tensors_hooks) in the forward and the CTC loss, in
train() mode with the config's dropout: what stays allocated between the passes, not the
transient peak inside a kernel. Neither counts the parameters, gradients or optimizer state.
"""
import sys
from types import SimpleNamespace

import numpy as np
import torch

from hpcsgd import config
from hpcsgd.bench.pytorch import CTCModel
from hpcsgd.data.utterances import Targets
from hpcsgd.model import build
from hpcsgd.model import kernels_dropout as KD
from hpcsgd.train import model_shape

CONFIG = "jobs/configs/so762_conformer_ctc.yaml"


def hpcsgd_bytes(shape, dropout, nb, steps):
    net = build(shape, max_batch=nb * steps, max_sequences=nb)
    net.set_dropout(dropout)
    params, grads = net.new_params(), net.new_params()
    net.init(params, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((nb * steps, shape["input_dim"])).astype(np.float32)
    ids = rng.integers(1, shape["num_tokens"], 40 * nb).astype(np.int32)
    y = Targets(np.full(nb, steps, np.int64), ids, np.arange(nb + 1, dtype=np.int64) * 40,
                KD.utterance_keys(0, 0, np.arange(nb)))
    net.forward_backward(params, grads, x, y, len(x))   # grows the attention's buffers
    buffers = dict(net.activation_buffers())
    for i, layer in enumerate(net.layers):
        for key, a in getattr(layer, "_att", {}).items():
            buffers[f"{i}.att.{key}"] = a
    return sum(a.nbytes for a in buffers.values())


def torch_bytes(shape, dropout, nb, steps):
    torch.manual_seed(0)
    model = CTCModel(torch, {**shape, "dropout": dropout}, torch.nn.ReLU)
    model.train()
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randn(steps, nb, shape["input_dim"])
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, lengths = model(x, torch.full((nb,), steps))
        targets = torch.randint(1, shape["num_tokens"], (nb, 40))
        loss = torch.nn.CTCLoss(blank=0, reduction="sum")(
            logp, targets, lengths, torch.full((nb,), 40))
    loss.backward()
    return sum(seen.values())


def main(argv):
    nb = int(argv[1]) if len(argv) > 1 else 10
    steps = int(argv[2]) if len(argv) > 2 else 400
    cfg = config.load(CONFIG, [])
    cfg["model.frame_ce"] = 0.0   # the torch peer has no frame CE head
    shape = model_shape(cfg, SimpleNamespace(input_dim=40, num_labels=40,
                                             index={"num_labels": 40}))
    ours = hpcsgd_bytes(shape, cfg["model.dropout"], nb, steps)
    theirs = torch_bytes(shape, cfg["model.dropout"], nb, steps)
    print(f"{CONFIG}, {nb} utterances x {steps} frames, train mode, dropout "
          f"{cfg['model.dropout']}: activation memory hpcsgd {ours / 2**20:.1f} MiB, PyTorch "
          f"{theirs / 2**20:.1f} MiB saved for backward ({ours / theirs:.2f}x)")


if __name__ == "__main__":
    main(sys.argv)
