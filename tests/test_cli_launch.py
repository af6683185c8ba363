"""`zeroshard launch` runs a user's script through torchrun; the examples run here so they
cannot rot (train_plain.py on 2 ranks with the DeepSpeed config, finetune_lora.py)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from zeroshard.cli.launch_cmd import torchrun_command
from zeroshard.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}


def test_launch_runs_the_plain_example_on_two_ranks(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "launch", "--nproc", "2",
                           os.path.join(EXAMPLES, "train_plain.py"), "--model", "tiny", "--seq-len", "16",
                           "--steps", "10"], capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "ZeRO stage 3 on 2 rank(s)" in proc.stderr  # the engine's banner: the DeepSpeed config, 2 ranks
    assert "sent by rank 0 in 10 steps" in proc.stdout  # the script's own arguments got through
    first, last = (float(v) for v in proc.stdout.split("\nloss ")[-1].split("->"))
    assert last < first


def test_launch_errors_are_one_line(capsys, tmp_path):
    assert main(["launch", str(tmp_path / "missing.py")]) == 2
    assert "no such script" in capsys.readouterr().err
    script = tmp_path / "s.py"
    script.write_text("")
    assert main(["launch", "--nnodes", "2", str(script)]) == 2
    assert "--master-addr" in capsys.readouterr().err
    assert main(["launch", "--nproc", "10000", str(script)]) == 2
    assert "--nproc 10000" in capsys.readouterr().err


def test_multi_node_rendezvous_is_passed_to_torchrun():
    args = argparse.Namespace(nproc=8, nnodes=4, node_rank=2, master_addr="head", master_port=29400)
    cmd = torchrun_command(args, ["train.py", "--lr", "1"])
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert cmd[3:] == ["--nnodes=4", "--node-rank=2", "--master-addr=head", "--master-port=29400",
                       "--nproc-per-node=8", "train.py", "--lr", "1"]
    one = torchrun_command(argparse.Namespace(nproc=2, nnodes=1, node_rank=0, master_addr=None, master_port=29500),
                           ["-m", "pkg.mod"])
    assert one[3:] == ["--standalone", "--nproc-per-node=2", "-m", "pkg.mod"]


def test_the_deepspeed_example_config_loads_unchanged():
    from zeroshard.config import load_config

    with open(os.path.join(EXAMPLES, "ds_config_zero3.json")) as fh:
        raw = json.load(fh)
    settings = load_config(raw, 2)
    assert int(settings.zero.stage) == 3
    assert "zeroshard" not in raw  # a plain DeepSpeed file, no zeroshard-only keys


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")
def test_lora_example_runs(monkeypatch, capsys):
    """In this process (one rank): the transformers import is shared with the other tests."""
    import runpy

    pytest.importorskip("peft")
    path = os.path.join(EXAMPLES, "finetune_lora.py")
    monkeypatch.setattr(sys, "argv", [path, "--steps", "5", "--seq-len", "32"])
    runpy.run_path(path, run_name="__main__")
    out = capsys.readouterr().out
    assert "trainable (LoRA)" in out and "optimizer states" in out
