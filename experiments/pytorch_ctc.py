"""The PyTorch peer of a CTC recipe: the same model, batches and schedule trained by PyTorch,
decoded and scored by hpcsgd's own code, so that the PER beside hpcsgd's is PyTorch's
training and nothing else (docs/results.md, "CTC models on so762").

    python experiments/pytorch_ctc.py jobs/configs/so762_ctc.yaml OUT_DIR \
        [--batch-norm] [--he-init] [key=value ...]

--batch-norm: every `conv ... in` of the encoder normalized as batch norm instead (each channel
over the batch's valid steps, running statistics for the CV), which hpcsgd does not have: what
DeepSpeech2 and Wave2Letter+ use, tried here before building it (experiments/ctc_so762.md).
--he-init: the convolutions' weights drawn as He et al. (kaiming_uniform_, ReLU gain) instead
of PyTorch's default (a third of that variance); hpcsgd's rule is near He's.

What is the same: the training archive's batches as hpcsgd's loader deals them to one rank
(whole utterances in length buckets, SpecAugment drawn per utterance and epoch), the epochs,
Adam with the per-sample rate times each batch's frames and the linear decay to 0
(hpcsgd/optim.py), the encoder layer for layer (hpcsgd/bench/pytorch.py: CTCModel, what bench
train --pytorch times: frame stacking as a reshape, nn.Conv1d, nn.LSTM on packed sequences,
nn.Linear), nn.CTCLoss summed
over the utterances. What is PyTorch's own: its default initialisation, its kernels. The held-out
archive's greedy phone error rate is hpcsgd's (hpcsgd.decode.ctc.greedy_search against the
archive's tokens, Kaldi's scoring). PyTorch is a benchmark peer: `pip install torch==2.13.0`.
Writes OUT_DIR/metrics.jsonl (one record per epoch) and OUT_DIR/result.json.
"""
import json
import os
import sys
import time

import numpy as np
import torch

from hpcsgd import config
from hpcsgd.bench.pytorch import CTCModel
from hpcsgd.data.utterances import SpecAugment, UtteranceLoader
from hpcsgd.decode.ctc import greedy_search
from hpcsgd.decode.score import counts, kaldi_lines
from hpcsgd.model.encoder import time_stride


def batch_tensors(x, targets, dim):
    frames = torch.from_numpy(targets.frames)
    t = int(targets.frames[0])
    xs = torch.from_numpy(np.ascontiguousarray(x)).view(t, len(targets.frames), dim)
    return xs, frames, torch.from_numpy(targets.ids.astype(np.int64)), \
        torch.from_numpy(np.diff(targets.offsets))


def evaluate(model, cv_dir, cfg):
    """Greedy PER and the loss per token on the held-out archive (hpcsgd's scoring)."""
    loader = UtteranceLoader(cv_dir, tokens=cfg["data.tokens"], cmvn=cfg["data.cmvn"],
                             minibatch=16384, prefetch=False)
    total, loss_sum = np.zeros(6, np.int64), 0.0
    ctc = torch.nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)
    model.eval()
    with torch.no_grad():
        for _, x, t in loader.eval_batches(16384):
            xs, frames, ids, tgt_len = batch_tensors(x, t, loader.feature_dim)
            logp, out_len = model(xs, frames)
            loss_sum += ctc(logp, ids, out_len, tgt_len).item()
            for b in range(len(frames)):
                hyp = greedy_search(logp[:out_len[b], b].numpy())
                ref = t.ids[t.offsets[b]:t.offsets[b + 1]]
                total += counts(ref.tolist(), hyp.tolist())
    model.train()
    return total, loss_sum / max(total[3], 1)


def main(argv):
    batch_norm, he_init = "--batch-norm" in argv, "--he-init" in argv
    argv = [a for a in argv if a not in ("--batch-norm", "--he-init")]
    cfg_path, out = argv[0], argv[1]
    cfg = config.load(cfg_path, argv[2:])
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(cfg["train.seed"])
    spec = SpecAugment(cfg["data.specaug_freq_masks"], cfg["data.specaug_freq_width"],
                       cfg["data.specaug_time_masks"], cfg["data.specaug_time_width"],
                       cfg["data.specaug_time_ratio"]) if cfg["data.specaugment"] else None
    loader = UtteranceLoader(cfg["data.train"], tokens=cfg["data.tokens"], cmvn=cfg["data.cmvn"],
                             seed=cfg["train.seed"], minibatch=cfg["train.minibatch"],
                             max_frames=cfg["data.max_frames"],
                             bucket_frames=cfg["data.bucket_frames"], spec=spec,
                             sortagrad=cfg["data.sortagrad"])
    act = torch.nn.ReLU if cfg["model.activation"] == "relu" else torch.nn.Sigmoid
    model = CTCModel(torch, {"input_dim": loader.feature_dim, "encoder": cfg["model.encoder"],
                             "num_tokens": loader.num_labels, "dropout": cfg["model.dropout"],
                             "batch_norm": batch_norm},
                     act)
    if he_init:
        for layer in model.modules():
            if isinstance(layer, torch.nn.Conv1d):
                torch.nn.init.kaiming_uniform_(layer.weight, nonlinearity="relu")
    assert cfg["optim.type"] == "adam" and cfg["schedule.type"] == "linear"
    opt = torch.optim.Adam(model.parameters(), lr=0.0, betas=(cfg["optim.adam_beta1"],
                                                           cfg["optim.adam_beta2"]))
    ctc = torch.nn.CTCLoss(blank=0, reduction="sum", zero_infinity=True)
    total = cfg["train.epochs"] * loader.frames_per_epoch
    done, records, t0 = 0, [], time.time()
    for epoch in range(cfg["train.epochs"]):
        epoch_frames = loader.epoch_frames(epoch)
        offsets = np.zeros(1, np.int64)
        loader.resume(epoch, offsets)
        loss_sum, tokens = 0.0, 0
        while offsets.sum() < epoch_frames.sum():
            take = loader.take(cfg["train.minibatch"], offsets, epoch_frames)
            x, t = loader.next_batch(int(take[0]))
            xs, frames, ids, tgt_len = batch_tensors(x, t, loader.feature_dim)
            # hpcsgd's per-sample rate x the batch's frames, decayed linearly to 0
            for group in opt.param_groups:
                group["lr"] = cfg["optim.lr"] * (1 - done / total) * int(take.sum())
            opt.zero_grad()
            logp, out_len = model(xs, frames)
            loss = ctc(logp, ids, out_len, tgt_len)
            loss.backward()
            opt.step()
            loss_sum, tokens = loss_sum + loss.item(), tokens + len(ids)
            offsets += take
            done += int(take.sum())
        errors, cv_loss = evaluate(model, cfg["data.cv"], cfg)
        record = {"epoch": epoch, "frames": done, "train_ctc_per_token": loss_sum / tokens,
                  "cv_ctc_per_token": cv_loss,
                  "cv_token_error_rate": errors[:3].sum() / max(errors[3], 1),
                  "seconds": time.time() - t0}
        records.append(record)
        print(json.dumps(record), flush=True)
        with open(os.path.join(out, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
    errors, cv_loss = evaluate(model, cfg["data.cv"], cfg)
    lines = kaldi_lines("PER", errors)
    print(lines)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"config": cfg_path, "overrides": argv[2:], "batch_norm": batch_norm,
                   "he_init": he_init, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "per": 100 * errors[:3].sum() / errors[3],
                   "counts": errors.tolist(), "lines": lines,
                   "stride": time_stride(cfg["model.encoder"]), "epochs": records}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
