"""An elastic job loses a node and goes on at the smaller world size (issue 43).

Two "nodes" on loopback, each `zeroshard train --nproc 2 --nnodes 1:2 --master-addr 127.0.0.1`:
torchrun's c10d rendezvous makes them one world of 4. Rank 2 (node B) is held before step 3
(the fault point `hold`, after the step-2 checkpoint); the test then kills node B whole
(SIGKILL to its launcher, agent and ranks, as a machine that dies). Node A's ranks lose their
peers, torchrun restarts them, the rendezvous closes with node A alone, and they resume from
global_step2 at world 2, accumulating 2 micro-steps so each step still takes the checkpoint's
8 samples (rank_batch draws a step's rows whatever the split).

The reference: `zeroshard train --nproc 2` (world 2) started in a folder holding only that
global_step2 checkpoint. Both end with the same checkpoint, bit for bit: what the elastic job
did after losing the node is exactly a world-2 run from its last checkpoint.

The whole is marked slow (three jobs, two rendezvous rounds); the default run has the
launcher's command lines and refusals, and the batch arithmetic on a real checkpoint.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from checkpoint_files import assert_bit_equal, checkpoint_tensors, client_state

from zeroshard import faults
from zeroshard.bench.ranks import free_port
from zeroshard.cli import launch_cmd
from zeroshard.cli.main import main
from zeroshard.cli.train import command as train_command
from zeroshard.cli.train.data import rank_batch

TIMEOUT_S = 600
TRAIN = ["--model", "tiny", "--seq-len", "16", "--micro-batch", "2", "--steps", "6", "--save-every", "2",
         "--report", ""]
HOLD_STEP = 3


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", faults.ENV)}
    return {**env, "OMP_NUM_THREADS": "1", **(extra or {})}


def _train(*extra: str) -> list[str]:
    return [sys.executable, "-m", "zeroshard.cli.main", "train", *TRAIN, *extra]


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch_cmd.add_rendezvous_arguments(p)
    p.add_argument("--nproc", type=int, default=2)
    return p.parse_args(list(argv))


def test_elastic_command_line_and_refusals():
    args = _parse("--nnodes", "1:2", "--master-addr", "head", "--master-port", "4000", "--rdzv-conf",
                  "last_call_timeout=5")
    assert launch_cmd.check_rendezvous(args) is None
    cmd = launch_cmd.torchrun_command(args, ["train.py"])
    assert cmd[3:] == ["--nnodes=1:2", "--rdzv-backend=c10d", "--rdzv-endpoint=head:4000", "--rdzv-id=zeroshard",
                       "--rdzv-conf=last_call_timeout=5", "--max-restarts=3", "--nproc-per-node=2", "train.py"]
    assert "up to 3 restarts (the default for an elastic job)" in launch_cmd.elastic_note(args)
    fixed = _parse("--nnodes", "2", "--node-rank", "1", "--master-addr", "head")
    assert not launch_cmd.elastic(fixed) and launch_cmd.elastic_note(fixed) is None
    assert "--nnodes=2" in launch_cmd.torchrun_command(fixed, ["t.py"])
    assert "needs --master-addr" in launch_cmd.check_rendezvous(_parse("--nnodes", "1:4"))
    assert "drop --node-rank 1" in launch_cmd.check_rendezvous(
        _parse("--nnodes", "1:4", "--node-rank", "1", "--master-addr", "h"))
    assert "--max-restarts 0 would end the job" in launch_cmd.check_rendezvous(
        _parse("--nnodes", "1:4", "--max-restarts", "0", "--master-addr", "h"))
    for bad in ("3:2", "0:2", "a:b"):
        with pytest.raises(SystemExit):
            _parse("--nnodes", bad)


@pytest.mark.timeout(300)
def test_a_new_world_size_keeps_the_global_batch(tmp_path, capsys, monkeypatch):
    """A world-2 checkpoint resumed at world 1 accumulates 2 micro-steps; at a world size that
    cannot keep the batch, one line and exit 2 from the launcher, before any rank starts (the
    ranks check again: an elastic restart changes the world inside one torchrun job)."""
    first = subprocess.run(_train("--nproc", "2", "--steps", "2", "--save", "ck"), cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert first.returncode == 0, first.stderr[-3000:]
    state = client_state(tmp_path / "ck" / "global_step2")
    assert (state["global_batch"], state["world"]) == (4, 2)
    again = subprocess.run(_train("--nproc", "1", "--steps", "3", "--save", "ck"), cwd=tmp_path, env=_env(),
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert again.returncode == 0, again.stderr[-3000:]
    out = " ".join(again.stdout.split())
    assert ("world size 1 (the checkpoint was saved at 2): gradient_accumulation_steps 2 keeps the global batch "
            "at 4 samples per step") in out, out[-2000:]
    assert client_state(tmp_path / "ck" / "global_step3")["global_batch"] == 4
    capsys.readouterr()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(train_command, "run_torchrun", _no_ranks)
    odd = main(["train", *TRAIN, "--nproc", "3", "--micro-batch", "1", "--steps", "4", "--save", "ck"])
    err = capsys.readouterr().err
    assert odd == 2 and err.count("\n") == 1, err
    assert "trained 4 samples per step on 1 ranks; on 3 ranks with micro-batch 1" in err, err


def _no_ranks(*args, **kwargs):
    raise AssertionError("the launcher started torchrun: the batch check should have refused before any rank")


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


class _Output:
    """Each process's output lines (stderr into stdout), read by one thread per process."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.lines: list[list[str]] = [[] for _ in procs]
        self.readers = [threading.Thread(target=lambda p=proc, out=into: out.extend(iter(p.stdout.readline, "")),
                                         daemon=True) for proc, into in zip(procs, self.lines)]
        for reader in self.readers:
            reader.start()

    def wait_for(self, text: str, deadline: float) -> int:
        """The index of the first process that printed a line holding `text`."""
        while time.monotonic() < deadline:
            for i, lines in enumerate(self.lines):
                if any(text in line for line in list(lines)):
                    return i
            time.sleep(0.2)
        raise AssertionError(f"no node printed {text!r}:\n" + "".join(sum(self.lines, []))[-4000:])

    def text(self, i: int) -> str:
        self.readers[i].join(timeout=30)
        return "".join(self.lines[i])


