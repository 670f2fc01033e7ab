"""Loader throughput: spliced + CMVN-normalised frames/s against the raw HDF5 read rate.

The limit is reading the same feats from the same shards with h5py into a preallocated
buffer, measured in the same run. The loader runs on one core (numba and BLAS threads 1),
first synchronously (all work in the caller: the cost a trainer would see without prefetch),
then with the prefetch thread (what the trainer waits for when it consumes batches at once).
Both go through whole epochs. The frame loader (hpcsgd/data/loader.py: DNN, BLSTM chunks)
for an archive with frame labels, else the whole-utterance loader (data/utterances.py: CTC,
RNN-T; --loader to choose), at one rank. The process's peak resident memory (ru_maxrss) is
reported beside the rates: it must not grow with the archive.
Without an ARCHIVE, the bundled demo corpus is prepared into a temporary directory.
"""
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np

from hpcsgd.data import archive
from hpcsgd.data.loader import FrameLoader
from hpcsgd.data.utterances import UtteranceLoader

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = os.path.join(REPO, "data_prep", "demo", "so762")
TARGET_FPS = 200_000  # a GPU rank consumes > 100k frames/s; one core must feed twice that


def add_arguments(parser):
    parser.add_argument("archive", nargs="?", help="archive dir (default: prep the demo corpus)")
    parser.add_argument("--context", type=int, default=5, help="splice +-C frames")
    parser.add_argument("--batch", type=int, default=None,
                        help="minibatch frames (default: 1024; utterances: 8000, the LibriSpeech "
                             "CTC recipes' train.minibatch)")
    parser.add_argument("--loader", choices=["frames", "utterances"], default=None,
                        help="which loader (default: frames when the archive has frame labels, "
                             "else utterances)")
    parser.add_argument("--seconds", type=float, default=3.0, help="measure at least this long")
    parser.add_argument("--small", action="store_true", help="quick smoke test (CI)")


def _raw_read(index, seconds):
    """Frames/s of reading every shard's feats in 8192-frame blocks into one buffer."""
    dim = index["feature_dim"]
    block = 8192
    out = np.empty((block, dim), np.float32)
    frames, start = 0, time.perf_counter()
    while True:
        for shard in index["shards"]:
            with archive.open_shard(os.path.join(index["dir"], shard["file"])) as f:
                feats = f["feats"]
                for b in range(0, shard["frames"], block):
                    e = min(b + block, shard["frames"])
                    feats.read_direct(out, np.s_[b:e], np.s_[0:e - b])
                    frames += e - b
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return frames / elapsed


def _utterance_rate(archive_dir, batch, seconds, prefetch):
    """The trainer's calls at one rank (resume, take, next_batch), whole epochs; the first
    kind of tokens the archive has (what a CTC model reads beside the features)."""
    kinds = sorted(archive.read_index(archive_dir)["tokens"])
    loader = UtteranceLoader(archive_dir, tokens=kinds[0] if kinds else None, minibatch=batch,
                             prefetch=prefetch)
    loader.resume(0, [0])
    take = loader.take(batch, [0])
    loader.next_batch(int(take[0]))   # outside the timing, as the frame loader's first batch
    frames, epoch, done, start = 0, 0, 0, time.perf_counter()
    loader.resume(epoch, [0])
    while True:
        take = loader.take(batch, [done])
        if take[0] == 0:   # the epoch's end
            if time.perf_counter() - start >= seconds:
                break
            epoch, done = epoch + 1, 0
            loader.resume(epoch, [0])
            continue
        x, _ = loader.next_batch(int(take[0]))
        frames += int(take[0])
        done += int(take[0])
    elapsed = time.perf_counter() - start
    loader.close()
    return frames / elapsed


def _peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


