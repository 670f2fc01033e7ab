"""CTC acoustic models (Graves et al. 2006): an encoder over whole utterances (convolutions,
frame stacking, (B)LSTMs: model/encoder.py) and a softmax over the tokens and the blank,
trained with the CTC loss -- DeepSpeech2's and Wav2Letter's recipe.

    net = ctc(40, ["conv 256 k5 s2", "blstm 256", "blstm 256"], num_tokens=40)
    loss, tokens = net.forward_backward(params, grads, x, targets, n)

A batch is nb whole utterances, time-major (x: (T*nb, D), row t*nb + b), sorted by
non-increasing frames, with their token sequences (hpcsgd.data.utterances.Targets: frames,
ids, offsets; token ids 1..V-1, the blank is 0). The encoder's strides shorten every
utterance (model.lengths: ceil(frames / stride) output steps); the output layer's logits
z = x @ W (the bias is added inside the loss kernel) go through the fused CTC loss
(model/kernels_ctc.py on the CPU, kernels_ctc_cuda.py on a GPU, through model/ops.py): the
log-softmax, the forward-backward recursions and the gradient with respect to the logits,
written over them (warp-ctc's contract; nothing of size T*V is stored apart). The loss and
the gradient are summed over the utterances, as every criterion here (per-sample learning
rates, hpcsgd/optim.py): the "samples" are the input frames (Network.frames_in_loss).

An utterance too short for its targets after the subsampling (output steps < tokens +
repeated neighbours: no alignment exists) gets loss 0 and gradient 0; the layer counts them
(CTCOutput.skipped; the trainer logs them).

A frame cross-entropy head (frame_labels=L; model.frame_ce): a second softmax over the
archive's L frame labels on the same encoder output, trained against the alignment's label at
each output step (Targets.labels, hpcsgd.data.utterances) with weight frame_ce beside the CTC
loss -- multi-task CTC + CE, the alignments as a regularizer of the encoder (cf. Kim,
Hori & Watanabe 2017's joint CTC/attention and Sak et al. 2015's CE-initialized CTC: the
alignment's frame boundaries are information CTC alone does not get). Recognition reads the
CTC softmax only; the head's parameters (Wf, bf) stay in the model so its checkpoints load.
"""
import numpy as np

from hpcsgd.device import matmul, zero
from hpcsgd.model.encoder import encoder_layers
from hpcsgd.model.flat import ParamSpec
from hpcsgd.model.layers import SoftmaxOutput, glorot_uniform
from hpcsgd.model.network import Network


