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
"""
import numpy as np

from hpcsgd.model.encoder import encoder_layers
from hpcsgd.model.layers import SoftmaxOutput
from hpcsgd.model.network import Network


class CTCOutput(SoftmaxOutput):
    """The output layer of a CTC model: logits over the tokens, blank first (id 0); its
    criterion is the CTC loss of a batch's token targets."""
    tokens = True   # its loss reads a batch's token targets at the output's Lengths

    def __init__(self, index, n_in, num_tokens):
        super().__init__(index, n_in, num_tokens)
        self.skipped = 0   # utterances without an alignment (zero loss), since pop_skipped

    def loss(self, p, g, z, targets, ops, scale=1.0, lengths=None):
        """The CTC loss of z (+ b) against targets at the output's lengths: z becomes
        scale * dLoss/dz (zero on the padding), g's bias its column sums. Returns (loss
        summed over the utterances in nats, unscaled; tokens in the targets)."""
        loss, tokens, skipped = ops.ctc_loss(z, p[self.b], targets, lengths, g[self.b], scale)
        self.skipped += skipped
        return loss, tokens


def ctc_layers(input_dim, encoder, num_tokens, activation="relu"):
    layers, n_in = encoder_layers(input_dim, encoder, activation)
    return layers + [CTCOutput(len(layers), n_in, num_tokens)]


def ctc(input_dim, encoder, num_tokens, activation="relu", max_batch=8192, dtype=np.float32,
        device="cpu", precision="float32", qat=None):
    """The CTC model input_dim-[encoder]-num_tokens as a Network whose passes take whole
    utterances (their Lengths from the batch's targets)."""
    describe = {"type": "ctc", "input_dim": int(input_dim),
                "encoder": [" ".join(str(e).split()) for e in encoder],
                "num_tokens": int(num_tokens), "activation": activation,
                **({"qat": dict(qat)} if qat else {})}
    return Network(ctc_layers(input_dim, encoder, num_tokens, activation), max_batch, dtype,
                   device, describe, precision, qat=qat)
