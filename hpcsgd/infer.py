"""`hpcsgd infer`: per-utterance posteriors or scaled log-likelihoods for a hybrid decoder.

    hpcsgd infer RUN_DIR|CHECKPOINT --data ARCHIVE --out OUT [--output loglik|posteriors|logpost]
                 [--format hdf5|ark|both] [--sequences chunks|whole] [--device cpu|cuda]

loglik = log posterior - log prior (hpcsgd/outputs.py); a CTC model writes its log-posteriors
(or posteriors) over its tokens, the blank first, at its subsampled frame rate. Writes OUT.h5
(`values` (F, V) float32 concatenated, `utt_offsets`, `utt_ids`, like an archive) and/or
OUT.ark + OUT.scp (Kaldi matrices, readable by latgen-faster-mapped via kaldiio). Files are
written under temporary names and renamed. A sequence model (LSTM) runs in its training
chunks, or with --sequences whole as one sequence per utterance. One process; --device cuda
runs the network on the first visible GPU (CUDA_VISIBLE_DEVICES picks another), its outputs
the CPU path's to float32 tolerance.
"""
import os

import h5py
import numpy as np

from hpcsgd.families import of_model
from hpcsgd.model_io import EVAL_BATCH, add_device_argument, check_archive, load_model
from hpcsgd.outputs import longest_utterance


def add_arguments(parser):
    parser.add_argument("model", help="run directory (latest checkpoint) or checkpoint file")
    parser.add_argument("--data", required=True, help="archive to run on (hpcsgd prep OUT)")
    parser.add_argument("--out", required=True, help="output path without extension")
    parser.add_argument("--output", choices=("loglik", "posteriors", "logpost"), default="loglik",
                        help="scaled log-likelihoods (for a hybrid decoder), posteriors, or log-posteriors")
    parser.add_argument("--format", choices=("hdf5", "ark", "both"), default="both",
                        help="OUT.h5, Kaldi OUT.ark + OUT.scp, or both")
    parser.add_argument("--sequences", choices=("chunks", "whole"), default="chunks",
                        help="sequence (LSTM) models: run the training chunks with their "
                             "context, or each utterance as one sequence")
    add_device_argument(parser)


def run(args):
    whole = getattr(args, "sequences", "chunks") == "whole"
    model, params, meta = load_model(args.model, max(EVAL_BATCH, longest_utterance(args.data))
                                     if whole else EVAL_BATCH, device=args.device)
    check_archive(args.data, meta)
    # the family's outputs: a frame classifier's per frame (its chunks or whole utterances),
    # a CTC model's over tokens and the blank; an RNN-T has none to write (refused)
    fam = of_model(meta["model"])
    outputs = fam.outputs(model, params, args.data, meta, args.output, whole)
    note = fam.infer_note(model, whole)
    if note:
        print(note)
    pid = os.getpid()
    h5_tmp, ark_tmp, scp_tmp = (f"{args.out}.h5.tmp.{pid}", f"{args.out}.ark.tmp.{pid}",
                                f"{args.out}.scp.tmp.{pid}")
    want_h5, want_ark = args.format in ("hdf5", "both"), args.format in ("ark", "both")
    writer = h5 = None
    try:
        if want_ark:
            import kaldiio
            writer = kaldiio.WriteHelper(f"ark,scp:{ark_tmp},{scp_tmp}")
        utt_ids, offsets, frames = [], [0], 0
        if want_h5:
            h5 = h5py.File(h5_tmp, "w")
            values_ds = h5.create_dataset("values", (0, model.num_labels), np.float32,
                                          maxshape=(None, model.num_labels),
                                          chunks=(1024, model.num_labels))
        for utt, values in outputs:
            utt_ids.append(utt)
            frames += len(values)
            offsets.append(frames)
            if writer is not None:
                writer(utt, values)
            if h5 is not None:
                values_ds.resize(frames, axis=0)
                values_ds[frames - len(values):frames] = values
        if writer is not None:
            writer.close()
            writer = None
            # the scp names the temporary ark: point it at the final name before renaming
            with open(scp_tmp) as f:
                scp = f.read().replace(ark_tmp, f"{args.out}.ark")
            with open(scp_tmp, "w") as f:
                f.write(scp)
            os.replace(ark_tmp, f"{args.out}.ark")
            os.replace(scp_tmp, f"{args.out}.scp")
        if h5 is not None:
            h5.create_dataset("utt_offsets", data=np.array(offsets, np.int64))
            h5.create_dataset("utt_ids", data=np.array(utt_ids, dtype=object),
                              dtype=h5py.string_dtype())
            h5.attrs["output"] = args.output
            h5.attrs["checkpoint"] = meta["path"]
            h5.close()
            h5 = None
            os.replace(h5_tmp, f"{args.out}.h5")
    finally:
        if writer is not None:
            writer.close()
        if h5 is not None:
            h5.close()
        for tmp in (h5_tmp, ark_tmp, scp_tmp):
            if os.path.exists(tmp):
                os.unlink(tmp)
    written = [f"{args.out}.{ext}" for ext, on in (("h5", want_h5), ("ark", want_ark),
                                                    ("scp", want_ark)) if on]
    print(f"infer: {len(utt_ids)} utterances, {frames} frames of {args.output} -> "
          f"{', '.join(written)}")
    return 0
