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
    assert cmd[1:3] == ["-m", "zeroshard.cli.torchrun_main"]  # torch.distributed.run, quieter
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
    import re

    adapters = int(re.search(r"trainable \(LoRA\): ([\d,]+)", out).group(1).replace(",", ""))
    held, k, world = re.search(r"optimizer states ([\d,]+) \((\d+) x adapters / (\d+)\)", out).groups()
    assert int(held.replace(",", "")) == int(k) * adapters // int(world), out  # the printed rule holds


# -- the deepspeed launcher's flags ------------------------------------------------------------------
def _launch_args(*argv):
    from zeroshard.cli.main import build_parser

    return build_parser().parse_args(["launch", *argv, "train.py", "--deepspeed_config", "ds.json"])


def test_deepspeed_launcher_flags_map_onto_torchrun():
    from zeroshard.cli.launch_cmd import apply_deepspeed_flags

    args = _launch_args("--num_gpus", "2", "--master_port", "29600")
    assert apply_deepspeed_flags(args, 0) == (None, {})
    assert (args.nproc, args.master_port, args.script_args) == (2, 29600, ["--deepspeed_config", "ds.json"])
    assert torchrun_command(args, ["train.py"])[3:] == ["--standalone", "--nproc-per-node=2", "train.py"]

    args = _launch_args("--num_nodes", "2", "--node_rank", "1", "--master_addr", "head", "--num_gpus", "8")
    assert apply_deepspeed_flags(args, 8) == (None, {})
    assert torchrun_command(args, ["train.py"])[3:] == ["--nnodes=2", "--node-rank=1", "--master-addr=head",
                                                        "--master-port=29500", "--nproc-per-node=8", "train.py"]

    args = _launch_args("--include", "localhost:1,3")  # on a 4-GPU host: two ranks on devices 1 and 3
    assert apply_deepspeed_flags(args, 4) == (None, {"CUDA_VISIBLE_DEVICES": "1,3"}) and args.nproc == 2
    args = _launch_args("--exclude", "localhost:0")
    assert apply_deepspeed_flags(args, 4) == (None, {"CUDA_VISIBLE_DEVICES": "1,2,3"}) and args.nproc == 3
    args = _launch_args("--include", "localhost:0,1")  # CPU: slots are ranks
    assert apply_deepspeed_flags(args, 0) == (None, {}) and args.nproc == 2


@pytest.mark.parametrize("argv, words", [
    (["--num_nodes", "2"], "on each node"),
    (["--hostfile", "no-such-hostfile"], "No such file"),
    (["--include", "worker-0:0@worker-1:0"], "this host only"),
    (["--include", "worker-7:0"], "not this host"),
    (["--include", "localhost:0", "--num_gpus", "1"], "cannot be combined"),
    (["--exclude", "localhost"], "leaves no device"),
    (["--num_gpus", "2", "--nproc", "3"], "disagree"),
])
def test_deepspeed_launcher_flags_that_cannot_map_say_why(capsys, tmp_path, argv, words):
    script = tmp_path / "train.py"
    script.write_text("")
    assert main(["launch", *argv, str(script)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zeroshard launch: ") and words in err and err.count("\n") == 1
