"""What users would run instead: the same model trained by PyTorch, timed by `bench train
--pytorch` in the same rounds as hpcsgd's step (so both see the same neighbours).

The standard recipe: nn.Sequential of Linear + Sigmoid (or ReLU) layers (an LSTM model:
nn.LSTM on time-major input + Linear, SequenceModel), CrossEntropyLoss
(summed, as hpcsgd sums), torch.optim.SGD with momentum, zero_grad / forward / backward /
step; the threads of the process set with torch.set_num_threads (the same count hpcsgd's rank
gets). At K > 1 ranks: DistributedDataParallel over gloo (PyTorch's CPU backend), one process
per MPI rank, the process group found through a TCP port rank 0 picks and broadcasts; each
rank trains its share of the global minibatch, DDP allreduces the float32 gradients.

PyTorch is not a dependency of hpcsgd (`pip install torch==2.13.0` beside it for this
comparison); --pytorch fails with a clear error without it.
"""
import socket
import time

import numpy as np


def SequenceModel(torch, shape, act):
    """A (B)LSTM as PyTorch users write it: one nn.LSTM over the layers (nn.LSTM modules
    stacked where the layers' sizes differ), the bottleneck Linear layers, a Linear output;
    (T, B, D) in, (T*B, labels) logits out."""
    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            cells, bi = shape["cells"], shape["bidirectional"]
            groups, n_in = [], shape["input_dim"]
            for c in cells:   # runs of equal sizes: one multi-layer nn.LSTM each
                if groups and groups[-1][0] == c:
                    groups[-1][1] += 1
                else:
                    groups.append([c, 1])
            self.lstms = torch.nn.ModuleList()
            for c, layers in groups:
                self.lstms.append(torch.nn.LSTM(n_in, c, num_layers=layers, bidirectional=bi))
                n_in = c * (2 if bi else 1)
            head = []
            for width in shape["bottleneck"]:
                head += [torch.nn.Linear(n_in, width), act()]
                n_in = width
            head.append(torch.nn.Linear(n_in, shape["num_labels"]))
            self.head = torch.nn.Sequential(*head)

        def forward(self, x):
            for lstm in self.lstms:
                x, _ = lstm(x)
            return self.head(x.reshape(-1, x.shape[-1]))
    return Net()


class TorchRank:
    def __init__(self, comm, shape, activation, max_local, threads, lr=1e-6, momentum=0.9):
        try:
            import torch
        except ImportError:
            raise SystemExit("bench train --pytorch: PyTorch is not installed "
                             "(pip install torch==2.13.0)") from None
        self.torch, self.comm = torch, comm
        self.rank, self.world = comm.Get_rank(), comm.Get_size()
        torch.set_num_threads(threads)
        torch.manual_seed(0)   # replicas start equal, as hpcsgd's do
        act = torch.nn.Sigmoid if activation == "sigmoid" else torch.nn.ReLU
        self.steps = shape["steps"] if shape.get("type") == "lstm" else None
        if self.steps:   # nn.LSTM on time-major (T, B, D) input, the usual recipe
            self.model = SequenceModel(torch, shape, act)
        else:
            dims = [shape["input_dim"], *shape["hidden"]]
            layers = []
            for n_in, n_out in zip(dims[:-1], dims[1:]):
                layers += [torch.nn.Linear(n_in, n_out), act()]
            layers.append(torch.nn.Linear(dims[-1], shape["num_labels"]))
            self.model = torch.nn.Sequential(*layers)
        if self.world > 1:
            import torch.distributed as dist
            port = None
            if self.rank == 0:
                with socket.socket() as s:   # a free port on this host
                    s.bind(("127.0.0.1", 0))
                    port = s.getsockname()[1]
            port = comm.bcast(port, root=0)   # lowercase: one int, once
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                    rank=self.rank, world_size=self.world)
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum)
        self.loss = torch.nn.CrossEntropyLoss(reduction="sum")
        rng = np.random.default_rng(1 + self.rank)
        self.x = torch.from_numpy(rng.standard_normal((max_local, shape["input_dim"]),
                                                      dtype=np.float32))
        self.y = torch.from_numpy(rng.integers(0, shape["num_labels"], max_local))

    def loop(self, take, steps, warmup):
        """`steps` timed training steps after `warmup`, take[rank] frames each: (this rank's
        step times, seconds per step by category, {}) as hpcsgd's loop reports them -- all of
        it "compute": DDP runs its allreduce inside the backward pass, not apart."""
        n = int(take[self.rank])
        marks = []
        self.comm.Barrier()
        for s in range(warmup + steps):
            marks.append(time.perf_counter())
            self.opt.zero_grad(set_to_none=False)
            x = self.x[:n] if not self.steps else self.x[:n].view(self.steps, -1, self.x.shape[1])
            loss = self.loss(self.model(x), self.y[:n])
            loss.backward()   # DDP: the gradient allreduce overlaps the backward pass
            self.opt.step()
        marks.append(time.perf_counter())
        times = np.diff(marks)[warmup:]
        if not np.isfinite(float(loss.detach())):
            raise FloatingPointError(f"rank {self.rank}: PyTorch loss {float(loss.detach())}")
        return times, {"compute": float(times.mean()), "encode": 0.0, "communicate": 0.0,
                       "update": 0.0}, {}

    def bytes_on_wire(self, size):
        """A ring allreduce of the float32 gradient: 2 (K-1)/K of it per rank."""
        return int(2 * (self.world - 1) * size * 4 / self.world)

    def close(self):
        if self.world > 1:
            self.torch.distributed.destroy_process_group()