def test_a_step_takes_the_same_rows_whatever_the_world_size_and_accumulation():
    tokens = torch.arange(5000) % 251
    def rows(world, gas):
        return torch.cat([rank_batch(tokens, 2, 16, 7, r, world, 3, micro_step=m, accumulation=gas)[0]
                          for m in range(gas) for r in range(world)])
    assert torch.equal(rows(4, 1), rows(2, 2)) and torch.equal(rows(4, 1), rows(1, 4))
    assert not torch.equal(rows(4, 1), torch.cat([rank_batch(tokens, 2, 16, 8, r, 4, 3)[0] for r in range(4)]))


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 120)
def test_a_job_that_loses_a_node_continues_at_world_2_from_its_last_checkpoint(tmp_path):
    port = free_port()
    node = _train("--nproc", "2", "--nnodes", "1:2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                  "--rdzv-conf", "last_call_timeout=5", "--max-restarts", "2", "--save", "elastic")
    held = _env(faults.setting(faults.HOLD, f"2:{HOLD_STEP}"))  # both armed: only rank 2 holds
    nodes = [subprocess.Popen(node, cwd=tmp_path, env=held, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, start_new_session=True) for _ in range(2)]
    try:
        output = _Output(nodes)
        deadline = time.monotonic() + TIMEOUT_S
        lost = output.wait_for(f"zeroshard-fault-held rank 2 step {HOLD_STEP}", deadline)
        kept = nodes[1 - lost]
        _kill(nodes[lost])  # the node dies: its launcher, torchrun agent and both ranks
        kept.wait(timeout=max(1.0, deadline - time.monotonic()))
        out = output.text(1 - lost)
    finally:
        for proc in nodes:
            _kill(proc)
    assert kept.returncode == 0, out[-5000:]
    flat = " ".join(out.split())
    assert "torchrun restarts every rank" in flat, flat[-3000:]
    assert "resumed at step 2 from elastic/global_step2" in flat, flat[-3000:]
    assert "gradient_accumulation_steps 2 keeps the global batch at 8 samples per step" in flat, flat[-3000:]
    assert (tmp_path / "elastic" / "latest").read_text().strip() == "global_step6"

    ref = tmp_path / "reference"
    ref.mkdir()
    shutil.copytree(tmp_path / "elastic" / "global_step2", ref / "global_step2")
    (ref / "latest").write_text("global_step2")
    done = subprocess.run(_train("--nproc", "2", "--save", "reference"), cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_bit_equal(checkpoint_tensors(tmp_path / "elastic" / "global_step6"),
                     checkpoint_tensors(ref / "global_step6"))
    assert client_state(tmp_path / "elastic" / "global_step6")["losses"] == \
        client_state(ref / "global_step6")["losses"]
