"""What the launchers cost before the first rank starts (issue 46: the suite, and every user's
start, pays it per launch). `zeroshard launch` does all its checks without importing torch on
a host with no GPU driver (torchrun and the ranks import it anyway: about 1.5 s of the
launcher's start, measured 1.85 -> 0.18 s of CPU), nor does `zeroshard train` on a GPT preset
(1.55 -> 0.31 s); `zeroshard train` builds the optimizer over one element to check its
hyper-parameters only when the user wrote them (building a torch optimizer imports
torch._dynamo: 2.5 -> 1.6 s of CPU). Each check runs in a fresh
interpreter, so what it imported is what the launcher imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from zeroshard.cli.devices import DRIVER_NODES, cuda_device_count

NO_DRIVER = not any(os.path.exists(node) for node in DRIVER_NODES)


def _launcher(tmp_path, argv: list[str], modules: list[str],
              started: bool = False) -> tuple[int, dict[str, bool], str]:
    """zeroshard's CLI with `argv` in a fresh interpreter: (exit code, {module: imported}, stderr).
    `started`: torchrun is not started; the launcher's call to start it exits 0 (it reached the ranks)."""
    stub = ("from zeroshard.cli.train import command\n"
            "command.run_torchrun = lambda cmd, **kw: print('torchrun', *cmd) or 0\n") if started else ""
    probe = ("import json, sys\nfrom zeroshard.cli.main import main\n" + stub +
             f"code = main({argv!r})\n"
             f"print(json.dumps([code, {{m: m in sys.modules for m in {modules!r}}}]))\n")
    proc = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    code, imported = json.loads(proc.stdout.strip().splitlines()[-1])
    return code, imported, proc.stderr


@pytest.mark.skipif(not NO_DRIVER, reason="this host has a GPU driver: torch is asked how many devices it has")
def test_launch_runs_every_check_without_importing_torch(tmp_path):
    # a missing script is the last check run() makes: device count, DeepSpeed flags and the
    # served `deepspeed` package's path have all been worked out by then
    code, imported, err = _launcher(tmp_path, ["launch", "--nproc", "2", "--include", "localhost:0", "no_such.py"],
                                    ["torch"])
    assert code == 2 and "no_such.py: no such script" in err, err
    assert imported == {"torch": False}


def test_cuda_device_count_asks_torch_where_a_driver_node_exists(monkeypatch, tmp_path):
    import zeroshard.cli.devices as devices

    monkeypatch.setattr(devices, "DRIVER_NODES", (str(tmp_path / "absent"),))
    assert cuda_device_count() == 0
    import torch

    monkeypatch.setattr(devices, "DRIVER_NODES", (str(tmp_path),))  # a node that exists: torch answers
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert cuda_device_count() == 3


def test_train_probes_the_optimizer_only_when_the_user_wrote_it(tmp_path):
    # a missing --data file is the last check before the ranks start: the config checks ran
    tail = ["--model", "tiny", "--steps", "2", "--data", str(tmp_path / "no_such.txt")]
    code, imported, err = _launcher(tmp_path, ["train", *tail], ["torch._dynamo"])
    assert code == 2 and "no_such.txt: no such file" in err, err
    assert imported == {"torch._dynamo": False}  # the embedded AdamW is not built in the launcher
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    code, imported, err = _launcher(tmp_path, ["train", "--config", str(config), *tail], ["torch._dynamo"])
    assert code == 2 and "no_such.txt: no such file" in err, err
    assert imported == {"torch._dynamo": True}  # the user's optimizer is built over one element


@pytest.mark.skipif(not NO_DRIVER, reason="this host has a GPU driver: torch is asked how many devices it has")
def test_train_checks_a_preset_and_text_without_importing_torch(tmp_path):
    """`zeroshard train` on a GPT preset runs all its checks (model, config, batch memory, the
    data's text, a checkpoint's batch) and reaches torchrun without importing torch (1.55 ->
    0.31 s of the launcher's CPU); the ranks import it."""
    text = tmp_path / "notes.txt"
    text.write_text("a line of plain text to train on\n" * 64)
    argv = ["train", "--model", "tiny", "--steps", "2", "--data", str(text), "--save", str(tmp_path / "ck")]
    code, imported, err = _launcher(tmp_path, argv, ["torch"], started=True)
    assert code == 0, err
    assert imported == {"torch": False}


def _recorded_from_here(name_of):
    return _record(name_of)


def _record(name_of):  # as torch's rendezvous handler's _record asks for its caller's name
    return name_of()


def test_torchrun_names_rendezvous_events_as_torch_does_without_reading_stacks(monkeypatch):
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    from zeroshard.cli import torchrun_main

    torchs = dynamic_rendezvous.get_method_name
    assert _recorded_from_here(torchs) == _recorded_from_here(torchrun_main._method_name) == "_recorded_from_here"
    assert torchs(depth=10_000) == torchrun_main._method_name(depth=10_000) == "no_method_name"
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", torchs)
    torchrun_main._cheap_rendezvous_names()
    assert dynamic_rendezvous.get_method_name is torchrun_main._method_name
    other = lambda depth=3: "x"  # noqa: E731  a helper of another shape: torch's is kept
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", other)
    torchrun_main._cheap_rendezvous_names()
    assert dynamic_rendezvous.get_method_name is other
