"""Every training option with its default and a one-line reason, validated once.

A run's configuration = DEFAULTS <- YAML file <- `key=value` command-line overrides. Keys are
dotted (`optim.lr`); an unknown key, a wrong type or a value out of range is fatal and the
message names the dotted key. The resolved config is saved in the run directory.
"""
import difflib
import math

import yaml

from hpcsgd.data import BLOCK_FRAMES, BUFFER_FRAMES
from hpcsgd.errors import UserError
from hpcsgd.families import FAMILIES, family

# key: (default, type, constraint, comment). constraint: None, (lo, hi) inclusive, a tuple
# of allowed values, or (lo, hi, names): a number in range or one of the names. Types: int,
# float, str, bool, list (of ints).
DEFAULTS = {
    # --- data ---
    "data.train": ("", str, None, "training archive (the OUT of hpcsgd prep); required"),
    "data.cv": ("", str, None, "cross-validation archive of held-out speakers ('' = none)"),
    "data.context": (5, int, (0, 50), "splice +-C frames around each frame (11 frames, as Kaldi DNNs); dnn only"),
    "data.chunk": (40, int, (1, 10000), "lstm/tdnn: frames per training sequence (chunk) whose labels are trained"),
    "data.left_context": (0, int, (0, 1000), "lstm: frames fed before each chunk to warm the state up, outside the loss"),
    "data.right_context": (0, int, (0, 1000), "lstm: frames fed after each chunk (the backward direction's warm-up), outside the loss"),
    "data.cmvn": ("meanvar", str, ("none", "mean", "meanvar"), "feature normalisation at load time"),
    "data.cmvn_scope": ("speaker", str, ("speaker", "global", "utterance"),
                        "whose statistics data.cmvn applies: each speaker's, the training "
                        "archive's summed (kept in the checkpoint), or each utterance's own; "
                        "global and utterance are what a deployed recognizer can apply "
                        "(docs/export.md)"),
    "data.block_frames": (BLOCK_FRAMES, int, (1, 1 << 24), "frames per block dealt to ranks"),
    "data.buffer_frames": (BUFFER_FRAMES, int, (1, 1 << 28), "frames shuffled together in RAM"),
    "data.prefetch": (True, bool, None, "load the next buffer in a background thread"),
    "data.tokens": ("phones", str, ("phones", "chars", "bpe"),
                    "ctc: the archive's token sequences the model learns (hpcsgd prep --tokens)"),
    "data.max_frames": (0, int, (0, 1 << 30),
                        "ctc: leave out utterances longer than this many frames (0 = none; "
                        "counted and named in the log)"),
    "data.bucket_frames": (0, int, (0, 1 << 40),
                           "ctc: frames per length bucket of whole utterances (0 = 4 minibatches)"),
    "data.sortagrad": (False, bool, None,
                        "ctc: the first epoch's length buckets shortest first (DeepSpeech2's "
                        "SortaGrad), then shuffled"),
    "data.specaugment": (False, bool, None,
                         "ctc: SpecAugment's frequency and time masks on the training utterances "
                         "(drawn per seed, epoch and utterance: a resume masks the same)"),
    "data.specaug_freq_masks": (2, int, (0, 100), "specaugment: frequency masks per utterance"),
    "data.specaug_freq_width": (10, int, (0, 10000), "specaugment: widest frequency mask (bins)"),
    "data.specaug_time_masks": (2, int, (0, 100), "specaugment: time masks per utterance"),
    "data.specaug_time_width": (40, int, (0, 100000), "specaugment: widest time mask (frames)"),
    "data.specaug_time_ratio": (0.2, float, (0.0, 1.0),
                                "specaugment: a time mask covers at most this share of the utterance"),
    # --- model ---
    "model.type": ("dnn", str, tuple(FAMILIES),
                   "dnn: spliced frames through Dense layers; lstm: (B)LSTM layers over chunks "
                   "(data.chunk, data.left_context, data.right_context); tdnn: model.encoder's "
                   "layers (time convolutions, LSTMs) over chunks; ctc: model.encoder over "
                   "whole utterances, CTC over data.tokens (docs/ctc.md); rnnt: the same "
                   "encoder, a prediction network and a joint, the RNN-T loss (docs/rnnt.md)"),
    "model.predictor": (["lstm 256"], list, None,
                        "rnnt: the prediction network's layers over the token embedding "
                        "('lstm H' only: it is causal)"),
    "model.embed": (64, int, (1, 1 << 16), "rnnt: the prediction network's token embedding size"),
    "model.joint": (256, int, (1, 1 << 16),
                    "rnnt: the joint network's width (both projections, before the tanh)"),
    "model.joint_mode": ("add", str, ("add", "mul"),
                         "rnnt: how the joint combines the encoder and prediction projections: "
                         "add (Graves) or mul (IBM, Saon et al. 2021)"),
    "rnnt.fastemit_lambda": (0.0, float, (0.0, 1.0),
                             "rnnt: FastEmit's lambda (Yu et al. 2021; 0 = plain RNN-T): label "
                             "emissions' gradients times 1 + lambda, for streaming models"),
    "rnnt.joint_memory_mb": (256, int, (1, 1 << 20),
                             "rnnt: the joint's hidden values and logits of a sub-batch of "
                             "utterances stay under this many MiB (an utterance larger runs alone)"),
    "model.encoder": ([], list, None,
                      "tdnn/ctc: the encoder's layers, e.g. ['conv 256 k5 s2', 'blstm 320'] "
                      "(conv F kK [sS] [dD] [ahead], stack K, blstm H, lstm H, dense F: "
                      "hpcsgd/model/encoder.py)"),
    "model.hidden": ([512, 512, 512], list, (1, 1 << 16), "hidden layer sizes of the DNN"),
    "model.cells": ([320, 320, 320], list, (1, 1 << 16), "lstm: cells per direction of each LSTM layer"),
    "model.bidirectional": (True, bool, None, "lstm: a BLSTM (outputs [forward | backward])"),
    "model.bottleneck": ([], list, (1, 1 << 16),
                         "lstm: Dense layers (model.activation) between the LSTM layers and the softmax"),
    "model.dropout": (0.0, float, (0.0, 0.9),
                      "ctc/rnnt: drop each encoder layer's output (not frame stacking's) with "
                      "this probability in training, masks keyed by utterance "
                      "(hpcsgd/model/kernels_dropout.py); 0 = off"),
    "model.frame_ce": (0.0, float, (0.0, 100.0),
                       "ctc: the weight of a frame cross-entropy head beside the CTC loss, "
                       "trained on the alignment's frame labels at the encoder's output rate "
                       "(data.train prepped with --alignments; model/ctc.py); 0 = no head"),
    "model.activation": ("sigmoid", str, ("sigmoid", "relu"),
                         "hidden nonlinearity (the paper: sigmoid; convolutions: relu)"),
    "model.parallel": (1, int, (1, 4096),
                       "M: split every layer of the DNN by output columns over M consecutive "
                       "ranks (a model group); the job's ranks are D data x M model (docs/parallel.md)"),
    "model.activation_codec": ("float32", str, ("float32", "float16", "dettmers", "dettmers_linear"),
                               "model.parallel > 1: activations and their gradients between the "
                               "model ranks as float32, float16, or Dettmers' 8-bit dynamic tree "
                               "or linear type (abs-max scaled, no error feedback)"),
    "model.codec_columns": ("whole", str, ("whole", "slice"),
                            "model.parallel > 1: a gradient codec's column statistics (1-bit's "
                            "two means) over the whole column, added over the model group (the "
                            "unsplit model's quantization), or over each rank's slice"),
    "model.activation_block": (0, int, (0, 1 << 30),
                               "dettmers activations: values per abs-max scale (0 = one per "
                               "frame's row of a rank's block)"),
    # --- quantization-aware training (docs/qat.md) ---
    "qat.weights": ("none", str, ("none", "max", "sawb", "pact"),
                    "fake-quantize every weight matrix: clip at max |W|, SAWB's alpha, or a learned alpha"),
    "qat.weight_bits": (8, int, (2, 8), "weights: 2^b - 1 symmetric levels (+-7 at 4 bits)"),
    "qat.first_layer": ("auto", str, ("auto", "float", "quantized"),
                        "the first layer's weights and input: float (the INT4 paper's RNN-T "
                        "recipe) or quantized like the rest; auto: float for model.type=rnnt, "
                        "quantized for the others"),
    "qat.weight_scale": ("tensor", str, ("tensor", "channel"),
                         "weights max/sawb: one clip value per matrix, or per output unit "
                         "(a column of W)"),
    "qat.activations": ("none", str, ("none", "max", "sawb", "pact", "bac"),
                        "fake-quantize every GEMM input (and an LSTM's h_t-1 on [-1, 1]): "
                        "dynamic max or SAWB, learned range (PACT), or BAC (PACT on the input "
                        "layer, the activation's fixed bounds elsewhere)"),
    "qat.activation_bits": (8, int, (2, 8), "activations: bits per value"),
    "qat.pact_init": (4.0, float, (0.0, 1e6),
                      "pact/bac: a learned input range starts at +-this where the input has no bound"),
    "qat.clip_decay": (1e-4, float, (0.0, 1.0),
                       "pact/bac: L2 per sample on the learned clip values (PACT's pull inwards)"),
    # --- optimiser (learning rates are per sample: the summed gradient is scaled by lr) ---
    "optim.lr": (0.002, float, (0.0, 10.0), "learning rate per sample"),
    "optim.type": ("sgd", str, ("sgd", "adam"),
                   "sgd (+ momentum, AdaGrad) or adam: Adam computed where the sum is, by each "
                   "stripe's owner on 1/K of its state (docs/exchange.md)"),
    "optim.adam_beta1": (0.9, float, (0.0, 0.999999), "adam: first-moment decay per step"),
    "optim.adam_beta2": (0.999, float, (0.0, 0.999999), "adam: second-moment decay per step"),
    "optim.adam_eps": (1e-8, float, (0.0, 1.0), "adam: added to the RMS (per-sample units)"),
    "optim.adam_variance": ("owner", str, ("owner", "local"),
                            "adam: the second moment of the summed gradient, where the sum is "
                            "(owner), or of each rank's own float32 gradient before the codec "
                            "(local: the codec's error never enters it; docs/exchange.md)"),
    "optim.adam_freeze_variance": (False, bool, None,
                                   "adam + exchange.cold_start_frames: the second moment stops "
                                   "at the cold start's end (1-bit Adam's rule: the codec's "
                                   "error would enter it; docs/exchange.md)"),
    "optim.momentum_tc": (1024.0, float, (0.0, 1e9), "momentum time constant in samples (CNTK); 0 = none"),
    "optim.adagrad": ("off", str, ("off", "local", "aggregate", "after_momentum"),
                      "AdaGrad placement (paper Table 3)"),
    "optim.adagrad_tc": (0.0, float, (0.0, 1e12), "AdaGrad time constant in samples; 0 = all history"),
    "optim.adagrad_eps": (1e-8, float, (0.0, 1.0), "added to the AdaGrad RMS (per-sample units)"),
    "optim.weight_decay": (0.0, float, (0.0, 1.0), "L2 per sample, added to the gradient"),
    # --- learning-rate schedule ---
    "schedule.type": ("newbob", str, ("constant", "step", "newbob", "linear"),
                      "how the learning rate decays (linear: to 0 at the last frame of train.epochs)"),
    "schedule.step_frames": (1_000_000, int, (1, 1 << 50), "step: decay every this many frames"),
    "schedule.factor": (0.5, float, (0.0, 1.0), "step/newbob: multiply the rate by this"),
    "schedule.newbob_threshold": (0.005, float, (0.0, 1.0),
                                  "newbob: decay once CV frame accuracy gains less (0.005 = half a point)"),
    "schedule.warmup_frames": (0, int, (0, 1 << 50),
                               "the rate ramps linearly from 0 over this many frames, then the "
                               "schedule's (Transformers and Conformers need it; 0: none)"),
    # --- gradient exchange over ranks (docs/exchange.md) ---
    "exchange.aggregation": ("allreduce", str, ("allreduce", "striped"),
                             "allreduce = float sum in place; striped = Seide's O(1) quantized stripes"),
    "exchange.allreduce_dtype": ("float32", str, ("float32", "float16"),
                                 "allreduce: float16 halves the bytes (pre-divided by K; ~3 digits)"),
    "exchange.codec": ("onebit", str, ("onebit", "kbit", "dettmers", "float32", "float16"),
                       "striped: gradient codec (docs/codecs.md)"),
    "exchange.error_feedback": (True, bool, None,
                                "striped: carry quantization error to the next step (false = baseline)"),
    "exchange.bits": (4, int, (2, 8, ("oland_raj", "mqgrad")),
                      "striped + kbit: bits per value, or chosen every bits_every_steps steps by "
                      "a rule: oland_raj (more bits for a larger gradient norm; a reconstruction) "
                      "or mqgrad (SARSA on the loss; docs/exchange.md, 'Adaptive bit width')"),
    "exchange.bits_start": (2, int, (2, 8), "oland_raj/mqgrad: the width of the first steps"),
    "exchange.bits_every_steps": (5, int, (1, 1 << 20), "oland_raj/mqgrad: decide every T steps (paper 5)"),
    "exchange.bits_time": ("step", str, ("step", "exchange", "model"),
                           "mqgrad: reward's time per step at a width: the measured step seconds, "
                           "the measured exchange seconds, or the authors' model 5 + 5 bits "
                           "(deterministic)"),
    "exchange.mqgrad_alpha": (0.1, float, (0.0, 1.0), "mqgrad: loss smoothing (paper 0.01, code 0.1)"),
    "exchange.mqgrad_epsilon": (0.1, float, (0.0, 1.0), "mqgrad: probability of the non-greedy action"),
    "exchange.mqgrad_lr": (0.05, float, (0.0, 10.0), "mqgrad: SARSA step size (paper 0.1, code 0.05)"),
    "exchange.mqgrad_discount": (0.9, float, (0.0, 1.0), "mqgrad: SARSA discount (code 0.9)"),
    "exchange.mqgrad_hidden": (10, int, (1, 1024), "mqgrad: ReLU units of the Q network (paper 10)"),
    "exchange.mqgrad_reward_scale": (300.0, float, (0.0, 1e12), "mqgrad: reward = -slope x this / time"),
    "exchange.cold_start_frames": (0, int, (0, 1 << 50),
                                   "striped + a lossy codec: the first N frames exchange float32 "
                                   "(the paper's cold start), then the codec with zeroed residuals; "
                                   "so762: 200000, a third of an epoch (docs/results.md)"),
    "exchange.kbit_range": ("minmax", str, ("minmax", "rms"), "striped + kbit: per-column range rule"),
    "exchange.dettmers_type": ("dynamic_tree", str, ("linear", "mantissa", "static_tree", "dynamic_tree"),
                               "striped + dettmers: 8-bit data type"),
    "exchange.dettmers_block": (0, int, (0, 1 << 40),
                                "striped + dettmers: values per abs-max scale (0 = one per stripe "
                                "of a matrix, the paper; up to 16384 the encode takes each "
                                "block's max in its one read of memory)"),
    "exchange.dettmers_refresh": (1, int, (1, 1 << 20),
                                  "striped + dettmers: take the abs-max every N encodes (the "
                                  "paper's fast setting: 50); in between, values past the stale "
                                  "max clip and error feedback carries the rest"),
    "exchange.fuse_owner": (True, bool, None,
                            "striped + onebit, CPU ranks: decode-sum, post-process and re-encode "
                            "the owner's stripe in one pass per column (same bits; false = 3 passes)"),
    "exchange.double_buffering": (False, bool, None,
                                  "split each step in halves; exchange one while computing the next (paper 2.2)"),
    "exchange.progress": ("test", str, ("none", "test", "thread"),
                          "double buffering: MPI_Test the exchange in flight after each GEMM, "
                          "or from a thread every ms (MPI progresses it only inside MPI calls)"),
    "exchange.overlap": ("auto", str, ("auto", "true", "false"),
                         "allreduce, CPU ranks: sum each layer's gradient while the layers below "
                         "it run their backward (MPI_Test after each GEMM; auto = where it "
                         "applies: docs/exchange.md, 'Overlapped allreduce')"),
    "exchange.bucket_mb": (1.0, float, (0.0, 1e6),
                           "overlap: the smallest bucket in MiB; a layer's gradient below it waits "
                           "for the next layer's (0 = a bucket per layer; PyTorch DDP's first: 1)"),
    "exchange.mpi_cuda_aware": ("auto", str, ("auto", "true", "false"),
                                "GPU ranks: hand device buffers to MPI (auto = ask the library; "
                                "else staged through pinned host memory)"),
    "exchange.nccl": ("auto", str, ("auto", "true", "false"),
                      "GPU ranks + allreduce: sum with NCCL (auto = when CuPy's NCCL loads)"),
    # --- the run ---
    "train.device": ("cpu", str, ("cpu", "cuda"),
                     "cuda = GPU ranks: model, gradients, optimizer and exchange on the GPU "
                     "(one per local rank)"),
    "train.precision": ("float32", str, ("float32", "mixed", "bf16"),
                        "mixed = float16 activations, gradients and weight copy, float32 "
                        "master weights and optimizer; bf16 = the same in bfloat16, without "
                        "loss scaling (docs/precision.md)"),
    "train.loss_scale": ("none", str, ("none", "static", "backoff", "logmax"),
                         "loss scaling; a step whose gradient overflows is skipped on every "
                         "rank (none: an overflow is an error)"),
    "train.loss_scale_init": (16777216.0, float, (2.0 ** -24, 2.0 ** 64),
                              "static: the scale; backoff: the first scale (OpenSeq2Seq: 2^24)"),
    "train.loss_scale_min": (2.0 ** -16, float, (2.0 ** -24, 2.0 ** 64),
                             "backoff/logmax: the smallest scale (a power of two; below 1 "
                             "because the loss is summed over up to ~2^16 frames, not averaged)"),
    "train.loss_scale_max": (16777216.0, float, (2.0 ** -24, 2.0 ** 64),
                             "backoff/logmax: the largest scale (a power of two)"),
    "train.loss_scale_window": (2000, int, (1, 1 << 40),
                                "backoff: double the scale after this many steps without an overflow"),
    "train.threads": (0, int, (0, 1024),
                      "BLAS and Numba threads per rank; 0 = decide: OMP_NUM_THREADS, else "
                      "SLURM_CPUS_PER_TASK, else this rank's cores / the ranks sharing them"),
    "train.minibatch": (256, int, (1, 1 << 20),
                        "global minibatch in frames, split over ranks (lstm: minibatch / data.chunk "
                        "chunks; ctc: whole utterances of up to this many frames in all)"),
    "train.clip_gradient_norm": (0.0, float, (0.0, 1e9),
                                 "clip each rank's summed gradient to this 2-norm per frame before "
                                 "the exchange (0 = off)"),
    "train.epochs": (4, int, (1, 100000), "passes over the training data"),
    "train.init_from": ("", str, None,
                        "start from this checkpoint's (or run directory's) weights: a fine-tune "
                        "with a fresh optimizer and schedule (e.g. float -> quantization-aware)"),
    "train.init_from_part": ("auto", str, ("auto", "encoder"),
                             "what train.init_from takes: auto = the family's rule (all of a "
                             "checkpoint of this kind; an RNN-T's encoder from a CTC one); "
                             "encoder = a CTC or RNN-T checkpoint's encoder layers only, of any "
                             "token inventory (the output layers from their init): an encoder "
                             "trained on another corpus or tokens"),
    "train.seed": (0, int, (0, 2**32 - 1), "seeds init, shuffling and everything random"),
    "train.run_dir": ("runs/run", str, None, "logs, metrics, checkpoints and plots go here"),
    "train.log_every_frames": (20000, int, (1, 1 << 50), "console/metrics line every this many frames"),
    "train.log_every_seconds": (30.0, float, (0.0, 1e7),
                                "... and at least this often (rank 0's clock; 0 = by frames only)"),
    "train.checkpoint_every_frames": (0, int, (0, 1 << 50), "checkpoint mid-epoch (0 = epoch ends only)"),
    "train.keep_checkpoints": (3, int, (1, 1000), "how many recent checkpoints to keep"),
    "train.resume": ("auto", str, None, "auto = latest checkpoint in run_dir if any; none; or a path"),
    "train.stop_after_frames": (0, int, (0, 1 << 50), "stop (with a checkpoint) after this many frames (0 = never; for tests)"),
    "train.probe_every_frames": (0, int, (0, 1 << 50),
                                 "automatic minibatch size: probe at the start and every N frames (0 = off)"),
    "train.probe_frames": (50000, int, (1, 1 << 40), "frames each candidate size trains on in a probe"),
    "train.probe_margin": (0.01, float, (0.0, 10.0),
                           "keep the largest size whose CE is within this fraction of the best"),
    "train.probe_max_minibatch": (8192, int, (1, 1 << 20),
                                  "probe cap on the global minibatch; sizes the preallocated workspaces"),
    "train.check_every_steps": (0, int, (0, 1 << 30), "cross-rank weight checksum every N steps (0 = epoch ends)"),
    "train.diverged_ce_factor": (3.0, float, (0.0, 1e6),
                                 "stop with an error once a log window's or an epoch's train cross-entropy "
                                 "exceeds this x ln(labels) nats/frame (untrained: about 1x; 0 = never)"),
    "train.tensorboard": (True, bool, None,
                          "rank 0 writes TensorBoard event files to run_dir/tensorboard/ as the "
                          "run goes (tensorboard --logdir runs/; docs/tensorboard.md)"),
    "train.cuda_graphs": (False, bool, None,
                          "GPU ranks: capture each forward+backward shape as a CUDA Graph and "
                          "replay it (hpcsgd/graphs.py; not with qat.*)"),
    "train.timeline": (False, bool, None,
                       "write a Chrome trace per rank to run_dir/timeline/ (Perfetto, chrome://tracing)"),
    "train.timeline_steps": (200, int, (0, 1 << 40), "steps the timeline records (0 = all)"),
    "train.watchdog_s": (600.0, float, (0.0, 1e7),
                         "abort the job when a rank makes no progress for this long (a dead peer; 0 = off)"),
}


