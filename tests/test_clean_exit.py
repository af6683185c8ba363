"""A job that trained must also exit cleanly. Building a torch optimizer imports torch._dynamo
lazily; imported after the process group exists, it kept the group (and its gloo threads)
alive past destroy_process_group(), into interpreter shutdown, where rank 0 of the main job
sometimes died with SIGABRT ("terminate called without an active exception") after its
summary had printed. zeroshard imports those modules before it creates the group, destroys
the group it made in `close()` and, if a script never calls it, at exit.

The default run launches the plain script once per mode; three times in a row per mode (the
abort came only sometimes) is marked `slow` (`python -m pytest -m slow`)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.distributed import run_ranks
from tests.exit_probe import gloo_threads, train_a_little

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "exit_probe.py")


def _threads_left_after_close(rank, world, stage):
    engine = train_a_little(stage)
    before = len(gloo_threads())
    engine.close()
    return before, gloo_threads()


@pytest.mark.parametrize("stage", [1, 3])
def test_close_leaves_no_gloo_thread_behind(stage):
    for before, left in run_ranks(_threads_left_after_close, 2, stage):
        assert before > 0  # the probe sees the group's threads while it lives
        assert left == [], f"threads of a destroyed process group still run: {left}"


def _env():
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}


@pytest.mark.parametrize("close", [True, False], ids=["close", "no-close"])
@pytest.mark.parametrize("runs", [1, pytest.param(3, marks=pytest.mark.slow)], ids=["once", "three-times"])
def test_plain_script_exits_zero_every_run(close, runs, tmp_path):
    for run in range(runs):
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", PROBE,
             *([] if close else ["--no-close"])],
            capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"run {run + 1}: exit {proc.returncode}\n{out[-3000:]}"
        assert "terminate called" not in out and out.count("trained") == 2, out[-3000:]
        if close:
            assert "gloo threads after close: 0" in proc.stdout, out[-3000:]


def test_groups_zeroshard_made_on_a_users_group_end_at_exit(tmp_path):
    """accelerate on CPU makes the default group itself and never destroys it; zeroshard's
    own group on it (and the engines' hooks that keep it alive in reference cycles) must still
    end at exit, so only the user's group's threads reach interpreter shutdown (a CI run of
    tests/test_hf_ref_model.py aborted there once, with two engines' groups alive)."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", PROBE,
         "--no-close", "--user-group"], capture_output=True, text=True, timeout=180, env=_env(), cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.count("trained") == 2, out[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("gloo threads at exit"))
    left, users = (int(n) for n in re.findall(r"\d+", line))
    assert users > 0 and left == users, line
