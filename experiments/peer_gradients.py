"""hpcsgd's CTC model and its PyTorch peer (hpcsgd/bench/pytorch.py: CTCModel) on the same
weights and padded batch, in float64: the loss and every parameter's gradient side by side
(experiments/ctc_so762.md: the normalized convolutions). PyTorch is a benchmark
peer, not a dependency: `pip install torch==2.13.0`.

    python experiments/peer_gradients.py [ln|in|none]

Prints the CTC loss of both and, per layer, the largest difference of the weight, gain and
shift gradients against the largest gradient (hpcsgd's CTC kernel computes in float32, so
agreement is to float32 rounding, not float64's).
"""
import sys

import numpy as np
import torch

from hpcsgd.bench.pytorch import CTCModel
from hpcsgd.data.utterances import Targets
from hpcsgd.model.ctc import ctc


def main(norm):
    suffix = "" if norm == "none" else " " + norm
    encoder = [spec + suffix for spec in ("conv 6 k3 s2", "conv 5 k5 d2")]
    dim, tokens = 4, 7
    net = ctc(dim, encoder, tokens, max_batch=128, dtype=np.float64)
    p = net.new_params()
    net.init(p, np.random.default_rng(0))
    p.flat[:] += np.random.default_rng(1).standard_normal(p.size) * 0.1
    peer = CTCModel(torch, {"input_dim": dim, "encoder": encoder, "num_tokens": tokens},
                    torch.nn.ReLU).double()
    convs = [layer["conv"] if suffix else layer for layer in peer.layers]
    with torch.no_grad():   # hpcsgd's W (k*C, F), tap-major, is Conv1d's (F, C, k)
        for i, (conv, layer) in enumerate(zip(convs, peer.layers)):
            k = conv.kernel_size[0]
            W = p[f"W{i}"].reshape(k, conv.in_channels, -1)
            conv.weight[:] = torch.from_numpy(W.transpose(2, 1, 0).copy())
            if suffix:
                layer["norm"].weight[:] = torch.from_numpy(p[f"g{i}"][0])
                layer["norm"].bias[:] = torch.from_numpy(p[f"b{i}"][0])
            else:
                conv.bias[:] = torch.from_numpy(p[f"b{i}"][0])
        last = len(convs)
        peer.out.weight[:] = torch.from_numpy(p[f"W{last}"].T.copy())
        peer.out.bias[:] = torch.from_numpy(p[f"b{last}"][0])
    rng = np.random.default_rng(3)
    lengths, targets = [17, 13, 9], [[1, 2, 3], [4, 4], [5]]
    x = np.zeros((max(lengths), len(lengths), dim))
    for b, n in enumerate(lengths):
        x[:n, b] = rng.standard_normal((n, dim))
    ids = np.concatenate(targets).astype(np.int32)
    offsets = np.cumsum([0] + [len(t) for t in targets]).astype(np.int64)
    grads = net.new_params()
    loss, _ = net.forward_backward(p, grads, x.reshape(-1, dim),
                                   Targets(np.array(lengths, np.int64), ids, offsets), x.size // dim)
    logp, out_lengths = peer(torch.from_numpy(x), torch.tensor(lengths))
    peer_loss = torch.nn.CTCLoss(blank=0, reduction="sum")(
        logp, torch.from_numpy(ids.astype(np.int64)), out_lengths,
        torch.tensor([len(t) for t in targets]))
    peer_loss.backward()
    print(f"encoder {encoder}: CTC loss hpcsgd {loss:.9g}, PyTorch {peer_loss.item():.9g}")
    for i, (conv, layer) in enumerate(zip(convs, peer.layers)):
        k = conv.kernel_size[0]
        pairs = [("W", conv.weight.grad.numpy().transpose(2, 1, 0).reshape(k * conv.in_channels,
                                                                             -1))]
        if suffix:
            pairs += [("g", layer["norm"].weight.grad.numpy()[None]),
                      ("b", layer["norm"].bias.grad.numpy()[None])]
        for name, theirs in pairs:
            ours = grads[f"{name}{i}"]
            print(f"  {name}{i}: max |difference| {np.abs(ours - theirs).max():.2e} "
                  f"(largest gradient {np.abs(ours).max():.2e})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "in")
