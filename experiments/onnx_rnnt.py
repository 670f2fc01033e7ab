"""An RNN-T model exported with `hpcsgd export --onnx` (global CMVN) and decoded by sherpa-onnx
from the audio files, against hpcsgd's searches (docs/export.md, the transducer section).

    python experiments/onnx_rnnt.py RUN CV_ARCHIVE TRAIN_ARCHIVE DATA_DIR

DATA_DIR: the Kaldi data directory the archive was prepped from (its wav.scp of file paths
relative to it). Prints a Kaldi %PER/%WER line per system and how many utterances'
hypotheses equal sherpa-onnx's, for:
  hpcsgd's searches over the archive's features with the per-speaker CMVN the model trained
  with (`hpcsgd decode --greedy`, `--beam-size 4`) and with the export's global statistics
  (the same normalisation as the graph), greedy with at most 1 symbol per frame (sherpa-onnx's
  rule) and 3 (hpcsgd's), and modified beam search of 4;
  sherpa-onnx's greedy_search and modified_beam_search (max_active_paths 4), one stream at a
  time on one thread, with its real-time factor (decode wall seconds / audio seconds).
"""
import os
import sys
import tempfile
import time

import numpy as np

from hpcsgd import export_onnx
from hpcsgd.export import write_onnx
from hpcsgd.decode import ctc as ctc_search
from hpcsgd.decode import recognize, rnnt, score
from hpcsgd.families import family
from hpcsgd.model.lengths import Lengths
from hpcsgd.model_io import load_model
from hpcsgd.outputs import ctc_posteriors

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from onnx_cmvn import raw_utterances   # noqa: E402


def sherpa_decode(code, method, data_dir, utts):
    """({utt: tokens as text}, decode wall seconds, the process' CPU seconds in them, audio
    seconds) of sherpa-onnx's `method`, each utterance its own stream, one thread (CPU
    seconds: what the wall seconds would be on an idle core)."""
    import soundfile as sf
    names = {}
    exec(code.replace("'greedy_search'", repr(method)), names)
    recognizer = names["recognizer"]
    audio = dict(line.split(maxsplit=1) for line in open(os.path.join(data_dir, "wav.scp")))
    hyps, wall, cpu, seconds = {}, 0.0, 0.0, 0.0
    for utt in utts:
        samples, rate = sf.read(os.path.join(data_dir, audio[utt].strip()), dtype="float32")
        seconds += len(samples) / rate
        t0, c0 = time.perf_counter(), time.process_time()
        stream = recognizer.create_stream()
        stream.accept_waveform(rate, samples)
        recognizer.decode_stream(stream)
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        hyps[utt] = stream.result.text.split()
    return hyps, wall, cpu, seconds


def main(run, cv, train, data_dir):
    model, params, meta = load_model(run)
    tokens = meta["tokens"]
    symbols = np.asarray(tokens["symbols"], dtype=object)
    words = lambda ids: ctc_search.tokens_to_words(symbols[ids], tokens["kind"])  # noqa: E731
    unit = "phones" if tokens["kind"] == "phones" else "words"
    refs, _ = recognize.archive_references(unit, cv)
    search = family("rnnt").search
    encs, _ = ctc_posteriors(model, params, meta, cv)   # per-speaker CMVN
    systems = [("hpcsgd decode --greedy (per-speaker CMVN, <= 3 symbols/frame)",
                search(model, params, encs, tokens)[0]),
               ("hpcsgd decode --beam-size 4 (per-speaker CMVN)",
                search(model, params, encs, tokens, beam=4)[0])]
    mean, inv_std, _, _ = export_onnx.global_cmvn(train, meta["data"]["cmvn"])
    layer = model.layers[-1]
    greedy1, greedy3, beam4 = {}, {}, {}
    for utt, feats in raw_utterances(cv):
        x = np.ascontiguousarray((feats.astype(np.float32) - mean) * inv_std, np.float32)
        enc = np.array(model.forward(params, x, len(x), lengths=[len(x)]))
        lengths = Lengths([len(enc)])
        greedy1[utt] = words(rnnt.greedy_search(layer, params, enc, lengths, max_symbols=1)[0])
        greedy3[utt] = words(rnnt.greedy_search(layer, params, enc, lengths)[0])
        beam4[utt] = words(rnnt.beam_search(layer, params, enc, lengths, 4)[0][0])
    systems += [("hpcsgd greedy, global CMVN, <= 1 symbol/frame", greedy1),
                ("hpcsgd greedy, global CMVN, <= 3 symbols/frame", greedy3),
                ("hpcsgd beam 4, global CMVN", beam4)]
    utts = list(greedy1)
    with tempfile.TemporaryDirectory(prefix="onnx_rnnt_") as out:
        done = write_onnx(run, out, train)
        sherpa = {m: sherpa_decode(done["code"], m, data_dir, utts)
                  for m in ("greedy_search", "modified_beam_search")}
    name = "PER" if unit == "phones" else "WER"
    print(f"{run} on {cv} ({len(utts)} utterances), global statistics of {train}")
    for method, (hyps, wall, cpu, seconds) in sherpa.items():
        print(f"sherpa-onnx {method}: RTF {wall / seconds:.4f} wall, {cpu / seconds:.4f} CPU "
              f"({wall:.2f} s, {cpu:.2f} CPU s for {seconds:.2f} s of audio, one thread, one "
              f"stream at a time)")
    for label, hyps in systems + [(f"sherpa-onnx {m}", h) for m, (h, *_) in sherpa.items()]:
        total, _ = recognize.error_counts(refs, hyps)
        same = {m: sum(hyps[u] == h[u] for u in utts) for m, (h, *_) in sherpa.items()}
        print(f"{label}: {score.kaldi_lines(name, total).splitlines()[0]}; equal to sherpa-onnx "
              f"greedy {same['greedy_search']}/{len(utts)}, modified beam "
              f"{same['modified_beam_search']}/{len(utts)}")
    for u in utts:
        if greedy1[u] != sherpa["greedy_search"][0][u]:
            print(f"greedy differs: {u}\n  hpcsgd {' '.join(greedy1[u])}\n  sherpa "
                  f"{' '.join(sherpa['greedy_search'][0][u])}")
        if beam4[u] != sherpa["modified_beam_search"][0][u]:
            print(f"beam differs: {u}\n  hpcsgd {' '.join(beam4[u])}\n  sherpa "
                  f"{' '.join(sherpa['modified_beam_search'][0][u])}")


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    main(*sys.argv[1:])
