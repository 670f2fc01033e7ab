"""Integer ONNX exports of quantization-aware CTC models against their float model
(docs/export.md, "Integer exports"): for each run, its `hpcsgd export --onnx` graph (INT8 QDQ
or INT4 MatMulNBits for a QAT run, float32 otherwise), with on a held-out archive

  - hpcsgd's greedy error rate with per-speaker CMVN (`hpcsgd decode --greedy`) and its time;
  - hpcsgd's fake-quantized forward on the features normalised as the graph normalises them
    (the training archive's global statistics): what the graph must equal;
  - onnxruntime on the archive's raw features (one thread: intra_op_num_threads=1), its
    greedy error rate, how many hypotheses differ from the line above, its real-time factor;
  - with DATA_DIR (the Kaldi data directory the archive came from), sherpa-onnx from the
    audio files (num_threads=1, the printed call), its error rate and real-time factor;
  - the model file's size.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 \\
        python experiments/onnx_int.py OUT_DIR CV_ARCHIVE TRAIN_ARCHIVE DATA_DIR RUN...

Real-time factor: seconds of computing / seconds of audio (frames x 10 ms for the features,
the samples for sherpa-onnx, whose time includes its fbank); each system runs every
utterance once, one at a time, after one warm-up utterance.
"""
import os
import sys
import time

import numpy as np

from hpcsgd import export_onnx
from hpcsgd.decode import recognize, score
from hpcsgd.families import family
from hpcsgd.model_io import load_model
from hpcsgd.outputs import ctc_outputs
from onnx_cmvn import raw_utterances   # experiments/, beside this script


def per(refs, hyps, name):
    """Kaldi's %PER (or %WER) line of the hypotheses."""
    total, _ = recognize.error_counts(refs, hyps)
    return score.kaldi_lines(name, total).splitlines()[0]


def sherpa(code, data_dir, utts):
    """({utt: tokens}, seconds, audio seconds) of the printed sherpa-onnx call (one thread)."""
    import soundfile as sf
    names = {}
    exec(code, names)
    recognizer = names["recognizer"]
    audio = dict(line.split(maxsplit=1) for line in open(os.path.join(data_dir, "wav.scp")))
    clips = {u: sf.read(os.path.join(data_dir, audio[u].strip()), dtype="float32")
             for u in utts}
    warm = recognizer.create_stream()
    warm.accept_waveform(clips[utts[0]][1], clips[utts[0]][0])
    recognizer.decode_stream(warm)
    hyps, seconds, length = {}, 0.0, 0.0
    for u in utts:
        samples, rate = clips[u]
        t0 = time.perf_counter()
        stream = recognizer.create_stream()
        stream.accept_waveform(rate, samples)
        recognizer.decode_stream(stream)
        seconds += time.perf_counter() - t0
        length += len(samples) / rate
        hyps[u] = stream.result.text.split()
    return hyps, seconds, length


def main(out_root, cv, train, data_dir, *runs):
    import onnxruntime as ort
    greedy = family("ctc").search
    feats = list(raw_utterances(cv))
    audio_s = sum(len(f) for _, f in feats) * 0.01
    for run in runs:
        name = os.path.basename(os.path.normpath(run))
        out = os.path.join(out_root, name)
        done = export_onnx.export(run, out, train)
        size = os.path.getsize(done["model"])
        model, params, meta = load_model(run)
        unit = "phones" if meta["tokens"]["kind"] == "phones" else "words"
        refs, _ = recognize.archive_references(unit, cv)
        # hpcsgd decode --greedy: per-speaker CMVN, the Network's batches
        t0 = time.perf_counter()
        per_speaker, _ = greedy(None, None, ctc_outputs(model, params, cv, meta["data"]),
                                meta["tokens"])
        hpcsgd_s = time.perf_counter() - t0
        # the same model on the graph's normalisation: what the graph must equal
        mean, inv_std, _, _ = export_onnx.global_cmvn(train, meta["data"]["cmvn"])
        same_norm = []
        for utt, f in feats:
            x = np.ascontiguousarray((f.astype(np.float32) - mean) * inv_std, np.float32)
            same_norm.append((utt, np.array(model.forward(params, x, len(x), lengths=[len(x)]))))
        same_norm, _ = greedy(None, None, same_norm, meta["tokens"])
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        session = ort.InferenceSession(done["model"], so, providers=["CPUExecutionProvider"])
        x0 = np.ascontiguousarray(feats[0][1], np.float32)
        session.run(None, {"x": x0[None], "x_lens": np.array([len(x0)])})
        onnx_out, ort_s = [], 0.0
        for utt, f in feats:
            x = np.ascontiguousarray(f, np.float32)
            t0 = time.perf_counter()
            lp, _ = session.run(None, {"x": x[None], "x_lens": np.array([len(x)])})
            ort_s += time.perf_counter() - t0
            onnx_out.append((utt, lp[0]))
        onnx_hyps, _ = greedy(None, None, onnx_out, meta["tokens"])
        sherpa_hyps, sherpa_s, sherpa_audio = sherpa(done["code"], data_dir,
                                                     [u for u, _ in feats])
        label = "PER" if unit == "phones" else "WER"
        differ = lambda h: sum(h[u] != same_norm[u] for u in same_norm)   # noqa: E731
        print(f"== {run}: {meta['model'].get('qat')}\n"
              f"   model.onnx {size:,} bytes\n"
              f"   hpcsgd decode --greedy (per-speaker CMVN): "
              f"{per(refs, per_speaker, label)}, RTF {hpcsgd_s / audio_s:.4f}\n"
              f"   hpcsgd, the graph's global CMVN: {per(refs, same_norm, label)}\n"
              f"   onnxruntime 1 thread: {per(refs, onnx_hyps, label)}, "
              f"{differ(onnx_hyps)} of {len(feats)} hypotheses differ from hpcsgd's, "
              f"RTF {ort_s / audio_s:.4f}\n"
              f"   sherpa-onnx 1 thread: {per(refs, sherpa_hyps, label)}, "
              f"{differ(sherpa_hyps)} differ, RTF {sherpa_s / sherpa_audio:.4f}", flush=True)
    print(f"{len(feats)} utterances, {audio_s:.0f} s of audio")


if __name__ == "__main__":
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    main(*sys.argv[1:])