class CTCOutput(SoftmaxOutput):
    """The output layer of a CTC model: logits over the tokens, blank first (id 0); its
    criterion is the CTC loss of a batch's token targets."""
    tokens = True   # its loss reads a batch's token targets at the output's Lengths

    def __init__(self, name, n_in, num_tokens, frame_labels=0):
        super().__init__(name, n_in, num_tokens)
        self.skipped = 0   # utterances without an alignment (zero loss), since pop_skipped
        # the frame CE head: its width (0: none) and its weight in training (model.frame_ce,
        # set by the trainer; 0: the head is carried but not trained)
        self.frame_labels, self.frame_ce = int(frame_labels), 0.0
        self.Wf, self.bf = f"{name}.ce.w", f"{name}.ce.b"
        self.gemm_macs = self.n_in * (self.n_out + self.frame_labels)
        # since pop_frame_ce: the head's CE summed (nats), frames with a label, argmax hits
        self.frame_stats = np.zeros(3)

    def specs(self):
        head = [ParamSpec(self.Wf, (self.n_in, self.frame_labels), "weight", "codec", "rows"),
                ParamSpec(self.bf, (1, self.frame_labels), "bias", "codec", "rows")]
        return super().specs() + (head if self.frame_labels else [])

    def init(self, views, rng):
        super().init(views, rng)
        if self.frame_labels:   # drawn after W: a model without the head draws the same W
            glorot_uniform(views[self.Wf], rng)
            views[self.bf][...] = 0

    def workspace(self, max_rows):
        """The head's logits (its dLoss/dz after the loss) and a host product's scratch."""
        if not self.frame_labels:
            return {}
        return {"frame_logits": (max_rows, self.frame_labels), "scratch": (max_rows, self.n_in)}

    def forward(self, p, x, z, ops, progress=None, ws=None):
        super().forward(p, x, z, ops, progress)
        if self.frame_labels:
            matmul(x, p[self.Wf], ws["frame_logits"][:len(z)])

    def loss(self, p, g, z, targets, ops, scale=1.0, lengths=None, ws=None):
        """The CTC loss of z (+ b) against targets at the output's lengths: z becomes
        scale * dLoss/dz (zero on the padding), g's bias its column sums. With the frame CE
        head trained (frame_ce > 0): frame_ce times the head's cross-entropy against
        targets.labels (one per output row, -1: none) is added to the gradient (the head's
        logits become its dLoss/dz), its CE and hits to frame_stats. Returns (CTC loss
        summed over the utterances in nats, unscaled; tokens in the targets)."""
        loss, tokens, skipped = ops.ctc_loss(z, p[self.b], targets, lengths, g[self.b], scale)
        self.skipped += skipped
        if self.frame_ce:
            labels = getattr(targets, "labels", None)
            if labels is None or len(labels) < len(z):
                raise ValueError(f"model.frame_ce: the batch carries no frame labels at the "
                                 f"output's {len(z)} rows (hpcsgd.data.utterances: "
                                 f"label_stride)")
            ce, hits = ops.softmax_xent(ws["frame_logits"][:len(z)], p[self.bf],
                                        labels[:len(z)], g[self.bf], scale * self.frame_ce)
            if ce is not None:   # every output step is labelled, the padding not
                self.frame_stats += (ce, int(np.sum(lengths.lengths)), hits)
        return loss, tokens

    def backward(self, p, g, x, z, dy, dx, ops, progress=None, ws=None):
        super().backward(p, g, x, z, dy, dx, ops, progress)
        if not self.frame_labels:
            return
        if not self.frame_ce:   # a head carried, not trained: no gradient
            zero(g[self.Wf])
            zero(g[self.bf])
            return
        dzf = ws["frame_logits"][:len(z)]
        matmul(x, dzf, g[self.Wf], trans_a=True)
        if dx is not None:   # dLoss/dx = dz W^T + dzf Wf^T
            matmul(dzf, p[self.Wf], dx, trans_b=True, accumulate=True,
                   scratch=ws["scratch"][:len(z)])
        if progress is not None:
            progress()

    def posteriors(self, p, z, ops, log=True, ws=None):
        """The CTC softmax's (log-)posteriors; the head's logits are not read."""
        super().posteriors(p, z, ops, log)

    def pop_frame_ce(self):
        """(CE summed, frames, hits) of the head since the last call, then zero."""
        out, self.frame_stats = self.frame_stats, np.zeros(3)
        return out


def ctc_layers(input_dim, encoder, num_tokens, activation="relu", frame_labels=0):
    layers, n_in = encoder_layers(input_dim, encoder, activation)
    return layers + [CTCOutput("out", n_in, num_tokens, frame_labels)]


def ctc(input_dim, encoder, num_tokens, activation="relu", max_batch=8192, dtype=np.float32,
        device="cpu", precision="float32", qat=None, frame_labels=0, max_sequences=None):
    """The CTC model input_dim-[encoder]-num_tokens as a Network whose passes take whole
    utterances (their Lengths from the batch's targets); frame_labels > 0: with a frame CE
    head over that many labels (the module docstring)."""
    describe = {"type": "ctc", "input_dim": int(input_dim),
                "encoder": [" ".join(str(e).split()) for e in encoder],
                "num_tokens": int(num_tokens), "activation": activation,
                **({"qat": dict(qat)} if qat else {}),
                **({"frame_labels": int(frame_labels)} if frame_labels else {})}
    return Network(ctc_layers(input_dim, encoder, num_tokens, activation, frame_labels),
                   max_batch, dtype, device, describe, precision, qat=qat,
                   max_sequences=max_sequences)
