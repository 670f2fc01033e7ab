"""`hpcsgd align`: a CTC model's forced alignment of an archive's reference tokens, as a CTM.

    hpcsgd align RUN_DIR|MODEL --data ARCHIVE --ctm OUT.ctm [--fill]

Each utterance's tokens (the archive's own, of the model's kind) are placed on the model's
output frames by the best path through its log-posteriors (Viterbi over the CTC topology:
hpcsgd/decode/kernels_align.py): the same path the CTC loss sums over, its best member.
Written as CTM lines `utt 1 start duration token`, seconds, one per token:

    runs (default)   each token over the frames its path emits it on (CTC's spikes: one or two
                     frames), as `decode --ctm` times a hypothesis's tokens
    --fill           each token from its first frame to the next token's, the blank stretches
                     before the first token and after the last one's frames written as the
                     blank (`<blk>`): the CTM covers every frame, so `hpcsgd prep --alignments
                     OUT.ctm` reads it as frame labels (the targets of a CTC model's frame CE
                     head, model.frame_ce, on a corpus without alignments of its own)

An output frame of a model that subsamples by s covers s frame shifts of audio (at 10 ms and
s = 4: 40 ms). Utterances too short for their tokens (no path) are left out of the CTM and
named. Written under a temporary name and renamed. One process; the forward pass is the
model's (--device cuda runs it on a GPU).
"""
import os
import sys

import numpy as np

from hpcsgd.errors import UserError

EXAMPLES = """examples:
  hpcsgd align runs/ls/blstm_ctc --data runs/ls/archive/train --ctm runs/ls/align/train.ctm --fill
  hpcsgd prep LibriSpeech/train-clean-5 runs/ls/archive_ali --alignments runs/ls/align/all.ctm \
      --tokens bpe,chars --token-inventory runs/ls/archive/train"""

LISTED = 10   # utterances without a path named on stderr (the rest counted)


def add_arguments(parser):
    from hpcsgd.model_io import add_device_argument
    parser.add_argument("model", help="a CTC model: run directory (latest checkpoint), "
                                      "checkpoint, average or export")
    parser.add_argument("--data", required=True,
                        help="archive with the model's kind of tokens (hpcsgd prep OUT/train)")
    parser.add_argument("--ctm", required=True, help="the CTM to write")
    parser.add_argument("--fill", action="store_true",
                        help="cover every frame: each token up to the next one, the blank "
                             "before the first and after the last (frame labels for prep)")
    add_device_argument(parser)


def segments(path, blank, fill):
    """A frame path (ctc_viterbi's) -> [(label, first frame, end frame)]: the tokens' runs
    (fill False), or every frame covered (fill True; label `blank` for the blank edges)."""
    from hpcsgd.decode.timestamps import token_runs
    runs = token_runs(path, blank)
    if not fill:
        return [(k, a, b + 1) for k, a, b in runs]
    if not runs:
        return [(blank, 0, len(path))] if len(path) else []
    starts = [a for _, a, _ in runs]
    out = [(blank, 0, starts[0])] if starts[0] else []
    out += [(k, a, end) for (k, a, _), end in zip(runs, starts[1:] + [runs[-1][2] + 1])]
    if runs[-1][2] + 1 < len(path):
        out.append((blank, runs[-1][2] + 1, len(path)))
    return out


def run(args):
    from hpcsgd.decode import mkgraph
    from hpcsgd.decode.kernels_align import ctc_viterbi
    from hpcsgd.families import of_model
    from hpcsgd.model.encoder import time_stride
    from hpcsgd.model_io import EVAL_BATCH, check_archive, load_model
    model, params, meta = load_model(args.model, EVAL_BATCH, device=args.device)
    kind = meta["model"].get("type", "dnn")
    if kind != "ctc":
        raise UserError(f"{meta['path']} is a {kind} model: hpcsgd align places tokens on a "
                        f"CTC model's per-frame posteriors (an RNN-T's alignments are paths "
                        f"through its (T, U) lattice, not built here; a hybrid model's archive "
                        f"has frame labels already)")
    index = check_archive(args.data, meta)
    tokens = meta["tokens"]
    if tokens["kind"] not in index["tokens"]:
        raise UserError(f"{args.data} has no {tokens['kind']} tokens (it has "
                        f"{', '.join(index['tokens']) or 'none'}): the references to align "
                        f"are the archive's tokens of the model's kind; prep it with "
                        f"--tokens {tokens['kind']}")
    out_dir = os.path.dirname(os.path.abspath(args.ctm))
    if not os.path.isdir(out_dir):
        raise UserError(f"--ctm {args.ctm}: no directory {out_dir}")
    symbols, refs = mkgraph.archive_tokens(args.data, tokens["kind"])
    refs = dict(refs)
    blank = 0   # the blank is token id 0 of every inventory (hpcsgd/data/archive.py)
    frame_s = time_stride(meta["model"]["encoder"]) * index["frame_shift_ms"] / 1000.0
    logposts, forward_s = of_model(meta["model"]).posteriors(model, params, meta, args.data)
    tmp = f"{args.ctm}.tmp.{os.getpid()}"
    no_path, frames, score = [], 0, 0.0
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for utt, lp in logposts:
                path, best = ctc_viterbi(np.ascontiguousarray(lp, np.float32),
                                         np.asarray(refs[utt], np.int64), blank)
                if best == -np.inf:
                    no_path.append((utt, len(lp), len(refs[utt])))
                    continue
                frames, score = frames + len(lp), score + best
                f.writelines(f"{utt} 1 {a * frame_s:.3f} {(b - a) * frame_s:.3f} {symbols[k]}\n"
                             for k, a, b in segments(path, blank, args.fill))
        os.replace(tmp, args.ctm)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for utt, t, u in no_path[:LISTED]:
        print(f"hpcsgd align: {utt}: no path ({t} output frames for {u} tokens and their "
              f"repeats), left out", file=sys.stderr)
    if len(no_path) > LISTED:
        print(f"hpcsgd align: ... and {len(no_path) - LISTED} more left out", file=sys.stderr)
    aligned = len(logposts) - len(no_path)
    print(f"align: {aligned} of {len(logposts)} utterances of {args.data}, {frames} frames of "
          f"{frame_s * 1000:g} ms, best paths' mean log-posterior {score / max(frames, 1):.4f} "
          f"a frame ({'every frame covered' if args.fill else 'token runs'}; forward "
          f"{forward_s:.1f} s CPU) -> {args.ctm}")
    return 0