STRING_LISTS = {"model.encoder", "model.predictor"}   # lists of strings (the other lists hold integers)


def _check(key, value):
    default, kind, constraint, _ = DEFAULTS[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is float and isinstance(value, str):
        try:   # YAML 1.1 reads 1e-9 (no decimal point) as a string; it is a float here
            value = float(value)
        except ValueError:
            pass
    if key in STRING_LISTS:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"config key {key}: expected a list of strings, got {value!r}")
        return [" ".join(v.split()) for v in value]
    if kind is list:
        may_be_empty = not default   # a list whose default is empty (model.bottleneck)
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                  for v in value) or not (value or may_be_empty):
            raise UserError(f"config key {key}: expected a {'' if may_be_empty else 'non-empty '}"
                            f"list of integers, got {value!r}")
        if constraint and not all(constraint[0] <= v <= constraint[1] for v in value):
            raise UserError(f"config key {key}: values must be in {constraint[0]}..{constraint[1]}")
        return value
    if isinstance(constraint, tuple) and len(constraint) == 3 and value in constraint[2]:
        return value   # a name where a number may also go (exchange.bits = mqgrad)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        names = (f" or one of {', '.join(constraint[2])}"
                 if isinstance(constraint, tuple) and len(constraint) == 3 else "")
        raise UserError(f"config key {key}: expected {kind.__name__}{names}, got {value!r} "
                        f"({type(value).__name__})")
    if isinstance(constraint, tuple) and constraint and isinstance(constraint[0], str):
        if value not in constraint:
            raise UserError(f"config key {key}: {value!r} is not one of {', '.join(constraint)}")
    elif constraint is not None and not constraint[0] <= value <= constraint[1]:
        names = f" or one of {', '.join(constraint[2])}" if len(constraint) == 3 else ""
        raise UserError(f"config key {key}: {value!r} outside {constraint[0]}..{constraint[1]}{names}")
    return value


