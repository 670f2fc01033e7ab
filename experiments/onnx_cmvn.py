"""What the ONNX export's normalisation costs (docs/export.md): a CTC model's greedy error rate
on a held-out archive as it was trained (data.cmvn_scope: per speaker, global or per
utterance; `hpcsgd decode --greedy`), and with the exported graph (onnxruntime on the
archive's raw features) under each --cmvn: global (the training archive's statistics summed
over its speakers) and utterance (each utterance by its own statistics). A model trained
with the global or utterance scope should find its export's hypotheses equal to its own.

    python experiments/onnx_cmvn.py RUN CV_ARCHIVE [TRAIN_ARCHIVE [DATA_DIR]]

TRAIN_ARCHIVE defaults to the run's data.train. With DATA_DIR (the Kaldi data directory the
archive was prepped from: its wav.scp of plain file paths), also the export under --cmvn
global decoded by sherpa-onnx from the audio files, with the call `hpcsgd export` prints. Prints a Kaldi %WER/%PER line per system, how
many utterances' hypotheses differ from the per-speaker ones, and the bootstrap probability
(Kaldi's compute-wer-bootci, paired over utterances) that the system is better than them.
"""
import os
import sys

import numpy as np

from hpcsgd import export_onnx
from hpcsgd.export import write_onnx
from hpcsgd.data import archive
from hpcsgd.data import cmvn as norm
from hpcsgd.decode import recognize, score
from hpcsgd.families import family
from hpcsgd.model_io import load_model
from hpcsgd.outputs import ctc_outputs


def raw_utterances(archive_dir):
    """(utt, (T, D) float32 features as prep wrote them, no CMVN), archive order (an archive
    without frame labels too, which the loader's iter_utterances wants)."""
    index = archive.read_index(archive_dir)
    for shard in index["shards"]:
        path = os.path.join(index["dir"], shard["file"])
        meta = archive.read_shard_meta(path)
        with archive.open_shard(path) as f:
            feats = f["feats"][()]
        offsets = meta["utt_offsets"]
        for u, utt in enumerate(meta["utt_ids"]):
            yield utt, feats[offsets[u]:offsets[u + 1]]


def sherpa_hyps(run, train, data_dir, utts):
    """{utt: words or phones} of sherpa-onnx decoding the audio of utts (--cmvn global, or
    utterance for a model trained with it: the export's default)."""
    import tempfile

    import soundfile as sf
    with tempfile.TemporaryDirectory(prefix="onnx_cmvn_") as out:   # loaded, then removed
        done = write_onnx(run, out, train)
        print(f"sherpa-onnx: normalised with {done['cmvn']}")
        names = {}
        exec(done["code"], names)
        recognizer = names["recognizer"]
    audio = dict(line.split(maxsplit=1) for line in open(os.path.join(data_dir, "wav.scp")))
    hyps = {}
    for utt in utts:
        samples, rate = sf.read(os.path.join(data_dir, audio[utt].strip()), dtype="float32")
        stream = recognizer.create_stream()
        stream.accept_waveform(rate, samples)
        recognizer.decode_stream(stream)
        hyps[utt] = stream.result.text.split()
    return hyps


def main(run, cv, train=None, data_dir=None):
    import onnxruntime as ort
    model, params, meta = load_model(run)
    kind = meta["tokens"]["kind"]
    unit = "phones" if kind == "phones" else "words"
    refs, _ = recognize.archive_references(unit, cv)
    train = train or meta["config"]["data.train"]
    mean, inv_std, speakers, frames = export_onnx.global_cmvn(train, meta["data"]["cmvn"])
    scope = meta["data"].get("cmvn_scope") or "speaker"
    if meta["data"].get("cmvn_stats") is not None:   # trained with global: the checkpoint's
        shift, inv_std = norm.global_shift_scale(np.asarray(meta["data"]["cmvn_stats"]),
                                                 meta["data"]["cmvn"])
        mean = -shift
    sessions = [ort.InferenceSession(export_onnx.graph(model, params, mean, inv_std, how)
                                     .SerializeToString(), providers=["CPUExecutionProvider"])
                for how in (None, meta["data"]["cmvn"])]
    greedy = family("ctc").search     # CTC greedy search: (model, params, outputs, tokens)
    trained, _ = greedy(None, None, ctc_outputs(model, params, cv, meta["data"]),
                            meta["tokens"])
    logposts = ([], [])
    for utt, feats in raw_utterances(cv):
        x = np.ascontiguousarray(feats, np.float32)
        for session, out in zip(sessions, logposts):
            log_probs, _ = session.run(None, {"x": x[None], "x_lens": np.array([len(x)])})
            out.append((utt, log_probs[0]))
    name = "PER" if unit == "phones" else "WER"
    print(f"{run} on {cv} ({len(trained)} utterances); global statistics of {train}: "
          f"{speakers} speakers, {frames} frames")
    systems = [(f"as trained, data.cmvn_scope {scope} (hpcsgd decode --greedy)", trained),
               ("--cmvn global (the ONNX export, onnxruntime)",
                greedy(None, None, logposts[0], meta["tokens"])[0]),
               ("--cmvn utterance (the ONNX export, onnxruntime)",
                greedy(None, None, logposts[1], meta["tokens"])[0])]
    if data_dir:
        systems.append(("the export's default --cmvn, sherpa-onnx from the audio files",
                        sherpa_hyps(run, train, data_dir, list(trained))))
    for label, hyps in systems:
        total, _ = recognize.error_counts(refs, hyps)
        scored = [u for u in trained if u in refs]
        (low, high), better = score.bootstrap([refs[u] for u in scored],
                                              [trained[u] for u in scored],
                                              [hyps[u] for u in scored])
        differ = sum(hyps[u] != trained[u] for u in trained)
        print(f"{label}: {score.kaldi_lines(name, total).splitlines()[0]}; "
              f"{differ} hypotheses differ from as trained, P(better than as trained) "
              f"{better:.3f} (bootstrap, as trained's 95% interval {low:.1f}-{high:.1f})")


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4, 5):
        sys.exit(__doc__)
    main(*sys.argv[1:])
