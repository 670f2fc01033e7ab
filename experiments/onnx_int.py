"""Integer ONNX exports of quantization-aware CTC models against their float model
(docs/export.md, "Integer exports"): for each run, its `hpcsgd export --onnx` graph (INT8 QDQ
or INT4 int4-code DequantizeLinear for a QAT run, float32 otherwise), with on a held-out archive

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

Real-time factor (and each system's speed-up against the first RUN, the float model): seconds of computing / seconds of audio (frames x 10 ms for the features,
the samples for sherpa-onnx, whose time includes its fbank), one utterance at a time; the
systems take turns on each utterance, PASSES times, and each utterance's fastest time counts
(the machine is shared: a burst of load hits every system alike). hpcsgd's pass is the
Network's forward on one utterance (what `hpcsgd decode --greedy` runs, there on batches of
utterances). An INT4 run is also exported with --onnx-int8 (its 4-bit codes as int8 QDQ:
onnxruntime's integer GEMM). ONNX_INT_PASSES=0 in the environment: the accuracy and sizes
only, no timing passes.
"""
import os
import sys
import time

import numpy as np

from hpcsgd import export_onnx
from hpcsgd.export import write_onnx
from hpcsgd.decode import recognize, score
from hpcsgd.families import family
from hpcsgd.model_io import load_model
from hpcsgd.outputs import ctc_outputs
from onnx_cmvn import raw_utterances   # experiments/, beside this script

PASSES = int(os.environ.get("ONNX_INT_PASSES", 3))


def per(refs, hyps, name):
    """Kaldi's %PER (or %WER) line of the hypotheses."""
    total, _ = recognize.error_counts(refs, hyps)
    return score.kaldi_lines(name, total).splitlines()[0]


def sherpa(code, data_dir, utts):
    """(the recognizer of the printed sherpa-onnx call (one thread), {utt: (samples, rate)})."""
    import soundfile as sf
    names = {}
    exec(code, names)
    audio = dict(line.split(maxsplit=1) for line in open(os.path.join(data_dir, "wav.scp")))
    clips = {u: sf.read(os.path.join(data_dir, audio[u].strip()), dtype="float32")
             for u in utts}
    return names["recognizer"], clips


def decode_clip(recognizer, clip):
    """sherpa-onnx's text of one utterance's audio, as tokens (its fbank included)."""
    samples, rate = clip
    stream = recognizer.create_stream()
    stream.accept_waveform(rate, samples)
    recognizer.decode_stream(stream)
    return stream.result.text.split()


def ort_session(model_file):
    """An onnxruntime session on one thread."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    return ort.InferenceSession(model_file, so, providers=["CPUExecutionProvider"])


def main(out_root, cv, train, data_dir, *runs):
    greedy = family("ctc").search
    feats = list(raw_utterances(cv))
    utts = [u for u, _ in feats]
    timed = []   # (label, run one utterance u: a callable of its index)
    for run in runs:
        name = os.path.basename(os.path.normpath(run))
        done = write_onnx(run, os.path.join(out_root, name), train)
        size = os.path.getsize(done["model"])
        model, params, meta = load_model(run)
        unit = "phones" if meta["tokens"]["kind"] == "phones" else "words"
        label = "PER" if unit == "phones" else "WER"
        refs, _ = recognize.archive_references(unit, cv)
        # hpcsgd decode --greedy: per-speaker CMVN, the Network's batches
        per_speaker, _ = greedy(None, None, ctc_outputs(model, params, cv, meta["data"]),
                                meta["tokens"])
        # the same model on the graph's normalisation, one utterance at a time: what the
        # graph must equal, and hpcsgd's pass timed beside onnxruntime's
        mean, inv_std, _, _ = export_onnx.global_cmvn(train, meta["data"]["cmvn"])
        normed = [np.ascontiguousarray((f.astype(np.float32) - mean) * inv_std, np.float32)
                  for _, f in feats]
        hpcsgd_run = lambda i, m=model, p=params, x=normed: np.array(   # noqa: E731
            m.forward(p, x[i], len(x[i]), lengths=[len(x[i])]))
        same_norm, _ = greedy(None, None, [(u, hpcsgd_run(i)) for i, u in enumerate(utts)],
                              meta["tokens"])
        differ = lambda h, want=same_norm: sum(h[u] != want[u] for u in want)   # noqa: E731
        lines = [f"== {run}: {meta['model'].get('qat')}", f"   model.onnx {size:,} bytes",
                 f"   hpcsgd decode --greedy (per-speaker CMVN): {per(refs, per_speaker, label)}",
                 f"   hpcsgd, the graph's global CMVN: {per(refs, same_norm, label)}"]
        timed.append((f"{name} hpcsgd forward", hpcsgd_run))
        graphs = [("onnxruntime", done["model"])]
        if done["quantization"].startswith("INT4"):
            as_int8 = write_onnx(run, os.path.join(out_root, name + "_as_int8"), train,
                                         int8=True)["model"]
            lines.append(f"   --onnx-int8: model.onnx {os.path.getsize(as_int8):,} bytes")
            graphs.append(("onnxruntime --onnx-int8", as_int8))
        for what, path in graphs:
            session = ort_session(path)
            ort_run = lambda i, s=session: s.run(None, {   # noqa: E731
                "x": np.ascontiguousarray(feats[i][1], np.float32)[None],
                "x_lens": np.array([len(feats[i][1])])})[0][0]
            hyps, _ = greedy(None, None, [(u, ort_run(i)) for i, u in enumerate(utts)],
                             meta["tokens"])
            lines.append(f"   {what}: {per(refs, hyps, label)}, {differ(hyps)} of {len(utts)} "
                         f"hypotheses differ from hpcsgd's")
            timed.append((f"{name} {what}", ort_run))
        recognizer, clips = sherpa(done["code"], data_dir, utts)
        sherpa_run = lambda i, r=recognizer: decode_clip(r, clips[utts[i]])   # noqa: E731
        hyps = {u: sherpa_run(i) for i, u in enumerate(utts)}
        lines.append(f"   sherpa-onnx: {per(refs, hyps, label)}, {differ(hyps)} differ")
        timed.append((f"{name} sherpa-onnx", sherpa_run))
        print("\n".join(lines), flush=True)
    if not PASSES:
        return
    audio_s = sum(len(f) for _, f in feats) * 0.01
    clip_s = sum(len(samples) / rate for samples, rate in clips.values())
    best = np.full((len(timed), len(utts)), np.inf)
    for _ in range(PASSES):   # each utterance by every system in turn: the load hits all
        for i in range(len(utts)):
            for j, (_, fn) in enumerate(timed):
                t0 = time.perf_counter()
                fn(i)
                best[j, i] = min(best[j, i], time.perf_counter() - t0)
    print(f"real-time factors, one thread, {len(utts)} utterances ({audio_s:.0f} s of audio), "
          f"each utterance's fastest of {PASSES} interleaved passes:")
    first = {}   # system -> the first run's seconds: each speed-up against it (the float model)
    for (what, _), seconds in zip(timed, best.sum(1)):
        length = clip_s if "sherpa" in what else audio_s
        system = what.split(" ")[1]   # hpcsgd, onnxruntime (--onnx-int8 too), sherpa-onnx
        first.setdefault(system, seconds)
        print(f"   {what}: RTF {seconds / length:.5f} ({first[system] / seconds:.3f}x the first "
              f"run's)")


if __name__ == "__main__":
    if len(sys.argv) < 6:
        sys.exit(__doc__)
    main(*sys.argv[1:])
