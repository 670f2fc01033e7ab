"""What both single-process reference loops build from a trainer config: K ranks' loaders in
one process (exactly as the K ranks build theirs), the model, initial params and optimizer."""
import numpy as np

from hpcsgd import optim
from hpcsgd.data.loader import FrameLoader, batch_split
from hpcsgd.model import build as build_model


def build(cfg, K):
    """(batch_of, loaders, model, params, opt) for the config `cfg` and K ranks."""
    gb = cfg["train.minibatch"]
    batch_of = batch_split(gb, K)
    loaders = [FrameLoader(cfg["data.train"], r, K, context=cfg["data.context"],
                           cmvn=cfg["data.cmvn"], seed=cfg["train.seed"],
                           max_batch=int(batch_of[r]), block_frames=cfg["data.block_frames"],
                           buffer_frames=cfg["data.buffer_frames"], prefetch=False)
               for r in range(K)]
    model = build_model({"input_dim": loaders[0].input_dim, "hidden": cfg["model.hidden"],
                         "num_labels": loaders[0].num_labels, "activation": cfg["model.activation"]},
                        max_batch=max(gb, 1024))
    params = model.new_params()
    model.init(params, np.random.default_rng(cfg["train.seed"]))
    assert cfg["optim.adagrad"] != "local"   # per-rank state: not a single-process quantity
    opt = optim.from_config(cfg, params.size)
    return batch_of, loaders, model, params, opt
