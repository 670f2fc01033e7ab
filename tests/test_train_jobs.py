"""The suite's shared trainer jobs (tests/mpi/train_jobs.py via conftest.run_train): a run
that fails reports as a fresh job's would and ends its job, and the next run gets a new job."""
import pytest

from conftest import run_train


def options(arch, run, *extra):
    return [f"data.train={arch}", f"train.run_dir={run}", "data.context=1", "model.hidden=[8]",
            "train.minibatch=64", "train.epochs=1", "train.stop_after_frames=512", *extra]


@pytest.mark.parametrize("K", [1, 2])
def test_a_failed_run_ends_its_job_and_the_next_run_gets_a_new_one(K, small_archive, tmp_path):
    arch = small_archive[0]
    ok = run_train(K, options(arch, str(tmp_path / "ok")))
    assert ok.returncode == 0 and f"{K} rank(s)" in ok.stdout, ok.stdout + ok.stderr
    bad = run_train(K, options(arch, str(tmp_path / "bad"), "optim.lr=-1"))
    assert bad.returncode != 0 and "optim.lr" in bad.stderr, bad.stdout + bad.stderr
    again = run_train(K, options(arch, str(tmp_path / "again")))
    assert again.returncode == 0 and "stopping after 512 frames" in again.stdout, \
        again.stdout + again.stderr
