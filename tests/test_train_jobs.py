"""The suite's shared trainer jobs (tests/mpi/train_jobs.py via conftest.run_train): a run
that fails reports as a fresh job's would and ends its job, and the next run gets a new job."""
import pytest

from conftest import make_archive, run_train


@pytest.fixture(scope="module")
def arch(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("jobs_archive"))
    make_archive(out, num_shards=2, utts_per_shard=4, max_len=120)
    return out


def options(arch, run, *extra):
    return [f"data.train={arch}", f"train.run_dir={run}", "data.context=1", "model.hidden=[8]",
            "train.minibatch=16", "train.epochs=1", "data.block_frames=100",
            "data.buffer_frames=400", "train.log_every_frames=100", *extra]


@pytest.mark.parametrize("K", [1, 2])
def test_a_failed_run_ends_its_job_and_the_next_run_gets_a_new_one(K, arch, tmp_path):
    ok = run_train(K, options(arch, str(tmp_path / "ok")))
    assert ok.returncode == 0 and f"{K} rank(s)" in ok.stdout, ok.stdout + ok.stderr
    bad = run_train(K, options(arch, str(tmp_path / "bad"), "optim.lr=-1"))
    assert bad.returncode != 0 and "optim.lr" in bad.stderr, bad.stdout + bad.stderr
    again = run_train(K, options(arch, str(tmp_path / "again")))
    assert again.returncode == 0 and "training done" in again.stdout, again.stdout + again.stderr