def _flatten(tree, prefix=""):
    flat = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            flat.update(_flatten(value, key + "."))
        else:
            flat[key] = value
    return flat


# names users bring from other trainers -> our key
SYNONYMS = {"learning_rate": "optim.lr", "lr": "optim.lr", "momentum": "optim.momentum_tc",
            "batch_size": "train.minibatch", "minibatch_size": "train.minibatch",
            "batch": "train.minibatch", "num_epochs": "train.epochs", "max_epochs": "train.epochs",
            "hidden_sizes": "model.hidden", "layers": "model.hidden", "num_threads": "train.threads",
            "weight_decay": "optim.weight_decay", "l2": "optim.weight_decay",
            "codec": "exchange.codec", "compression": "exchange.codec", "seed": "train.seed"}


def suggest(key):
    """The key a user most likely meant: a known synonym of the last part, else the closest
    key, else the closest by its last part."""
    section, _, name = key.rpartition(".")
    if name in SYNONYMS:
        return SYNONYMS[name]
    close = difflib.get_close_matches(key, DEFAULTS, n=1, cutoff=0.75)
    if close:
        return close[0]
    by_name = {k.split(".", 1)[1]: k for k in DEFAULTS if not section or k.startswith(section + ".")}
    close = difflib.get_close_matches(name, by_name, n=1, cutoff=0.6)
    return by_name[close[0]] if close else None


