"""End to end: `zeroshard train` through the CLI, as a user runs it."""

from __future__ import annotations

import os
import subprocess
import sys


def _run(*args, timeout=240):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "train", *args],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_train_runs_two_ranks_and_the_loss_falls():
    proc = _run("--steps", "40", "--model", "tiny", "--seq-len", "16", "--stage", "1")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout
    assert "zeroshard train: summary" in out
    assert "1 / 2 (gloo)" in out
    assert "2.000 x Phi" in out
    loss_line = next(line for line in out.splitlines() if "(first 10 steps)" in line)
    first, last = (float(part.split()[0]) for part in loss_line.split("│")[2].split("->"))
    assert last < first - 0.2, loss_line


def test_train_reports_bad_config_clearly(tmp_path):
    bad = tmp_path / "ds.json"
    bad.write_text('{"zero_optimization": {"stage": 2,}}')
    proc = _run("--config", str(bad), "--nproc", "1")
    assert proc.returncode != 0
    assert "line 1" in proc.stderr and "column" in proc.stderr, proc.stderr[-1000:]
    assert "Traceback" not in proc.stderr


def test_train_rejects_too_many_ranks():
    proc = _run("--nproc", "10000")
    assert proc.returncode == 2 and "--nproc 10000" in proc.stderr


def test_cli_help_lists_every_command():
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "--help"], capture_output=True, text=True)
    for cmd in ("train", "estimate", "plan"):
        assert cmd in proc.stdout
