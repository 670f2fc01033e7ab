"""The commands the README shows run as written on the shipped data, and every documented
`hpcsgd ...` command line parses (its subcommand, options and config keys exist).

The README's pipeline block runs in a scratch directory that sees the repository's data_prep/
and jobs/; training commands get train.epochs=1 train.log_every_frames=10000 (a demo epoch is
seconds) and the run must learn: its training cross-entropy falls and stays finite. A docs command that is a benchmark
of minutes is only parsed, not run."""
import glob
import json
import math
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
VENV_BIN = os.path.dirname(sys.executable)


def code_blocks(path, lang="bash"):
    text = open(path).read()
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def commands(block):
    """Shell commands of a block: continuation lines joined, comments dropped."""
    out, current = [], ""
    for line in block.splitlines():
        line = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if not line.strip() and not current:
            continue
        current += " " + line.strip().rstrip("\\").strip()
        if not line.endswith("\\"):
            if current.strip():
                out.append(current.strip())
            current = ""
    return out


def pipeline():
    block = next(b for b in code_blocks(os.path.join(REPO, "README.md"))
                 if b.startswith(". .venv/bin/activate"))
    return [c for c in commands(block) if not c.startswith(". ")]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    root = tmp_path_factory.mktemp("readme")
    for name in ("data_prep", "jobs"):
        os.symlink(os.path.join(REPO, name), root / name)
    return str(root)


def test_the_readme_pipeline_runs_as_written_and_learns(scratch):
    cmds = pipeline()
    assert any(c.startswith("hpcsgd prep") for c in cmds)
    assert sum("hpcsgd.cli train" in c for c in cmds) == 5
    env = dict(ENV, PATH=VENV_BIN + os.pathsep + ENV["PATH"])
    for cmd in cmds:
        argv = shlex.split(cmd)
        if "hpcsgd.cli" in argv and "train" in argv:
            argv += ["train.epochs=1", "train.log_every_frames=10000"]
        proc = subprocess.run(argv, cwd=scratch, env=env, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        if "hpcsgd.cli" in argv and "train" in argv:
            run = next((a.split("=", 1)[1] for a in argv if a.startswith("train.run_dir=")),
                       "runs/demo/run")
            records = [json.loads(line) for line in open(os.path.join(scratch, run,
                                                                      "metrics.jsonl"))]
            ce = [r["ce"] for r in records if r["kind"] == "train"]
            assert len(ce) >= 2 and all(c == c for c in ce), (cmd, ce)
            if any(a.startswith("train.init_from=") for a in argv):   # a fine-tune: it
                assert ce[0] < 0.8 * math.log(40) and ce[-1] < 1.05 * ce[0], (cmd, ce)  # starts
            else:                                                     # trained, stays so
                assert ce[-1] < 0.8 * ce[0], (cmd, ce)   # it learns, nothing diverges
            assert "warning" not in open(os.path.join(scratch, run, "logs",
                                                      "rank0000.log")).read(), cmd
    assert os.path.isfile(os.path.join(scratch, "runs/demo/cv.json"))
    int4 = json.load(open(os.path.join(scratch, "runs/demo/cv_int4.json")))
    assert int4["frame_accuracy"] > 0.4   # the INT4 integer model (majority class: 34%)
    assert glob.glob(os.path.join(scratch, "runs/demo/cv_loglik.*"))
    assert os.path.isfile(os.path.join(scratch, "runs/demo/run/plots/learning_curves.png"))


def documented_hpcsgd_commands():
    """Every `hpcsgd SUB ...` command line in a bash block of the README and docs/."""
    found = []
    for path in [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs",
                                                                                   "*.md"))):
        for block in code_blocks(path):
            for cmd in commands(block):
                words = shlex.split(cmd.replace("$", ""), comments=True)
                if "hpcsgd.cli" in words:
                    words = ["hpcsgd"] + words[words.index("hpcsgd.cli") + 1:]
                if words and words[0] == "hpcsgd":
                    found.append((os.path.relpath(path, REPO), words))
    return found


def test_every_documented_command_line_parses():
    """Subcommands, options and config keys as the docs write them (one process, nothing run:
    train commands load their config and overrides; the others parse their options)."""
    code = r"""
import json, sys
from hpcsgd import cli, config
from hpcsgd.bench import BENCHES
import importlib, argparse
bad = []
for where, words in json.loads(sys.stdin.read()):
    name, rest = words[1], words[2:]
    try:
        module = importlib.import_module(cli.SUBCOMMANDS[name][0])
        parser = argparse.ArgumentParser(prog=name, exit_on_error=False)
        module.add_arguments(parser)
        args, unknown = parser.parse_known_args(rest)
        if name == "bench":
            sub = importlib.import_module(BENCHES[args.name][0])
            p = argparse.ArgumentParser(exit_on_error=False)
            sub.add_arguments(p)
            from hpcsgd.bench import report, emucluster
            report.add_arguments(p)
            if getattr(sub, "USES_MPI", False):
                emucluster.add_bench_arguments(p)
            p.parse_args(args.rest)
        elif unknown:
            raise ValueError(f"unknown {unknown}")
        if name == "train" and not args.help_config:
            config.load(args.config, args.overrides + ["data.train=x"] * (not args.config))
    except (Exception, SystemExit) as err:
        bad.append(f"{where}: {' '.join(words)}: {type(err).__name__} {err}")
print(json.dumps(bad))
"""
    found = documented_hpcsgd_commands()
    assert len(found) > 20
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps(found), cwd=REPO,
                          capture_output=True, text=True, timeout=300, env=ENV)
    assert proc.returncode == 0, proc.stderr
    bad = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not bad, "\n".join(bad)