def _set(config, key, value, origin):
    if key not in DEFAULTS:
        close = suggest(key)
        hint = f" (did you mean {close}?)" if close else " (hpcsgd train --help-config lists all)"
        raise UserError(f"{origin}: unknown config key {key}{hint}")
    config[key] = _check(key, value)


def load(path=None, overrides=()):
    """Resolve DEFAULTS <- YAML file <- ['key=value', ...]; returns a flat {dotted key: value}."""
    config = {k: v[0] for k, v in DEFAULTS.items()}
    if path:
        try:
            with open(path) as f:
                tree = yaml.safe_load(f) or {}
        except OSError as err:
            raise UserError(f"config {path}: {err.strerror}") from None
        except yaml.YAMLError as err:
            raise UserError(f"config {path}: not valid YAML ({err})") from None
        if not isinstance(tree, dict):
            raise UserError(f"config {path}: expected a mapping of sections")
        for key, value in _flatten(tree).items():
            _set(config, key, value, f"config {path}")
    for item in overrides:
        if "=" not in item:
            raise UserError(f"override {item!r}: expected key=value")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text) if text != "" else ""
        except yaml.YAMLError:
            value = text
        if DEFAULTS.get(key, (None, str))[1] is str and not isinstance(value, str):
            value = text  # a path like 123 or a name like 'none' stays a string
        _set(config, key, value, "command line")
    if not config["data.train"]:
        raise UserError("config key data.train: required (the training archive directory)")
    for key in ("train.loss_scale_min", "train.loss_scale_max"):
        if math.frexp(config[key])[0] != 0.5:
            raise UserError(f"config key {key}: {config[key]!r} is not a power of two (scaling "
                            f"by one is exact in float32)")
    if config["optim.type"] == "adam" and config["optim.adagrad"] != "off":
        raise UserError(f"config keys optim.type=adam and optim.adagrad="
                        f"{config['optim.adagrad']}: Adam normalises by its own second moment; "
                        f"set optim.adagrad=off")
    if config["optim.adam_freeze_variance"] and (config["optim.type"] != "adam"
                                                 or not config["exchange.cold_start_frames"]):
        raise UserError("config key optim.adam_freeze_variance: freezes Adam's second moment "
                        "when the compressed exchange starts; it needs optim.type=adam and "
                        "exchange.cold_start_frames > 0 (the float32 warm-up it is learned in)")
    if config["optim.adam_variance"] == "local" and (config["optim.type"] != "adam"
                                                     or config["optim.adam_freeze_variance"]):
        raise UserError("config key optim.adam_variance=local: Adam's second moment learned "
                        "from each rank's float32 gradient; it needs optim.type=adam, and "
                        "optim.adam_freeze_variance=false (the codec's error never enters a "
                        "local second moment: nothing to freeze it against)")
    if config["train.init_from_part"] != "auto" and not config["train.init_from"]:
        raise UserError(f"config key train.init_from_part={config['train.init_from_part']}: "
                        f"says what train.init_from takes, and train.init_from is not set")
    # the model family's own rules (hpcsgd/families/: encoder, chunks, heads, what a model of
    # whole utterances does not train with)
    family(config["model.type"]).check_config(config)
    if config["model.parallel"] > 1:
        splits = "|".join(name for name, fam in FAMILIES.items() if fam.SPLITS)
        fits = {"model.type": family(config["model.type"]).SPLITS,
                "train.precision": config["train.precision"] == "float32",
                "train.device": config["train.device"] == "cpu"}
        for key, want in (("model.type", splits), ("train.precision", "float32"),
                          ("train.device", "cpu")):
            if not fits[key]:
                raise UserError(f"config keys model.parallel={config['model.parallel']} and "
                                f"{key}={config[key]}: model parallelism needs {key}={want}")
        if qat_of(config):
            raise UserError(f"config keys model.parallel={config['model.parallel']} and qat.*: "
                            f"quantization-aware training is not split over a model group")
    if config["train.precision"] == "bf16" and config["train.loss_scale"] != "none":
        raise UserError(f"config keys train.precision=bf16 and train.loss_scale="
                        f"{config['train.loss_scale']}: bfloat16 has float32's exponent range, "
                        f"so no gradient needs a scale to survive it; set train.loss_scale=none")
    if config["train.cuda_graphs"] and (config["train.device"] != "cuda" or qat_of(config)):
        raise UserError("config key train.cuda_graphs=true: needs train.device=cuda and no "
                        "qat.* (quantization-aware training reads its ranges back to the host "
                        "inside the pass, which a graph cannot hold)")
    if config["train.loss_scale_min"] > config["train.loss_scale_max"]:
        raise UserError("config keys train.loss_scale_min > train.loss_scale_max")
    if config["exchange.overlap"] == "true" and overlap_blocker(config):
        raise UserError(f"config key exchange.overlap=true: {overlap_blocker(config)}; set "
                        f"exchange.overlap=auto (off where it does not apply) or false")
    if qat_of(config):   # the rules' combinations: hpcsgd.model.quantize.check, at the build
        if config["train.precision"] != "float32":
            raise UserError(f"config keys qat.* and train.precision={config['train.precision']}"
                            f": quantization-aware training runs in float32")
    return config


