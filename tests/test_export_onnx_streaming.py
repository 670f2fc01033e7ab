"""`hpcsgd export --onnx --streaming` (hpcsgd/export_onnx_streaming.py): the streaming
graphs fed chunk by chunk with the LSTM states carried against hpcsgd's whole-utterance
forward (float32 and float64); tiny causal RNN-T and CTC models trained on the bundled demo
corpus, exported, and decoded by sherpa-onnx's online recognizer from the FLAC files as they
arrive in 0.32 s pieces, against hpcsgd's greedy searches; the models and options it refuses."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO, assert_float32_close, run_train
from hpcsgd.export import write_onnx
from hpcsgd import export_onnx, export_onnx_streaming as streaming
from hpcsgd.errors import UserError
from hpcsgd.model import build

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")

PIECE_S = 0.32   # the audio handed to sherpa-onnx at a time, as a microphone would


def causal_model(kind, encoder, seed=1, tokens=7):
    describe = {"type": kind, "input_dim": 40, "encoder": encoder, "num_tokens": tokens,
                "activation": "relu"}
    if kind == "rnnt":
        describe.update(predictor=["lstm 6"], embed=5, joint=9, joint_mode="add")
    model = build(describe, max_batch=256)
    params = model.new_params()
    model.init(params, np.random.default_rng(seed))
    return model, params


def run_chunks(session, x, chunk, frames=None):
    """The graph over x (N, T, D) in chunks of `chunk` frames, every state starting at zero
    (as sherpa-onnx starts a stream) and carried from each call's outputs to the next's
    inputs -> the first output of all chunks, concatenated over time. frames: each call
    reads that many (the chunk and its lookahead), as long as x has them (sherpa-onnx's
    rule: T frames a call, the chunk's shift between calls)."""
    inputs = session.get_inputs()[1:]
    states = {i.name: np.zeros([x.shape[0] if d == "N" else d for d in i.shape],
                               np.int64 if i.type == "tensor(int64)" else np.float32)
              for i in inputs}
    outs = []
    frames = frames or chunk
    for s in range(0, x.shape[1] - frames + 1, chunk):
        res = session.run(None, {"x": x[:, s:s + frames], **states})
        outs.append(res[0])
        states = dict(zip([i.name for i in inputs], res[1:]))
    return np.concatenate(outs, axis=1)


@pytest.mark.parametrize("kind", ["rnnt", "ctc"])
def test_chunks_with_the_states_carried_equal_the_whole_utterance(kind):
    """Two utterances of 72 frames in one batch, through the streaming graph in chunks of 12
    frames (stack 3 and a stride of 2 cut them where they cut the utterance) with h and c
    carried: each
    utterance's output is hpcsgd's whole-utterance forward (the RNN-T's encoder projection,
    CTC's log-posteriors) as far from the float64 forward as hpcsgd's float32 one is; one
    chunk of all 72 frames gives the same. The encoder has two LSTMs of different widths (the
    state tensors (2, N, 7), the 5-cell layer's zero-padded) between a frame-wise strided
    conv, its layer norm, and a dense layer."""
    from test_export_onnx import hpcsgd_outputs
    model, params = causal_model(kind, ["stack 3", "conv 8 k1 s2 ln", "lstm 5", "dense 6",
                                        "lstm 7"])
    rng = np.random.default_rng(0)
    mean = rng.normal(5, 2, 40).astype(np.float32)
    inv_std = rng.uniform(0.3, 2, 40).astype(np.float32)
    raw = rng.normal(mean, 1 / inv_std, (2, 72, 40)).astype(np.float32)
    build_graph = streaming.rnnt_encoder_graph if kind == "rnnt" else streaming.ctc_graph
    proto = build_graph(model, params, mean, inv_std, 12)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    got = run_chunks(session, raw, 12)
    ref32 = hpcsgd_outputs(model.describe, params, (raw - mean) * inv_std, [72, 72],
                           np.float32)
    x64 = (raw.astype(np.float64) - mean.astype(np.float64)) * inv_std.astype(np.float64)
    ref64 = hpcsgd_outputs(model.describe, params, x64, [72, 72], np.float64)
    for b in range(2):
        assert got[b].shape == ref32[b].shape == (12, 9 if kind == "rnnt" else 7)
        assert_float32_close(got[b], ref32[b], ref64[b])
    whole = run_chunks(session, raw, 72)
    for b in range(2):
        assert_float32_close(whole[b], ref32[b], ref64[b])


def streamed_and_whole(kind, model, params, seed, frames):
    """90 frames of two random utterances (their own mean and scale) through the streaming
    graph in chunks of 12 frames, each call reading `frames` (chunk + lookahead), and
    through hpcsgd's whole-utterance forward in float32 and float64 -> (the session, the
    raw frames, their mean, the streamed outputs, ref32, ref64); the graph's metadata
    checked: T = frames, decode_chunk_len 12."""
    from test_export_onnx import hpcsgd_outputs
    rng = np.random.default_rng(seed)
    mean = rng.normal(5, 2, 40).astype(np.float32)
    inv_std = rng.uniform(0.3, 2, 40).astype(np.float32)
    raw = rng.normal(mean, 1 / inv_std, (2, 90, 40)).astype(np.float32)
    build_graph = streaming.rnnt_encoder_graph if kind == "rnnt" else streaming.ctc_graph
    proto = build_graph(model, params, mean, inv_std, 12)
    props = {p.key: p.value for p in proto.metadata_props}
    assert (props["T"], props["decode_chunk_len"]) == (str(frames), "12")
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    ref32 = hpcsgd_outputs(model.describe, params, (raw - mean) * inv_std, [90, 90],
                           np.float32)
    x64 = (raw.astype(np.float64) - mean.astype(np.float64)) * inv_std.astype(np.float64)
    ref64 = hpcsgd_outputs(model.describe, params, x64, [90, 90], np.float64)
    return session, raw, mean, run_chunks(session, raw, 12, frames), ref32, ref64


@pytest.mark.parametrize("kind", ["rnnt", "ctc"])
def test_chunks_with_their_lookahead_equal_the_whole_utterance(kind):
    """An encoder with two lookahead convs (`conv F kK ahead`, one above each LSTM: the
    first's 2 steps at stride 6 and the second's 1 read 18 input frames past a chunk) in
    chunks of 12 frames, each call reading 30 (T = chunk + lookahead, advancing by the
    chunk, as sherpa-onnx feeds them): each utterance's output equals hpcsgd's forward over
    all the frames fed, up to the last step whose lookahead those frames hold, within the
    float32 bound; the metadata say T 30, decode_chunk_len 12."""
    model, params = causal_model(kind, ["stack 3", "conv 8 k1 s2 ln", "lstm 5",
                                        "conv 6 k3 ahead", "lstm 7", "conv 6 k2 ahead"])
    assert streaming.lookahead_frames(model) == 18
    session, raw, mean, got, ref32, ref64 = streamed_and_whole(kind, model, params, 2, 30)
    for b in range(2):   # 6 calls of 2 steps; the forward's last 3 read zeros past the end
        assert got[b].shape == (12, 9 if kind == "rnnt" else 7)
        assert_float32_close(got[b], ref32[b][:12], ref64[b][:12])
    # the first call reads the lookahead: frames 24 on changed (to the mean), step 0 (frames
    # 0-23) stays bit for bit, step 1 (frames 6-29) moves
    cut = raw.copy()
    cut[:, 24:] = mean
    moved = run_chunks(session, cut, 12, 30)
    assert np.array_equal(moved[:, 0], got[:, 0]) and (moved[:, 1] != got[:, 1]).any(axis=-1).all()


@pytest.mark.parametrize("kind, window", [("rnnt", ""), ("ctc", ""), ("ctc", " l2")])
def test_a_chunked_blstm_streams_as_it_trained(kind, window):
    """A chunked BLSTM (`blstm 4 c4 r2`: windows of 4 steps and 2 ahead, from zero states;
    ` l2`: two BLSTMs inside each window) above a forward LSTM and a lookahead conv: the
    export's chunk is the BLSTM's, 12 frames, each call reading 21 (the conv's 3 frames and
    the BLSTM's 6 ahead, for one window layer or two); 6 calls over 90 frames equal hpcsgd's
    forward on its first 24 steps within the float32 bound; the state tensors hold the one
    forward LSTM only."""
    model, params = causal_model(kind, ["stack 3", "lstm 5", "conv 6 k2 ahead",
                                        "blstm 4 c4 r2" + window, "dense 6"])
    assert streaming.lookahead_frames(model) == 9 and streaming.chunk_frames(model, None) == 12
    assert streaming.state_size(model) == (1, 5)
    with pytest.raises(UserError, match="trained on chunks of 120 ms"):
        streaming.chunk_frames(model, 300)
    _, _, _, got, ref32, ref64 = streamed_and_whole(kind, model, params, 4, 21)
    for b in range(2):
        assert got[b].shape == (24, 9 if kind == "rnnt" else 7)
        assert_float32_close(got[b], ref32[b][:24], ref64[b][:24])


def test_a_dense_only_encoder_passes_its_state_through():
    """No LSTM: the graph still has the loader's h and c (1, N, 1), returned as they came."""
    model, params = causal_model("rnnt", ["stack 2", "dense 8"])
    session = ort.InferenceSession(
        streaming.rnnt_encoder_graph(model, params, np.zeros(40), np.ones(40), 4)
        .SerializeToString(), providers=["CPUExecutionProvider"])
    h = np.full((1, 3, 1), 0.5, np.float32)
    out, h1, c1 = session.run(None, {"x": np.ones((3, 4, 40), np.float32), "h": h,
                                     "c": 2 * h})
    assert out.shape == (3, 2, 9) and (h1 == h).all() and (c1 == 2 * h).all()


def make_run(tmp_path, encoder, kind="rnnt"):
    from test_export_onnx import fake_run
    describe = {"type": kind, "input_dim": 4, "num_tokens": 5, "activation": "relu",
                "encoder": encoder}
    if kind == "rnnt":
        describe.update(predictor=["lstm 4"], embed=4, joint=6)
    return fake_run(tmp_path / "run", describe)


@pytest.mark.parametrize("encoder, words", [
    (["blstm 3"], "'blstm 3' cannot stream: its backward direction starts at the "
                  "utterance's end"),
    (["conv 4 k4", "lstm 3"], "'conv 4 k4' cannot stream: hpcsgd's convolutions are "
                              "centred: it reads 1 frames behind and 2 ahead"),
    (["lstm 3", "conv 4 k3 s2 ahead"], "'conv 4 k3 s2 ahead' cannot stream: a strided "
                                       "lookahead conv"),
    (["blstm 3 c2 r1", "conv 4 k2 ahead"], "'conv 4 k2 ahead' cannot stream above the chunked "
                                           "BLSTM 'blstm 3 c2 r1'"),
    (["conv 4 k1 in", "lstm 3"], "'conv 4 k1 in' cannot stream: its instance norm"),
    (["conv2d 2 8", "conformer 8 h2 f16 k3"], "'conv2d 2 8' cannot stream: its 3x3 kernels "
                                              "read the next frame"),
    (["dense 8", "conformer 8 h2 f16 k3"], "'conformer 8 h2 f16 k3' cannot stream: its "
                                           "self-attention reads the whole utterance"),
], ids=["blstm", "centred-conv", "strided-lookahead", "above-chunked", "instance-norm",
        "conv2d", "conformer"])
def test_a_layer_that_reads_ahead_is_named(encoder, words, tmp_path):
    run = make_run(tmp_path, encoder)
    with pytest.raises(UserError, match=words.replace("(", r"\(")):
        write_onnx(run, str(tmp_path / "out"), streaming=True)
    assert not os.path.exists(tmp_path / "out")


def test_a_chunked_blstm_exports_for_streaming_only(tmp_path):
    run = make_run(tmp_path, ["lstm 3", "blstm 3 c2 r1"], kind="ctc")
    with pytest.raises(UserError, match="'blstm 3 c2 r1' is a chunked BLSTM: it runs on "
                                        "chunks as they arrive, so export it with --streaming"):
        write_onnx(run, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out")


def test_the_command_line_names_misplaced_options(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "export", str(tmp_path),
                           "--int8", "--out", "m.h5", "--streaming"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 2 and "error: --streaming: for --onnx only" in proc.stderr


def test_options_it_refuses_are_named(tmp_path):
    run = make_run(tmp_path, ["stack 3", "lstm 3"], kind="ctc")
    out = str(tmp_path / "out")
    with pytest.raises(UserError, match="--cmvn utterance with --streaming: a stream has no "
                                        "utterance statistics before its end"):
        write_onnx(run, out, cmvn="utterance", streaming=True)
    with pytest.raises(UserError, match="--chunk-ms: for --streaming only"):
        write_onnx(run, out, chunk_ms=300)
    model = build({"type": "ctc", "input_dim": 4, "num_tokens": 5, "activation": "relu",
                   "encoder": ["stack 3", "lstm 3"]})
    with pytest.raises(UserError, match="--chunk-ms 320: expected a multiple of 30 ms"):
        streaming.chunk_frames(model, 320)
    assert streaming.chunk_frames(model, 300) == 30
    assert streaming.chunk_frames(model, None) == 30   # the most within 320 ms
    assert not os.path.exists(out)


TRAIN = {"rnnt": ["model.type=rnnt", "model.predictor=[lstm 32]", "model.embed=16",
                  "model.joint=48", "train.epochs=16", "optim.lr=1e-5"],
         "ctc": ["model.type=ctc", "model.frame_ce=0.5", "train.epochs=20", "optim.lr=5e-6"]}
ENCODER = {"rnnt": "[stack 3, lstm 64]", "ctc": "[stack 3, lstm 64]",
           "ctc-ahead": "[stack 3, lstm 64, conv 64 k3 ahead]",   # 60 ms of lookahead
           "rnnt-chunked": "[stack 3, lstm 64, blstm 32 c10 r2]"}   # 300 ms chunks, 60 ahead


@pytest.fixture(scope="module", params=["rnnt", "ctc", "ctc-ahead", "rnnt-chunked"])
def exported(request, demo_tokens, tmp_path_factory):
    """A tiny causal phone model (stack 3, lstm 64; the RNN-T with an lstm 32 predictor, CTC
    with a frame CE head; ctc-ahead: CTC with a lookahead conv reading 2 steps ahead on top)
    trained on the demo corpus' 32 training speakers (as the offline
    export tests train theirs), exported with `hpcsgd export --onnx --streaming`: (kind, run,
    out_dir, the command's stdout)."""
    pytest.importorskip("sherpa_onnx")
    base = tmp_path_factory.mktemp(f"onnx_streaming_{request.param}")
    kind = request.param.split("-")[0]
    run, out = str(base / "run"), str(base / "onnx")
    proc = run_train(1, [f"data.train={demo_tokens}/train", f"data.cv={demo_tokens}/cv",
                         f"train.run_dir={run}", f"model.encoder={ENCODER[request.param]}",
                         "data.tokens=phones", "train.minibatch=2000", "optim.type=adam",
                         "optim.momentum_tc=0", "schedule.type=constant", *TRAIN[kind]],
                     timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cli = subprocess.run([sys.executable, "-m", "hpcsgd.cli", "export", run, "--onnx", out,
                          "--streaming"], capture_output=True, text=True, timeout=300,
                         cwd=REPO)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    return kind, run, out, cli.stdout


def hpcsgd_greedy(kind, run, feats, train, beam=0, steps=None):
    """hpcsgd's greedy search (RNN-T: at most one symbol per frame, sherpa-onnx's rule) on
    raw features normalised with the global statistics of `train` -> (phones, the encoder
    frame of each: where CTC's run of it starts, where the transducer emits it). RNN-T with
    beam: its modified beam search of that many, the final hypotheses ranked by log-prob per
    token as sherpa-onnx ranks them (hpcsgd ranks by log-prob) -> phones. steps: over the encoder's first
    that many output steps only (those the lookahead frames after them were read for)."""
    from hpcsgd.decode import ctc, rnnt, timestamps
    from hpcsgd.model.lengths import Lengths
    from hpcsgd.model_io import load_model
    model, params, meta = load_model(run)
    symbols = np.array(meta["tokens"]["symbols"])
    mean, inv_std, _, _ = export_onnx.global_cmvn(train, "meanvar")
    x = np.ascontiguousarray((feats.astype(np.float32) - mean) * inv_std, np.float32)
    out = np.array(model.forward(params, x, len(x), lengths=[len(x)]))[:steps]
    if kind == "ctc":
        runs = timestamps.token_runs(out.argmax(axis=1))
        assert [k for k, _, _ in runs] == ctc.greedy_search(out).tolist()
        return list(symbols[[k for k, _, _ in runs]]), [first for _, first, _ in runs]
    if beam:   # the final pick as sherpa-onnx's: the best log-prob per token, the tokens
        # counted with the decoder's context of blanks (Hypotheses::GetMostProbable(true))
        from hpcsgd.export_onnx_rnnt import CONTEXT_SIZE
        ranked = rnnt.beam_search(model.layers[-1], params, out, Lengths([len(out)]), beam,
                                  nbest=beam)[0]
        ys, _ = max(ranked, key=lambda r: r[1] / (CONTEXT_SIZE + len(r[0])))
        return list(symbols[ys])
    at = []
    ids = rnnt.greedy_search(model.layers[-1], params, out, Lengths([len(out)]), 1,
                             emitted=at)[0]
    return list(symbols[ids]), at[0].tolist()


def sherpa_online(code, samples, rate):
    """Decode int16-range `samples` with the recognizer `code` builds, as its printed
    comments say: PIECE_S at a time, decoding whatever is ready after each, then the tail
    padding and input_finished -> (phones, their timestamps (s, sherpa-onnx's: 40 ms an
    encoder step), the audio time (s, the padding included) at which each first appeared in
    the result, the chunks decoded)."""
    names = {}
    exec(code, names)   # the printed call, as a user would paste it
    recognizer = names["recognizer"]
    tail = int(code.split("np.zeros(")[1].split(",")[0])
    s = recognizer.create_stream()
    piece, fed, chunks, seen = int(PIECE_S * rate), 0, 0, []
    pieces = [samples[i:i + piece] for i in range(0, len(samples), piece)]
    for k, part in enumerate(pieces + [np.zeros(tail, np.float32)]):
        s.accept_waveform(rate, part / 32768.0)
        fed += len(part)
        if k == len(pieces):
            s.input_finished()
        while recognizer.is_ready(s):
            recognizer.decode_stream(s)
            chunks += 1
        tokens = recognizer.get_result(s).tokens
        seen += [fed / rate] * (len(tokens) - len(seen))
    result = recognizer.get_result(s)
    # sherpa-onnx writes tokens.txt's word-start mark as a space
    return [t.strip() for t in result.tokens], list(result.timestamps), seen, chunks


def sherpa_batch(code, utterances, rate):
    """All `utterances` (int16-range samples) streamed at once, PIECE_S of each at a time,
    sherpa-onnx decoding the streams that are ready in batches (decode_streams: the states
    stacked along N) -> each one's phones."""
    names = {}
    exec(code, names)
    recognizer = names["recognizer"]
    tail = int(code.split("np.zeros(")[1].split(",")[0])
    piece = int(PIECE_S * rate)
    streams = [recognizer.create_stream() for _ in utterances]
    pieces = [[x[i:i + piece] for i in range(0, len(x), piece)] for x in utterances]
    for k in range(max(map(len, pieces)) + 1):
        for s, parts in zip(streams, pieces):
            if k < len(parts):
                s.accept_waveform(rate, parts[k] / 32768.0)
            elif k == len(parts):
                s.accept_waveform(rate, np.zeros(tail, np.float32))
                s.input_finished()
        while True:
            ready = [s for s in streams if recognizer.is_ready(s)]
            if not ready:
                break
            recognizer.decode_streams(ready)
    return [[t.strip() for t in recognizer.get_result(s).tokens] for s in streams]


def test_sherpa_onnx_streams_the_audio_as_hpcsgd_decodes_it(exported, demo_tokens):
    """sherpa-onnx's online recognizer, loaded by the printed call, decodes each of the
    training archive's first 40 FLAC files as they arrive (0.32 s pieces, the tail padding,
    input_finished), one stream at a time and all 40 at once in batches, to the phones
    hpcsgd's greedy search (RNN-T: one symbol per frame; and modified_beam_search of 4
    paths as hpcsgd's beam search of 4) finds on the features hpcsgd computes from the same
    padded audio, cut where sherpa-onnx stopped (its last full chunk) and normalised with
    the same global statistics; each token at the encoder step hpcsgd emits it at
    (sherpa-onnx's timestamps take 40 ms a step: stride 3 makes them 30). Printed: how many
    hypotheses differ from hpcsgd's on the archive's features (the audio without the
    padding), and the latency."""
    import soundfile as sf
    from data_prep import features
    from hpcsgd.data import archive
    from hpcsgd.data.loader import iter_utterances
    from hpcsgd.model_io import load_model
    kind, run, out, stdout = exported
    code = stdout[stdout.index("import numpy as np"):]
    train = f"{demo_tokens}/train"
    config = json.loads(archive.read_index(train)["extractor_config"])
    model = load_model(run)[0]
    chunk = streaming.chunk_frames(model, None)
    ahead = streaming.lookahead_frames(model)   # frames each call reads past its chunk
    tail = int(code.split("np.zeros(")[1].split(",")[0])
    demo = os.path.join(REPO, "data_prep", "demo", "so762")
    audio = dict(line.split() for line in open(os.path.join(demo, "wav.scp")))
    same_offline, phones, delays, first, bound, hyps, clips = 0, 0, [], [], [], [], []
    for n, (utt, feats, _) in enumerate(iter_utterances(train, cmvn="none", shuffle=False)):
        if n == 40:
            break
        samples = sf.read(os.path.join(demo, audio[utt]), dtype="float32")[0] * 32768
        hyp, stamps, seen, chunks = sherpa_online(code, samples, 16000)
        hyps.append(hyp)
        clips.append(samples)
        padded = features.compute(config, np.concatenate([samples, np.zeros(tail,
                                                                             np.float32)]))
        # hpcsgd's features of the padded audio begin with the archive's, bit for bit
        assert np.array_equal(padded[:len(feats)], feats)
        # sherpa-onnx decodes a chunk once a frame past it and its lookahead has arrived
        assert len(feats) <= chunks * chunk <= len(padded) - 1 - ahead
        fed_frames, steps = padded[:chunks * chunk + ahead], chunks * chunk // 3
        want, at = hpcsgd_greedy(kind, run, fed_frames, train, steps=steps)
        assert hyp == want, utt
        assert np.rint(np.array(stamps) / 0.04).tolist() == at   # the same encoder steps
        if kind == "rnnt":   # and modified_beam_search with 4 active paths: hpcsgd's beam 4
            beam = code.replace('"greedy_search"', '"modified_beam_search", max_active_paths=4')
            assert sherpa_online(beam, samples, 16000)[0] == \
                hpcsgd_greedy(kind, run, fed_frames, train, beam=4, steps=steps), utt
        offline, _ = hpcsgd_greedy(kind, run, feats, train)
        same_offline += offline == hyp
        phones += len(hyp)
        # latency: from the start of the 30 ms step a token was emitted at to the audio
        # time it appeared at in the result (pieces of 0.32 s); and to the earliest time
        # sherpa-onnx could have it: its chunk's last frame and one more (25 ms windows
        # every 10 ms), with the audio handed over sample by sample
        had = [s - 0.03 * t for s, t in zip(seen, at)]
        ready = [0.015 + 0.01 * ((3 * t // chunk + 1) * chunk + ahead + 1) - 0.03 * t
                 for t in at]
        delays += had
        bound += ready
        first += had[:1]
    assert phones > 20   # not an all-blank model
    assert sherpa_batch(code, clips, 16000) == hyps
    print(f"{kind}: {phones} phones in 40 hypotheses; equal to hpcsgd's greedy on the "
          f"unpadded features: {same_offline} of 40; chunk {chunk} frames ({chunk * 10} ms), "
          f"lookahead {ahead * 10} ms; "
          f"from a token's step to the audio time it appeared at (0.32 s pieces): mean "
          f"{np.mean(delays):.3f} s (min {np.min(delays):.3f}, max {np.max(delays):.3f}), "
          f"the first token of each hypothesis {np.mean(first):.3f} s ({len(first)} "
          f"hypotheses); fed sample by sample: mean {np.mean(bound):.3f} s (min "
          f"{np.min(bound):.3f}, max {np.max(bound):.3f})")


def test_the_export_writes_what_sherpa_onnx_reads(exported):
    """The files, the state inputs and outputs, and the metadata the online loaders read."""
    import onnx
    kind, run, out, stdout = exported
    graph = "encoder" if kind == "rnnt" else "model"
    proto = onnx.load(os.path.join(out, f"{graph}.onnx"))
    props = {p.key: p.value for p in proto.metadata_props}
    names = [i.name for i in proto.graph.input]
    from hpcsgd.model_io import load_model
    ahead = {"ctc-ahead": 6, "rnnt-chunked": 6}.get(os.path.basename(os.path.dirname(run))
                                                   .rstrip("0123456789")[len("onnx_streaming_"):],
                                                   0)   # 2 steps of 3 frames
    assert streaming.lookahead_frames(load_model(run)[0]) == ahead
    assert props["decode_chunk_len"] == "30" and "streaming" in props
    assert int(props["T"]) == 30 + ahead
    if kind == "rnnt":
        assert names == ["x", "h", "c"]
        assert [o.name for o in proto.graph.output] == ["encoder_out", "next_h", "next_c"]
        assert props["model_type"] == "lstm" and props["num_encoder_layers"] == "1"
        assert props["rnn_hidden_size"] == props["d_model"] == "64"
        assert 'model_type="lstm"' in stdout
        for part in ("decoder", "joiner"):
            assert os.path.exists(os.path.join(out, f"{part}.onnx"))
    else:
        assert names[:4] == ["x", "h", "cached_nonlin_attn", "c"] and len(names) == 9
        assert props["left_context_len"] == "1" and props["query_head_dims"] == "64"
        assert "OnlineZipformer2CtcModelConfig" in stdout
    assert open(os.path.join(out, "tokens.txt")).readline() == "<blk> 0\n"
    assert "snip_edges=True" in stdout and "chunks of 30 frames (300 ms)" in stdout
