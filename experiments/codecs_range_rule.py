"""Which per-column range rule should k-bit quantization use? Measured on REAL gradients.

Real gradients: Kaldi fbank (40 bins, kaldi_native_fbank) of ~50 utterances of so762_dev,
per-utterance mean normalisation, frame labels from phones.ctm (frame t gets the CTM segment
containing t * 0.01 s), splice +-5 frames (440 inputs); a numpy MLP 440-512-512-40 (sigmoid,
softmax) trained with SGD; the gradients of STEPS consecutive minibatches after WARM steps.
Each rule runs k-bit error feedback over those gradients; the score is the quantization
NMSE sum ||v - Q(v)||^2 / sum ||v||^2 (v = gradient + residual) over steps and matrices.
    python experiments/codecs_range_rule.py [--utts 50] [--json out.json]
"""
import argparse
import json
import os

import kaldi_native_fbank as knf
import numpy as np
import soundfile as sf

from hpcsgd.codecs import make_codec

DATA = "/work/shared/data/so762_dev"
CLIPS = [2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]


def features(utts):
    labels = dict(line.split() for line in open(os.path.join(DATA, "labels.txt")))
    segs = {}
    for line in open(os.path.join(DATA, "phones.ctm")):
        u, _, start, dur, ph = line.split()
        segs.setdefault(u, []).append((float(start), float(start) + float(dur), int(labels[ph])))
    wavs = [line.split() for line in open(os.path.join(DATA, "wav.scp"))][:utts]
    opts = knf.FbankOptions()
    opts.frame_opts.dither = 0.0
    opts.mel_opts.num_bins = 40
    xs, ys = [], []
    for u, path in wavs:
        audio, sr = sf.read(os.path.join(DATA, path), dtype="float32")
        fb = knf.OnlineFbank(opts)
        fb.accept_waveform(sr, (audio * 32768.0).tolist())
        fb.input_finished()
        f = np.array([fb.get_frame(i) for i in range(fb.num_frames_ready)], np.float32)
        f -= f.mean(axis=0)
        t = np.arange(len(f)) * 0.01
        y = np.full(len(f), -1)
        for s, e, lab in segs.get(u, []):
            y[(t >= s) & (t < e)] = lab
        pad = np.pad(f, ((5, 5), (0, 0)), mode="edge")
        spliced = np.stack([pad[i:i + len(f)] for i in range(11)], axis=1).reshape(len(f), 440)
        keep = y >= 0
        xs.append(spliced[keep])
        ys.append(y[keep])
    x = np.concatenate(xs)
    x /= x.std(axis=0) + 1e-5
    return x.astype(np.float32), np.concatenate(ys)


def gradients(x, y, warm, steps, batch=256, lr=0.5, seed=0):
    rng = np.random.default_rng(seed)
    sizes = [440, 512, 512, 40]
    W = [(rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32) for a, b in zip(sizes, sizes[1:])]
    b = [np.zeros((1, n), np.float32) for n in sizes[1:]]
    out = []
    for step in range(warm + steps):
        idx = rng.integers(0, len(x), batch)
        hs = [x[idx]]
        for i in range(3):
            z = hs[-1] @ W[i] + b[i]
            hs.append(1 / (1 + np.exp(-z)) if i < 2 else z)
        p = np.exp(hs[-1] - hs[-1].max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        d = p
        d[np.arange(batch), y[idx]] -= 1  # d loss / d logits, summed over the batch
        gW, gb = [None] * 3, [None] * 3
        for i in (2, 1, 0):
            gW[i] = hs[i].T @ d  # (n_in, n_out): codec column = input unit
            gb[i] = d.sum(0, keepdims=True)
            if i:
                d = (d @ W[i].T) * hs[i] * (1 - hs[i])
        for i in range(3):
            W[i] -= lr / batch * gW[i]
            b[i] -= lr / batch * gb[i]
        if step >= warm:
            out.append([g.astype(np.float32) for g in gW + gb])
    return out


def nmse(codec, grads):
    num = den = 0.0
    res = [np.zeros_like(g) for g in grads[0]]
    for step in grads:
        for g, r in zip(step, res):
            v = g + r
            buf = np.empty(codec.packed_nbytes(*g.shape), np.uint8)
            codec.encode(g, r, buf)  # r <- v - Q(v)
            num += float((r.astype(np.float64) ** 2).sum())
            den += float((v.astype(np.float64) ** 2).sum())
    return num / den


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--utts", type=int, default=50)
    ap.add_argument("--warm", type=int, default=30)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--json")
    args = ap.parse_args()
    x, y = features(args.utts)
    print(f"{len(x)} frames, {len(np.unique(y))} phone classes")
    grads = gradients(x, y, args.warm, args.steps)
    rules = [("minmax", None)] + [("rms", c) for c in CLIPS]
    table = {}
    print("k  " + " ".join(f"{'minmax' if c is None else f'rms{c}':>9}" for _, c in rules) + "  best")
    for k in range(2, 9):
        row = {("minmax" if c is None else f"rms{c}"): nmse(make_codec(
            "kbit", bits=k, range=rule, clip=c), grads) for rule, c in rules}
        best = min(row, key=row.get)
        table[k] = {"nmse": row, "best": best}
        print(f"{k}  " + " ".join(f"{v:9.3e}" for v in row.values()) + f"  {best}")
    one = nmse(make_codec("onebit"), grads)
    print(f"onebit nmse {one:.3e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"frames": len(x), "kbit": table, "onebit_nmse": one}, f, indent=1)


if __name__ == "__main__":
    main()
