"""TensorBoard event files (train.tensorboard, hpcsgd/tensorboard.py) read back by TensorBoard's
own reader: every scalar equals its metrics.jsonl value rounded to float32, a resumed run is one
line with no repeated step, only rank 0 imports the writer's library, and a run without it
trains and says why nothing was written."""
import json
import os

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator
from tensorboard.plugins.hparams import metadata as hparams_metadata

from conftest import make_archive, run_train
from hpcsgd import checkpoint, config, metrics, tensorboard

# the scalars issue 47 asks for; the first test's run has every one of them
ASKED = {"train/ce", "train/accuracy", "cv/ce", "cv/accuracy", "lr", "throughput/frames_per_s",
         "comm/exposed_s", "comm/bytes_per_step", "exchange/bits", "precision/loss_scale",
         "precision/skipped_steps", "probe/minibatch"}


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tb_archive"))
    make_archive(out, num_shards=2, utts_per_shard=10)
    return out


def options(arch, run, *extra):
    return [f"data.train={arch}", f"data.cv={arch}", f"train.run_dir={run}", "data.context=2",
            "model.hidden=[16]", "train.minibatch=64", "train.epochs=2",
            "train.log_every_frames=1000", "train.log_every_seconds=0", *extra]


def train(K, arch, run, *extra, env=None):
    proc = run_train(K, options(arch, run, *extra), timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def read_board(run):
    """{tag: [(step, value)]} as TensorBoard's reader returns them, and the HParams."""
    acc = event_accumulator.EventAccumulator(os.path.join(run, tensorboard.DIR),
                                             size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    board = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    try:
        content = acc.PluginTagToContent("hparams")[tensorboard.HPARAMS]
    except KeyError:   # no HParams in these files
        return board, None
    return board, hparams_metadata.parse_session_start_info_plugin_data(content)


def records(run):
    return [json.loads(line) for line in open(os.path.join(run, metrics.METRICS))]


def assert_board_is_the_metrics(run):
    """Every scalar of metrics.jsonl in TensorBoard at its frames, no other point, and equal to
    the JSON value rounded to float32 (an event stores a float32; JSON keeps the float64
    exactly, so the rounding is the whole difference). Returns the board."""
    want = {}
    for record in records(run):
        for tag, value in tensorboard.scalars(record):
            want.setdefault(tag, {}).setdefault(record["frames"], []).append(value)
    board, _ = read_board(run)
    assert set(board) == set(want), (sorted(board), sorted(want))
    for tag, points in want.items():
        steps = [step for step, _ in board[tag]]
        assert steps == sorted(points) and len(set(steps)) == len(steps), (tag, steps)
        for step, value in board[tag]:
            # two records at one frame (an adaptive width's change and a log line) agree
            assert len(set(points[step])) == 1, (tag, step, points[step])
            assert value == float(np.float32(points[step][0])), (tag, step, value, points[step])
    return board


def test_every_scalar_equals_metrics_jsonl_and_the_config_is_the_hparams(arch, tmp_path):
    """One short run on 2 ranks with every kind of scalar: CV, the adaptive bit width
    (mqgrad), mixed precision with a backoff loss scale that skips steps, the minibatch probe,
    double buffering (the achieved overlap)."""
    run = str(tmp_path / "all")
    train(2, arch, run, "exchange.aggregation=striped", "exchange.codec=kbit",
          "exchange.bits=mqgrad", "exchange.bits_every_steps=2", "train.precision=mixed",
          "train.loss_scale=backoff", "train.loss_scale_window=5",
          "train.probe_every_frames=2000", "train.probe_frames=300",
          "exchange.double_buffering=true", "train.log_every_frames=500")
    board = assert_board_is_the_metrics(run)
    assert ASKED <= set(board), sorted(ASKED - set(board))
    kinds = {r["kind"] for r in records(run)}
    assert {"bits", "probe", "skip", "epoch"} <= kinds   # the run did what it is meant to
    assert board["precision/skipped_steps"][-1][1] > 0
    assert len(board["cv/accuracy"]) == 2 and len(board["probe/minibatch"]) >= 2
    # the step axis is frames: the last CV point is at the run's last frame
    assert board["cv/accuracy"][-1][0] == records(run)[-1]["frames"]
    # only rank 0 wrote: one file, this start's
    assert len(tensorboard.event_files(os.path.join(run, tensorboard.DIR))) == 1
    # HParams: the resolved config (config.yaml) and the number of ranks
    _, start = read_board(run)
    saved = config.load(os.path.join(run, "config.yaml"))
    assert set(start.hparams) == set(saved) | {"run.ranks"}
    assert start.hparams["run.ranks"].number_value == 2
    for key, value in saved.items():
        got = start.hparams[key]
        if isinstance(value, bool):
            assert got.bool_value == value, key
        elif isinstance(value, (int, float)):
            assert got.number_value == value, key
        else:
            assert got.string_value == (value if isinstance(value, str) else str(value)), key


def test_a_resumed_run_is_one_line_without_repeated_steps(arch, tmp_path):
    """A run of 2 epochs, then the same run resumed from its checkpoint in the middle, as if
    the first attempt had been killed after it: the events after that checkpoint are dropped,
    the resumed run appends, and every scalar's steps are strictly increasing. Resume is
    bit-exact, so the curves are the uninterrupted run's; and the bytes per step are those of
    the float32 ring allreduce at K = 2 (2 (K-1)/K x 4 bytes per parameter)."""
    run = str(tmp_path / "run")
    extra = ("train.checkpoint_every_frames=1000", "train.keep_checkpoints=100")
    train(2, arch, run, *extra)
    full, _ = read_board(run)
    parameters = records(run)[0]["parameters"]
    assert {v for _, v in full["comm/bytes_per_step"]} == {4.0 * parameters}
    middle = checkpoint.all_checkpoints(run)[len(checkpoint.all_checkpoints(run)) // 2]
    frames = checkpoint.read_meta(middle)["frames"]
    assert full["train/ce"][0][0] < frames < full["train/ce"][-1][0]
    train(2, arch, run, *extra, f"train.resume={middle}")
    board = assert_board_is_the_metrics(run)
    for tag in ("train/ce", "train/accuracy", "lr", "comm/bytes_per_step", "cv/ce",
                "cv/accuracy", "cv/majority_accuracy"):
        assert board[tag] == full[tag], tag
    files = tensorboard.event_files(os.path.join(run, tensorboard.DIR))
    assert len(files) == 2   # the first attempt's, cut at the checkpoint, and the resumed one's
    first, _ = read_board_file(run, files[0])
    assert max(step for points in first.values() for step, _ in points) <= frames


def read_board_file(run, name):
    """One event file alone (in a directory of its own, as the reader takes directories)."""
    alone = os.path.join(run, "alone")
    os.makedirs(os.path.join(alone, tensorboard.DIR), exist_ok=True)
    os.link(os.path.join(run, tensorboard.DIR, name), os.path.join(alone, tensorboard.DIR, name))
    return read_board(alone)


# on rank 0 tensorboardX is "not installed"; any other rank that imports it fails the run
NOT_INSTALLED = """from mpi4py import MPI
rank = MPI.COMM_WORLD.Get_rank()
if rank != 0:
    raise RuntimeError(f"rank {rank} imported tensorboardX: only rank 0 writes events")
raise ModuleNotFoundError("No module named 'tensorboardX'", name="tensorboardX")
"""


def test_only_rank_0_imports_the_library_and_a_run_without_it_trains(arch, tmp_path):
    fake = tmp_path / "fake" / "tensorboardX"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(NOT_INSTALLED)
    path = os.pathsep.join(p for p in (str(fake.parent), os.environ.get("PYTHONPATH")) if p)
    run = str(tmp_path / "run")
    proc = train(2, arch, run, env={"PYTHONPATH": path})
    line = ("tensorboard: tensorboardX is not installed (pip install tensorboardX); no event "
            "files written")
    assert proc.stdout.count(line) == 1, proc.stdout
    assert not os.path.exists(os.path.join(run, tensorboard.DIR))
    assert [r["kind"] for r in records(run)].count("epoch") == 2   # it trained
    # train.tensorboard=false: not even rank 0 tries
    off = str(tmp_path / "off")
    proc = train(2, arch, off, "train.tensorboard=false", env={"PYTHONPATH": path})
    assert "tensorboard:" not in proc.stdout and "tensorboard:" not in proc.stderr
    assert not os.path.exists(os.path.join(off, tensorboard.DIR))


def record(kind, frames, **fields):
    return {"kind": kind, "frames": frames, **fields}


def test_a_write_error_is_one_log_line_and_then_nothing(tmp_path):
    """The real writer on /dev/full: the first flush fails (ENOSPC), says so once, and the
    board writes nothing more, without an exception to the trainer."""
    said = []
    board = tensorboard.Board("/dev/full", tensorboard.library(), {}, 0, said.append)
    for frames in (100, 200, 300):
        board.record(record("train", frames, ce=1.0, frame_accuracy=0.5))
    board.close()
    assert len(said) == 1 and "/dev/full failed" in said[0] and "No space left" in said[0]


def test_resume_keeps_the_whole_records_up_to_the_checkpoint(tmp_path):
    """The resume rewrite with the real writer and reader: events after the checkpoint's
    frames and a record cut by a killed run are dropped, the rest kept; a fresh start in the
    directory (no checkpoint) removes the event files, like metrics.jsonl."""
    run = str(tmp_path / "run")
    board = tensorboard.open_board(run, None, print)
    for frames in (100, 200, 300):
        board.record(record("train", frames, ce=frames / 100, frame_accuracy=0.5))
    board.close()
    (path,) = [os.path.join(run, tensorboard.DIR, name)
               for name in tensorboard.event_files(os.path.join(run, tensorboard.DIR))]
    tbx = tensorboard.library()
    one = tbx.RecordWriter(str(tmp_path / "one"))   # a whole record at frame 250 ...
    one.write(tbx.Event(step=250).SerializeToString())
    one.close()
    with open(path, "ab") as f:                      # ... cut short: no data CRC
        f.write(open(tmp_path / "one", "rb").read()[:-6])
    last = tensorboard.keep_until(os.path.join(run, tensorboard.DIR), 200, tbx)
    assert last == {"train/ce": 200, "train/accuracy": 200}
    board, _ = read_board(run)
    assert board["train/ce"] == [(100, 1.0), (200, 2.0)]
    assert metrics.prepare_run_dir(run, None, False, modify=True).endswith("tensorboard")
    assert not os.path.exists(os.path.join(run, tensorboard.DIR))