def overlap_blocker(config):
    """Why the overlapped allreduce (exchange.overlap) cannot run with this config, or None.
    It sends each layer's gradient as the backward pass finishes it, so nothing may change
    the gradient after the backward pass, and the model must say when a layer is done."""
    model = family(config["model.type"])   # its family may have a reason of its own
    reasons = (
        (config["exchange.aggregation"] != "allreduce",
         "the striped exchange encodes the whole gradient with its codec after the backward "
         "pass (exchange.aggregation=allreduce)"),
        (config["exchange.allreduce_dtype"] != "float32",
         "the float16 allreduce rounds the whole gradient first (exchange.allreduce_dtype=float32)"),
        (config["train.device"] != "cpu", "GPU ranks sum on NCCL's stream after the backward "
         "pass (train.device=cpu)"),
        (config["exchange.double_buffering"], "double buffering already overlaps each half's "
         "exchange with the next half's compute"),
        (config["train.precision"] != "float32" or config["train.loss_scale"] != "none",
         "mixed precision rounds and unscales the whole gradient after the backward pass, and "
         "the overflow vote decides whether it is sent (train.precision=float32, "
         "train.loss_scale=none)"),
        (config["train.clip_gradient_norm"] > 0, "gradient clipping needs the whole local "
         "gradient's norm before the exchange (train.clip_gradient_norm=0)"),
        (config["optim.adagrad"] == "local", "AdaGrad 'local' rescales the local gradient "
         "before the exchange"),
        (config["optim.type"] == "adam" and config["optim.adam_variance"] == "local",
         "Adam's local second moment rescales the local gradient before the exchange "
         "(optim.adam_variance=owner)"),
        (qat_of(config) is not None, "quantization-aware training finishes the weight "
         "gradients after the backward pass (qat.*)"),
        (config["model.parallel"] > 1, "a split model's layers exchange inside the pass "
         "(model.parallel=1)"),
        (model.OVERLAP_BLOCKER is not None, model.OVERLAP_BLOCKER))
    return next((why for blocked, why in reasons if blocked), None)


