"""The fully connected DNN acoustic model (the paper's CD-DNN-HMM frame classifier), built from
layers: Dense hidden layers (sigmoid or ReLU) and a softmax output over the labels.

Shape key: D = input dim (spliced features, e.g. 11*40 = 440), H_l = units of hidden layer l,
V = num_labels (senones), L = hidden layers. Parameters "enc.0.w", "enc.0.b", ..., "out.w",
"out.b"; W_l is (n_in, n_out) and y = x @ W_l + b_l, b_l is (1, n_out). A codec column is a row W_l[j, :]
(the fan-out of input unit j), contiguous in memory; a bias is one codec column. Costs per
frame: 2 * sum(n_in * n_out) FLOP forward, the same for dW, and the same less the first layer
for dX (~276 MFLOP for the paper's 46M model).
"""
import numpy as np

from hpcsgd.model.layers import Dense, SoftmaxOutput
from hpcsgd.model.parallel import SplitDense, SplitSoftmax
from hpcsgd.model import network
from hpcsgd.model.network import Network


def dnn_layers(input_dim, hidden, num_labels, activation="sigmoid", group=None):
    """The layers; with a model-parallel group of M > 1 ranks, each split by output columns
    over it (hpcsgd/model/parallel.py)."""
    dims = [int(input_dim), *[int(h) for h in hidden], int(num_labels)]
    pairs = list(enumerate(zip(dims[:-2], dims[1:-1])))
    if group is not None and group.size > 1:
        return ([SplitDense(f"enc.{l}", n_in, n_out, activation, group)
                 for l, (n_in, n_out) in pairs] + [SplitSoftmax("out", dims[-2], dims[-1], group)])
    return ([Dense(f"enc.{l}", n_in, n_out, activation) for l, (n_in, n_out) in pairs]
            + [SoftmaxOutput("out", dims[-2], dims[-1])])


def dnn(input_dim, hidden, num_labels, activation="sigmoid", max_batch=1024,
        dtype=np.float32, device="cpu", precision="float32", qat=None, group=None):
    """The DNN input_dim-hidden...-num_labels as a Network (precision: network.PRECISIONS;
    qat: quantization-aware training, model.quantize; group: a model.parallel.ModelGroup to
    split it over). The description is the unsplit model's, whatever the group: a
    checkpoint holds whole matrices."""
    describe = {"input_dim": int(input_dim), "hidden": [int(h) for h in hidden],
                "num_labels": int(num_labels), "activation": activation,
                **({"qat": dict(qat)} if qat else {})}
    if group is not None and group.size > 1:
        if qat:
            raise ValueError("model parallelism: quantization-aware training is not split yet")
        if precision != "float32":
            raise ValueError("model parallelism: precision float32 only")
        if device != "cpu":
            raise ValueError("model parallelism: CPU ranks only (the split softmax has no "
                             "CUDA kernels yet)")
    return Network(dnn_layers(input_dim, hidden, num_labels, activation, group), max_batch,
                   dtype, device, describe, precision, qat=qat)


def layout(input_dim, hidden, num_labels):
    """[(name, shape), ...] of the DNN's parameters, in flat-buffer order."""
    return [(s.name, s.shape) for layer in dnn_layers(input_dim, hidden, num_labels)
            for s in layer.specs()]


def gemm_flop_per_frame(input_dim, hidden, num_labels):
    """FLOP of the GEMMs of one training frame: forward, dW and dX (no dX for the input)."""
    return network.gemm_flop_per_frame(dnn_layers(input_dim, hidden, num_labels))
