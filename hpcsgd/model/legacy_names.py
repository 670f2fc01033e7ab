"""The parameter names hpcsgd used before names said where a parameter lives.

Until 2026-11-29 the chain's layers named their parameters by their position i in the
network: W{i}/b{i} (dense, convolution, output layer), U{i}f/U{i}b (an LSTM's recurrent
weights), g{i} (a convolution's norm gain), Wf{i}/bf{i} (the CTC output's frame CE head),
and an RNN-T's transducer at position i: W{i}/b{i} (the encoder's projection), E{i} (the
embedding), W{i}p{k}/U{i}p{k}f/b{i}p{k} (the predictor's LSTM k), W{i}p/b{i}p (its
projection), W{i}o/b{i}o (the joint's output); a learned clip value clip_<weight>. Today's
names are enc.2.w, enc.3.u_fwd, out.ce.w, pred.lstm.0.u, joint.out.w ... (the Conformer's
blocks always had such names).

Checkpoints hold one flat buffer in the layers' order, so they load whatever the names; the
files `hpcsgd export --int8|--int4` wrote store one dataset per name, and are read through
this table (hpcsgd/model_io.py: load_exported).
"""
from hpcsgd.model.conv import Conv1d
from hpcsgd.model.ctc import CTCOutput
from hpcsgd.model.layers import Dense, SoftmaxOutput
from hpcsgd.model.lstm import LSTM
from hpcsgd.model.parallel import _Columns
from hpcsgd.model.transducer import Transducer


def _lstm(lstm, prefix, suffix=""):
    """An LSTM's old names: W{prefix}, b{prefix}, U{prefix}f (and U{prefix}b)."""
    old = {lstm.W: f"W{prefix}", lstm.b: f"b{prefix}"}
    old.update({u: f"U{prefix}{d}" for u, d in zip(lstm.U, "fb")})
    return old


def legacy_names(layers):
    """{today's name: the old name} for every parameter whose name changed (a learned clip
    value's too)."""
    old = {}
    for i, layer in enumerate(layers):
        if isinstance(layer, Transducer):
            old.update({layer.W: f"W{i}", layer.b: f"b{i}", layer.E: f"E{i}",
                        layer.Wp: f"W{i}p", layer.bp: f"b{i}p",
                        layer.Wo: f"W{i}o", layer.bo: f"b{i}o"})
            for k, lstm in enumerate(layer.pred):
                old.update(_lstm(lstm, f"{i}p{k}"))
        elif isinstance(layer, LSTM):
            old.update(_lstm(layer, i))
        elif isinstance(layer, (Dense, SoftmaxOutput, Conv1d, _Columns)):
            old.update({layer.W: f"W{i}", layer.b: f"b{i}"})
            if getattr(layer, "g", None):
                old[layer.g] = f"g{i}"
            if isinstance(layer, CTCOutput) and layer.frame_labels:
                old.update({layer.Wf: f"Wf{i}", layer.bf: f"bf{i}"})
    old.update({f"clip_{new}": f"clip_{name}" for new, name in list(old.items())})
    return old