def qat_of(config):
    """The model's quantization-aware training description (model.quantize), or None."""
    if config["qat.weights"] == "none" and config["qat.activations"] == "none":
        return None
    return {"weights": config["qat.weights"], "weight_bits": config["qat.weight_bits"],
            "activations": config["qat.activations"],
            "activation_bits": config["qat.activation_bits"],
            "pact_init": config["qat.pact_init"], "clip_decay": config["qat.clip_decay"],
            # only when not the default: checkpoints from before the key describe the same model
            **({"weight_scale": "channel"} if config["qat.weight_scale"] == "channel" else {}),
            **({"first_layer": "float"} if first_layer_float(config) else {})}


def first_layer_float(config):
    """qat.first_layer resolved: auto is the family's (float for an RNN-T: the paper),
    quantized else."""
    choice = config["qat.first_layer"]
    return choice == "float" or (choice == "auto"
                                 and family(config["model.type"]).FIRST_LAYER_FLOAT)


def dump(config):
    """The resolved config as nested YAML (what the run directory keeps)."""
    tree = {}
    for key, value in config.items():
        section, name = key.split(".", 1)
        tree.setdefault(section, {})[name] = value
    return yaml.safe_dump(tree, sort_keys=False)


def describe():
    """All options with defaults, allowed values and comments (`hpcsgd train --help-config`)."""
    lines = []
    for key, (default, kind, constraint, comment) in DEFAULTS.items():
        if isinstance(constraint, tuple) and constraint and isinstance(constraint[0], str):
            allowed = "one of " + ", ".join(constraint)
        elif constraint is not None:
            allowed = (f"integers in {constraint[0]}..{constraint[1]}" if kind is list
                       else f"{kind.__name__} in {constraint[0]}..{constraint[1]}")
            if len(constraint) == 3:
                allowed += ", or one of " + ", ".join(constraint[2])
        else:
            allowed = kind.__name__
        lines.append(f"  {key} = {default!r}    ({allowed})\n      {comment}")
    return "\n".join(lines)