def _loader_rate(archive_dir, context, batch, seconds, prefetch):
    loader = FrameLoader(archive_dir, context=context, max_batch=batch, prefetch=prefetch)
    loader.start_epoch(0)
    loader.next_batch(batch)  # compile the kernels outside the timing
    frames, epoch, start = 0, 0, time.perf_counter()
    while True:
        x, _ = loader.next_batch(batch)
        frames += len(x)
        if loader.remaining == 0:
            if time.perf_counter() - start >= seconds:
                break
            epoch += 1
            loader.start_epoch(epoch)
    elapsed = time.perf_counter() - start
    loader.close()
    return frames / elapsed


def run(args):
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    seconds = 0.3 if args.small else args.seconds
    tmp = None
    archive_dir = args.archive
    if archive_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="hpcsgd-bench-")
        archive_dir = os.path.join(tmp.name, "demo")
        subprocess.run([sys.executable, "-m", "hpcsgd.cli", "prep", DEMO, archive_dir,
                        "--alignments", os.path.join(DEMO, "phones.ctm"),
                        "--labels", os.path.join(DEMO, "labels.txt")],
                       check=True, stdout=subprocess.DEVNULL)
    index = archive.read_index(archive_dir)
    kind = args.loader or ("frames" if index.get("frame_labels", True) else "utterances")
    batch = args.batch or (1024 if kind == "frames" else 8000)
    raw = _raw_read(index, seconds)
    rss_raw = _peak_rss_mb()   # the interpreter, h5py, numba and the raw read's buffer
    dim = index["feature_dim"]
    if kind == "frames":
        sync = _loader_rate(archive_dir, args.context, batch, seconds, prefetch=False)
        pre = _loader_rate(archive_dir, args.context, batch, seconds, prefetch=True)
        what, width = "loader", (2 * args.context + 1) * dim
    else:
        sync = _utterance_rate(archive_dir, batch, seconds, prefetch=False)
        pre = _utterance_rate(archive_dir, batch, seconds, prefetch=True)
        what, width = "utterance loader", dim
    rss = _peak_rss_mb()
    rows = [
        ("raw HDF5 read (limit)", raw, 1.0),
        (f"{what}, 1 core, no prefetch ({width}-dim)", sync, sync / raw),
        (f"{what}, prefetch thread ({width}-dim)", pre, pre / raw),
    ]
    print(f"archive {archive_dir}: {index['total_frames']} frames x {dim}, "
          f"{index['total_utterances']} utterances, batch {batch}")
    print(f"{'what':56s} {'frames/s':>12s} {'vs raw read':>12s}")
    for name, fps, ratio in rows:
        print(f"{name:56s} {fps:12,.0f} {ratio:12.2f}")
    print(f"peak resident memory {rss:,.0f} MB (ru_maxrss; {rss_raw:,.0f} MB before the loaders)")
    print(f"target: >= {TARGET_FPS:,} {'spliced ' if kind == 'frames' else ''}frames/s from "
          f"one core: {'met' if sync >= TARGET_FPS else 'NOT met'}")
    if tmp is not None:
        tmp.cleanup()
    return {"archive": args.archive or "(the bundled demo corpus, prepared here)",
            "loader": kind, "context": args.context if kind == "frames" else 0, "batch": batch,
            "frames": int(index["total_frames"]), "raw_read_fps": raw,
            "loader_sync_fps": sync, "loader_prefetch_fps": pre,
            "loader_sync_of_raw": sync / raw, "target_fps": TARGET_FPS,
            "peak_rss_mb": rss, "rss_before_loaders_mb": rss_raw}


def figures(res):
    out = {"raw HDF5 read frames/s": res["raw_read_fps"],
           "loader frames/s, no prefetch": res["loader_sync_fps"],
           "loader frames/s, prefetch": res["loader_prefetch_fps"],
           "loader / raw read": res["loader_sync_fps"] / res["raw_read_fps"],
           "loader / target": res["loader_sync_fps"] / res["target_fps"]}
    if "peak_rss_mb" in res:   # results before 2026-11-29 lack it
        out["peak resident MB"] = res["peak_rss_mb"]
    return out
