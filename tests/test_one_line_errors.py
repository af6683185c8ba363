"""One error path: whatever finds a problem (the launcher before any rank starts, or the
ranks), `zeroshard train` and `zeroshard launch` say it in one line on stderr, once, and exit
with status 2; a genuine crash keeps its traceback and names the rank. Issue 29, items 2-3."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


def _zeroshard(*argv, cwd, timeout=240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", *argv], cwd=cwd, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _train(*argv, cwd, **kw) -> subprocess.CompletedProcess:
    return _zeroshard("train", "--model", "tiny", "--steps", "2", "--report", "", *argv, cwd=cwd, **kw)


def _one_line(proc: subprocess.CompletedProcess, command: str = "zeroshard train") -> str:
    """The one error line; fails unless stderr's own lines are exactly that line."""
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    ours = [line for line in proc.stderr.splitlines() if line.startswith(f"{command}")]
    assert len(ours) == 1, proc.stderr[-3000:]
    others = [line for line in proc.stderr.splitlines()
              if line.strip() and not line.startswith(("zeroshard: ", "  ", command))]
    assert others == [], proc.stderr[-3000:]  # nothing from torchrun, nothing per rank
    return ours[0]


def _prelaunch(capsys, tmp_path, monkeypatch, *argv) -> str:
    """`zeroshard train ARGV` in this process: for errors found before any rank starts."""
    from zeroshard.cli.main import main

    monkeypatch.chdir(tmp_path)
    code = main(["train", "--model", "tiny", "--steps", "2", "--report", "", *argv])
    err = capsys.readouterr().err
    return _one_line(subprocess.CompletedProcess([], code, "", err))


def _write(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


BASE = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


@pytest.mark.parametrize("edit,expect", [
    ({"optimizer": {"type": "AdamW", "params": {"lr": -1}}}, "Invalid learning rate"),
    ({"train_micro_batch_size_per_gpu": 1e12}, "more than the"),
    ({"zero_optimization": {"stage": 7}}, "stage"),
], ids=["negative-lr", "huge-micro-batch", "bad-stage"])
def test_a_bad_config_is_one_line_before_launch(capsys, tmp_path, monkeypatch, edit, expect):
    cfg = _write(tmp_path / "ds.json", {**BASE, **edit})
    line = _prelaunch(capsys, tmp_path, monkeypatch, "--config", cfg)
    assert expect in line, line


@pytest.mark.parametrize("where", ["missing", "file", "proc"])
def test_an_unusable_nvme_path_is_one_line_with_a_fix_that_works(capsys, tmp_path, monkeypatch, where):
    path = {"missing": tmp_path / "no" / "such", "file": tmp_path / "a_file", "proc": "/proc/zeroshard-x"}[where]
    if where == "file":
        path.write_text("x")
    line = _prelaunch(capsys, tmp_path, monkeypatch, "--stage", "2", "--offload", "nvme", "--nvme-path", str(path))
    assert str(path) in line
    if where == "missing":
        assert f"mkdir -p {path}" in line
    else:
        assert "mkdir" not in line, line  # mkdir -p of a file or under /proc cannot work


MINIMAL = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2}}


def test_a_config_without_optimizer_takes_the_embedded_one(tmp_path):
    """Before launch: the config the ranks get has the embedded optimizer and schedule, and
    the launcher's note says so."""
    import argparse

    from zeroshard.cli.train.args import add_train_arguments
    from zeroshard.cli.train.command import check_train_args
    from zeroshard.cli.train.config import build_config, filled_from_default

    p = argparse.ArgumentParser()
    add_train_arguments(p)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--nnodes", type=int, default=1)
    args = p.parse_args(["--model", "tiny", "--config", _write(tmp_path / "ds.json", MINIMAL)])
    assert check_train_args(args) is None
    cfg = build_config(args, ["Block"])
    assert cfg["optimizer"]["type"] == "AdamW" and cfg["scheduler"]["type"] == "WarmupCosineLR"
    assert cfg["zero_optimization"] == {"stage": 2}  # what the user wrote is kept
    [note] = filled_from_default(args)
    assert "has no 'optimizer'; using the embedded config's optimizer AdamW" in note


@pytest.mark.slow
def test_a_config_without_optimizer_trains_and_says_so(tmp_path):
    proc = _train("--config", _write(tmp_path / "ds.json", MINIMAL), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "has no 'optimizer'; using the embedded config's optimizer AdamW" in proc.stdout, proc.stdout[-2000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("saved")
    proc = _train("--stage", "2", "--save", "ckpt", cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return cwd


def _copy_checkpoint(saved, tmp_path):
    import shutil

    shutil.copytree(saved / "ckpt", tmp_path / "ckpt")
    tag = (tmp_path / "ckpt" / "latest").read_text().strip()
    return tmp_path / "ckpt" / tag


def test_a_damaged_checkpoint_on_resume_is_one_line_from_the_ranks(saved, tmp_path):
    tag_dir = _copy_checkpoint(saved, tmp_path)
    shard = next(p for p in sorted(tag_dir.iterdir()) if p.name.startswith("rank00001.optim"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # truncated
    line = _one_line(_train("--stage", "2", "--save", "ckpt", "--steps", "4", cwd=tmp_path))
    assert shard.name in line, line


def test_too_little_nvme_space_is_one_line(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(small)],
                             capture_output=True).returncode == 0
    if not mounted:
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        line = _one_line(_train("--stage", "2", "--offload", "nvme", "--nvme-path", str(small), cwd=tmp_path))
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)
    assert "free, but this run needs" in line and str(small) in line, line


SCRIPT = """
import sys, torch, zeroshard
model = torch.nn.Linear(4, 4)
cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
       "zero_optimization": {"stage": 2}}
if sys.argv[1] == "config":
    cfg["zero_optimization"]["stage"] = 9
engine = zeroshard.initialize(model, cfg)
if sys.argv[1] == "crash":
    raise RuntimeError("a genuine bug in the script")
"""


def test_launch_a_zeroshard_error_in_a_script_is_one_line(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    line = _one_line(_zeroshard("launch", "--nproc", "2", "train.py", "config", cwd=tmp_path), "zeroshard launch")
    assert "stage" in line


def test_launch_a_genuine_crash_keeps_its_traceback_and_names_the_rank(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = _zeroshard("launch", "--nproc", "2", "train.py", "crash", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr and "RuntimeError: a genuine bug in the script" in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("zeroshard launch: rank ") and "exited with status 1" in last, last
    assert "ChildFailedError" not in proc.stderr
