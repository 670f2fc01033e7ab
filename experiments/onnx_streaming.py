"""A causal CTC or RNN-T model exported with `hpcsgd export --onnx --streaming` and decoded by
sherpa-onnx's online recognizer from the audio files as they arrive, against hpcsgd's greedy
search (docs/export.md, the streaming section).

    python experiments/onnx_streaming.py RUN CV_ARCHIVE TRAIN_ARCHIVE DATA_DIR [CHUNK_MS]

DATA_DIR: the Kaldi data directory the archive was prepped from (its wav.scp of file paths
relative to it). Prints a Kaldi %PER/%WER line for: `hpcsgd decode --greedy` (the
normalisation the model trained with, data.cmvn_scope; the streaming recipes train with the
global one); hpcsgd's greedy with the export's global statistics
(RNN-T: at most one symbol per frame, sherpa-onnx's rule); sherpa-onnx's online greedy search,
each file handed over 0.32 s at a time, then the printed call's tail padding; and how many
hypotheses equal sherpa-onnx's. Then the latency: from each token's encoder step to the
audio time at which the online result held it (mean, and for each hypothesis' first token),
and sherpa-onnx's real-time factor (one thread, one stream at a time).
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
from hpcsgd.model.encoder import time_stride
from hpcsgd.model.lengths import Lengths
from hpcsgd.model_io import load_model
from hpcsgd.outputs import ctc_posteriors

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from onnx_cmvn import raw_utterances   # noqa: E402

PIECE_S = 0.32


def online(code, data_dir, utts, step_s):
    """{utt: tokens as text}, [delay of every token (s)], [delay of each first token], wall
    and CPU seconds of decoding, audio seconds: sherpa-onnx's online recognizer fed PIECE_S
    at a time, as the printed call's comments say."""
    import soundfile as sf
    names = {}
    exec(code, names)
    recognizer = names["recognizer"]
    tail = int(code.split("np.zeros(")[1].split(",")[0])
    audio = dict(line.split(maxsplit=1) for line in open(os.path.join(data_dir, "wav.scp")))
    hyps, delays, first, wall, cpu, seconds = {}, [], [], 0.0, 0.0, 0.0
    for utt in utts:
        samples, rate = sf.read(os.path.join(data_dir, audio[utt].strip()), dtype="float32")
        seconds += len(samples) / rate
        t0, c0 = time.perf_counter(), time.process_time()
        stream, piece, fed, seen = recognizer.create_stream(), int(PIECE_S * rate), 0, []
        parts = [samples[i:i + piece] for i in range(0, len(samples), piece)]
        for k, part in enumerate(parts + [np.zeros(tail, np.float32)]):
            stream.accept_waveform(rate, part)
            fed += len(part)
            if k == len(parts):
                stream.input_finished()
            while recognizer.is_ready(stream):
                recognizer.decode_stream(stream)
            n = len(recognizer.get_result(stream).tokens)
            seen += [fed / rate] * (n - len(seen))
        wall += time.perf_counter() - t0
        cpu += time.process_time() - c0
        result = recognizer.get_result(stream)
        hyps[utt] = result.text.split()
        # sherpa-onnx's timestamps take 40 ms a step: step_s / 0.04 makes them the model's
        had = [s - t * step_s / 0.04 for s, t in zip(seen, result.timestamps)]
        delays += had
        first += had[:1]
    return hyps, delays, first, wall, cpu, seconds


def main(run, cv, train, data_dir, chunk_ms=None):
    model, params, meta = load_model(run)
    tokens = meta["tokens"]
    kind = model.describe["type"]
    symbols = np.asarray(tokens["symbols"], dtype=object)
    words = lambda ids: ctc_search.tokens_to_words(symbols[ids], tokens["kind"])  # noqa: E731
    unit = "phones" if tokens["kind"] == "phones" else "words"
    refs, _ = recognize.archive_references(unit, cv)
    outs, _ = ctc_posteriors(model, params, meta, cv)   # as trained (data.cmvn_scope)
    trained, _ = family(kind).search(model, params, outs, tokens)
    scope = meta["data"].get("cmvn_scope") or "speaker"
    mean, inv_std, _, _ = export_onnx.global_cmvn(train, meta["data"]["cmvn"])
    greedy = {}
    for utt, feats in raw_utterances(cv):
        x = np.ascontiguousarray((feats.astype(np.float32) - mean) * inv_std, np.float32)
        out = np.array(model.forward(params, x, len(x), lengths=[len(x)]))
        greedy[utt] = words(ctc_search.greedy_search(out) if kind == "ctc" else
                            rnnt.greedy_search(model.layers[-1], params, out,
                                               Lengths([len(out)]), max_symbols=1)[0])
    utts = list(greedy)
    step_s = 0.01 * time_stride(model.describe["encoder"])
    with tempfile.TemporaryDirectory(prefix="onnx_streaming_") as out:
        done = write_onnx(run, out, train, streaming=True,
                                  chunk_ms=float(chunk_ms) if chunk_ms else None)
        hyps, delays, first, wall, cpu, seconds = online(done["code"], data_dir, utts, step_s)
    name = "PER" if unit == "phones" else "WER"
    print(f"{run} on {cv} ({len(utts)} utterances), global statistics of {train}; chunks of "
          f"{done['chunk'] * 10} ms, lookahead {done['lookahead'] * 10} ms, the audio handed over "
          f"{PIECE_S} s at a time")
    for label, h in ((f"hpcsgd decode --greedy (data.cmvn_scope {scope})", trained),
                     ("hpcsgd greedy, global CMVN", greedy),
                     ("sherpa-onnx online greedy_search", hyps)):
        total, _ = recognize.error_counts(refs, h)
        print(f"{label}: {score.kaldi_lines(name, total).splitlines()[0]}; equal to "
              f"sherpa-onnx's {sum(h[u] == hyps[u] for u in utts)}/{len(utts)}")
    print(f"delay from a token's encoder step to the audio time the result held it: mean "
          f"{np.mean(delays):.3f} s over {len(delays)} tokens (min {np.min(delays):.3f}, max "
          f"{np.max(delays):.3f}); each hypothesis' first token {np.mean(first):.3f} s")
    print(f"sherpa-onnx online: RTF {wall / seconds:.4f} wall, {cpu / seconds:.4f} CPU ({wall:.2f} "
          f"s, {cpu:.2f} CPU s for {seconds:.2f} s of audio, one thread, one stream at a time)")


if __name__ == "__main__":
    if len(sys.argv) not in (5, 6):
        sys.exit(__doc__)
    main(*sys.argv[1:])
