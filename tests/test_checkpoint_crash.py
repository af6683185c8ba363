"""A save killed with SIGKILL at any phase leaves `latest` loadable.

A child process trains a tiny GPT and saves tag "a" into one directory per phase;
then, per phase, it forks a saver of tag "b" whose writer stops at that phase
(the fault point `pause`, zeroshard.faults). The test SIGKILLs each saver there, then loads
`latest` here. Forking from one warm child keeps the test to one torch start-up.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

import zeroshard
from zeroshard.models import build_gpt

# phase -> the tag `latest` must name after a kill there
PHASES = {
    "prepared": "a",  # temporary directory made, nothing written
    "rank_file": "a",  # half of the rank file written
    "written": "a",  # rank file and meta.json complete and fsynced, not yet renamed
    "renamed": "a",  # tag "b" in place, `latest` not yet updated
    "latest": "b",  # `latest` names "b", old tags not yet pruned
}

CHILD = r"""
import os, sys, torch, zeroshard
from zeroshard import faults
from zeroshard.models import build_gpt
root, phases = sys.argv[1], sys.argv[2:]
torch.manual_seed(0)
engine = zeroshard.initialize(build_gpt("tiny"), {"train_micro_batch_size_per_gpu": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"reduce_bucket_size": 3000}})
x = torch.randint(0, 64, (2, 16))
engine.backward(engine(x, x)[1]); engine.step()
for phase in phases:
    engine.save_checkpoint(os.path.join(root, phase), tag="a")
engine.backward(engine(x, x)[1]); engine.step()
pids = []
for phase in phases:
    pid = os.fork()
    if pid == 0:  # the saver that the test kills
        os.environ.update(faults.setting(faults.PAUSE, phase))
        engine.save_checkpoint(os.path.join(root, phase), tag="b", keep_last=1)
        os.write(2, f"finished without pausing {phase}\n".encode())
        os._exit(0)
    os.write(2, f"saver {phase} {pid}\n".encode())
    pids.append(pid)
for pid in pids:
    os.waitpid(pid, 0)
"""


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def test_sigkill_during_save_leaves_latest_loadable(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), *PHASES],
                             env={**env, "OMP_NUM_THREADS": "1"}, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [*map(lines.put, child.stderr), lines.put("EOF")], daemon=True).start()
    seen: list[str] = []
    savers: dict[str, int] = {}
    paused: set[str] = set()
    deadline = time.monotonic() + 120
    try:
        while paused != set(PHASES) or len(savers) < len(PHASES):
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"savers did not all pause within 120 s: paused {sorted(paused)}")
            seen.append(line)
            words = line.split()
            if words == ["EOF"]:
                pytest.fail("the child exited early:\n" + "".join(seen[-20:]))
            if words[:1] == ["saver"]:
                savers[words[1]] = int(words[2])
            elif words[:1] == ["zeroshard-checkpoint-paused"]:
                paused.add(words[1])
            elif words[:1] == ["finished"]:
                pytest.fail(f"saver for {words[-1]} did not pause")
    finally:
        for pid in savers.values():
            os.kill(pid, signal.SIGKILL)
        if child.wait(timeout=30) != 0:
            pytest.fail(f"the child process failed (rc {child.returncode})")

    for phase, tag in PHASES.items():
        root = tmp_path / phase
        assert (root / "latest").read_text() == tag, phase
        fresh = zeroshard.initialize(build_gpt("tiny"), {"train_micro_batch_size_per_gpu": 2,
                                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
        fresh.load_checkpoint(root)
        assert fresh.global_steps == {"a": 1, "b": 2}[tag], phase
        fresh.save_checkpoint(root, tag="c")  # the next save clears the leftovers
        assert not [n for n in os.listdir(root) if n.startswith(".")], (phase, os.listdir(root))
