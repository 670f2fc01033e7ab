"""What both single-process reference loops build from a trainer config: K ranks' loaders in
one process (exactly as the K ranks build theirs), the model, initial params and optimizer."""
import numpy as np

from hpcsgd import optim
from hpcsgd.data.loader import FrameLoader, local_batch_size
from hpcsgd.model.dnn import DNN


def build(cfg, K):
    """(batch_of, loaders, model, params, opt) for the config `cfg` and K ranks."""
    gb = cfg["train.minibatch"]
    batch_of = np.array([local_batch_size(gb, r, K) for r in range(K)])
    loaders = [FrameLoader(cfg["data.train"], r, K, context=cfg["data.context"],
                           cmvn=cfg["data.cmvn"], seed=cfg["train.seed"],
                           max_batch=int(batch_of[r]), block_frames=cfg["data.block_frames"],
                           buffer_frames=cfg["data.buffer_frames"], prefetch=False)
               for r in range(K)]
    model = DNN(loaders[0].input_dim, cfg["model.hidden"], loaders[0].num_labels,
                cfg["model.activation"], max_batch=max(gb, 1024))
    params = model.new_params()
    model.init(params, np.random.default_rng(cfg["train.seed"]))
    assert cfg["optim.adagrad"] != "local"   # per-rank state: not a single-process quantity
    opt = optim.Optimizer(params.size, momentum_time_constant=cfg["optim.momentum_tc"],
                          adagrad=cfg["optim.adagrad"],
                          adagrad_time_constant=cfg["optim.adagrad_tc"] or float("inf"),
                          adagrad_eps=cfg["optim.adagrad_eps"],
                          weight_decay=cfg["optim.weight_decay"])
    return batch_of, loaders, model, params, opt
