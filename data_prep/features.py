"""Kaldi-compatible features with kaldi-native-fbank: log-mel filterbank (default) or MFCC.

Options are Kaldi's compute-fbank-feats / compute-mfcc-feats defaults (25 ms window, 10 ms shift,
povey window, pre-emphasis 0.97, DC removal, snip_edges=true, mel low 20 Hz) except dither=0,
which makes features deterministic. Audio is read with soundfile (WAV, FLAC) and scaled to the
int16 range, as Kaldi reads 16-bit PCM (float sample * 32768). Speed perturbation (Kaldi's
perturb_data_dir_speed.sh, `sox speed f`) resamples with soxr before the features.
"""
import json
import os

import kaldi_native_fbank as knf
import numpy as np
import soundfile as sf
import soxr

from data_prep.kaldi_dir import BadUtterance

FRAME_SHIFT_MS = 10.0
FRAME_LENGTH_MS = 25.0


def extractor_config(feature_type="fbank", num_mel_bins=40, num_ceps=13, sample_rate=16000):
    """The full option set as a plain dict: stored in every shard (attrs extractor_config)."""
    if feature_type not in ("fbank", "mfcc"):
        raise ValueError(f"feature_type must be fbank or mfcc, not {feature_type!r}")
    config = {
        "library": "kaldi-native-fbank", "feature_type": feature_type,
        "sample_rate": sample_rate, "frame_shift_ms": FRAME_SHIFT_MS,
        "frame_length_ms": FRAME_LENGTH_MS, "dither": 0.0, "preemph_coeff": 0.97,
        "remove_dc_offset": True, "window_type": "povey", "round_to_power_of_two": True,
        "snip_edges": True, "num_mel_bins": num_mel_bins, "low_freq": 20.0, "high_freq": 0.0,
        "audio_scale": 32768.0,
    }
    if feature_type == "fbank":
        config.update(use_energy=False, use_log_fbank=True, use_power=True)
    else:
        config.update(num_ceps=num_ceps, use_energy=True, cepstral_lifter=22.0)
    return config


def feature_dim(config):
    return config["num_mel_bins"] if config["feature_type"] == "fbank" else config["num_ceps"]


def config_json(config):
    return json.dumps(config, sort_keys=True)


def _options(config):
    opts = knf.FbankOptions() if config["feature_type"] == "fbank" else knf.MfccOptions()
    fo = opts.frame_opts
    fo.samp_freq = float(config["sample_rate"])
    fo.frame_shift_ms = config["frame_shift_ms"]
    fo.frame_length_ms = config["frame_length_ms"]
    fo.dither = config["dither"]
    fo.preemph_coeff = config["preemph_coeff"]
    fo.remove_dc_offset = config["remove_dc_offset"]
    fo.window_type = config["window_type"]
    fo.round_to_power_of_two = config["round_to_power_of_two"]
    fo.snip_edges = config["snip_edges"]
    opts.mel_opts.num_bins = config["num_mel_bins"]
    opts.mel_opts.low_freq = config["low_freq"]
    opts.mel_opts.high_freq = config["high_freq"]
    opts.use_energy = config["use_energy"]
    if config["feature_type"] == "mfcc":
        opts.num_ceps = config["num_ceps"]
        opts.cepstral_lifter = config["cepstral_lifter"]
    return opts


def num_frames(num_samples, sample_rate):
    """Kaldi's frame count with snip_edges=true: 1 + (N - window) // shift, 0 if N < window."""
    window = int(sample_rate * FRAME_LENGTH_MS / 1000)
    shift = int(sample_rate * FRAME_SHIFT_MS / 1000)
    return 0 if num_samples < window else 1 + (num_samples - window) // shift


def read_audio(utt, path, start, end, sample_rate):
    """Samples (float32, int16 range) of [start, end) seconds of `path`; BadUtterance on failure."""
    # what libsndfile would only call "System error." or "Format not recognised"
    if os.path.isdir(path):
        raise BadUtterance("unreadable audio", f"{utt}: {path}: a directory, not an audio file")
    if not os.path.isfile(path):
        raise BadUtterance("unreadable audio", f"{utt}: {path}: no such file")
    if os.path.getsize(path) == 0:
        raise BadUtterance("empty audio", f"{utt}: {path}: empty file (0 bytes)")
    try:
        info = sf.info(path)
        if info.samplerate != sample_rate:
            raise BadUtterance("sample rate", f"{utt}: {path} has sample rate {info.samplerate} Hz, "
                                              f"expected --sample-rate {sample_rate}")
        first = int(round(start * sample_rate))
        last = None if end < 0 else int(round(end * sample_rate))
        samples, _ = sf.read(path, start=first, stop=last, dtype="float32", always_2d=True)
    except BadUtterance:
        raise
    except Exception as err:  # soundfile raises RuntimeError/LibsndfileError/OSError
        raise BadUtterance("unreadable audio", f"{utt}: cannot read {path} ({err})") from None
    if samples.shape[1] != 1:
        raise BadUtterance("unreadable audio", f"{utt}: {path} has {samples.shape[1]} channels, "
                                               f"expected mono")
    return samples[:, 0] * np.float32(32768.0)


def perturb_speed(samples, factor, sample_rate):
    """The utterance f times faster (shorter by 1/f, pitch up by f), as sox's `speed f` that
    Kaldi's perturb_data_dir_speed.sh runs: the samples read as if recorded at f * rate, then
    resampled to rate (soxr, its default high quality; deterministic). N samples -> about N / f."""
    out = soxr.resample(samples, factor * sample_rate, sample_rate)
    return np.ascontiguousarray(out, dtype=np.float32)


def compute(config, samples, utt="utterance"):
    """(T, D) float32 features of int16-range samples; BadUtterance if empty or not finite."""
    count = num_frames(len(samples), config["sample_rate"])
    if count == 0:
        raise BadUtterance("empty audio", f"{utt}: {len(samples)} samples, shorter than one "
                                          f"{FRAME_LENGTH_MS:g} ms frame")
    if config["feature_type"] == "fbank":
        online = knf.OnlineFbank(_options(config))
    else:
        online = knf.OnlineMfcc(_options(config))
    if not np.isfinite(samples).all():  # float WAV/FLAC can hold NaN/Inf; knf would raise mid-way
        raise BadUtterance("NaN/Inf features", f"{utt}: NaN/Inf audio samples (first at sample "
                                               f"{int(np.flatnonzero(~np.isfinite(samples))[0])})")
    try:
        online.accept_waveform(float(config["sample_rate"]), samples)
        online.input_finished()
    except RuntimeError as err:  # kaldi-native-fbank: e.g. "mel energy is nan"
        raise BadUtterance("NaN/Inf features", f"{utt}: feature extraction failed ({err})") from None
    feats = np.empty((online.num_frames_ready, feature_dim(config)), dtype=np.float32)
    for t in range(online.num_frames_ready):
        feats[t] = online.get_frame(t)
    if not np.isfinite(feats).all():
        raise BadUtterance("NaN/Inf features", f"{utt}: NaN/Inf in features (frame "
                                               f"{int(np.flatnonzero(~np.isfinite(feats).all(1))[0])}); "
                                               f"corrupt or non-finite audio samples?")
    return feats
