"""hpcsgd.cli: every subcommand's --help says how to use it (usage, examples, defaults,
allowed values), not the internals; exit codes as documented."""
import subprocess
import sys

import pytest

from conftest import REPO
from hpcsgd.cli import SUBCOMMANDS


def cli(*args):
    return subprocess.run([sys.executable, "-m", "hpcsgd.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def words(text):
    """The help text with argparse's line wrapping undone."""
    return " ".join(text.split())


@pytest.mark.parametrize("name", sorted(SUBCOMMANDS))
def test_help_is_usage_not_internals(name):
    proc = cli(name, "--help")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"usage: hpcsgd {name}")
    for internal in ("add_arguments", "delayed-update", "W_{h+1}", "run(args)"):
        assert internal not in out, internal
    assert "(default: None)" not in out and "(default: False)" not in out


def test_train_and_bench_help_show_examples_and_defaults():
    train = cli("train", "--help").stdout
    assert "examples:" in train and "mpiexec -n 2" in train and "--help-config" in train
    bench = cli("bench", "--help").stdout
    assert "examples:" in bench and "cuda" in bench and "hpcsgd bench train --config" in bench
    assert "(default: 0.05)" in words(cli("prep", "--help").stdout)
    infer = words(cli("infer", "--help").stdout)
    assert "Kaldi OUT.ark + OUT.scp" in infer and "(default: both)" in infer
    assert "--config YAML" in cli("bench", "train", "--help").stdout


def test_help_config_lists_allowed_values():
    out = cli("train", "--help-config").stdout
    assert "exchange.codec = 'onebit'    (one of onebit, kbit, dettmers, float32, float16)" in out
    assert "train.minibatch = 256    (int in 1..1048576)" in out
    assert "train.threads = 0" in out


def test_an_unknown_subcommand_exits_2():
    proc = cli("trian")
    assert proc.returncode == 2 and "usage: hpcsgd" in proc.stdout
