"""The fault-injection seam (zeroshard/faults.py): a point fires only when ZEROSHARD_FAULT arms
it, with its argument, and every point is a no-op when the variable is unset or arms another.
That the armed points really stop a save and kill a rank is seen end to end in
test_checkpoint_crash, test_signals and test_restart_resume."""

from __future__ import annotations

import os
import signal

import pytest

from zeroshard import faults
from zeroshard.policies import ConfigError


@pytest.fixture
def calls(monkeypatch):
    """What the points did: ("sleep", s), ("write", fd, text), ("kill", pid, sig); none really happens."""
    seen: list[tuple] = []
    monkeypatch.setattr(faults.time, "sleep", lambda s: seen.append(("sleep", s)))
    monkeypatch.setattr(faults.os, "write", lambda fd, b: seen.append(("write", fd, b.decode())))
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: seen.append(("kill", pid, sig)))
    return seen


def _run_kill(rank: int, restart: int) -> None:
    hook = faults.kill_hook(rank, restart)
    for step in range(6):
        hook(step)


def test_every_point_is_a_no_op_when_unset(monkeypatch, calls):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.armed(faults.PAUSE) is None and faults.armed(faults.KILL) is None
    for phase in ("prepared", "rank_file", "written", "renamed", "latest"):
        faults.pause(phase)
    _run_kill(0, 0)
    _run_kill(1, 0)
    assert calls == []


def test_pause_fires_at_its_phase_only(monkeypatch, calls):
    monkeypatch.setenv(faults.ENV, "pause:written")
    faults.pause("prepared")
    faults.pause("renamed")
    assert calls == []
    faults.pause("written")
    assert calls == [("write", 2, "zeroshard-checkpoint-paused written\n"), ("sleep", faults.PAUSE_S)]


def test_kill_fires_at_its_rank_and_step(monkeypatch, calls):
    monkeypatch.setenv(faults.ENV, "kill:1:4")
    _run_kill(1, 0)
    assert calls == [("kill", os.getpid(), signal.SIGKILL)]
    _run_kill(1, 0)
    assert len(calls) == 2  # once per pass, at step 4
    calls.clear()
    _run_kill(0, 0)  # another rank
    _run_kill(1, 1)  # torchrun's restarted attempt
    assert calls == []


def test_hold_fires_at_its_rank_and_step_in_the_first_attempt(monkeypatch, calls):
    monkeypatch.setenv(faults.ENV, "hold:2:3")
    _run_kill(0, 0)  # another rank
    _run_kill(2, 1)  # torchrun's restarted attempt
    assert calls == []
    hook = faults.kill_hook(2, 0)
    for step in range(3):
        hook(step)
    assert calls == []
    hook(3)
    assert calls == [("write", 2, "zeroshard-fault-held rank 2 step 3\n"), ("sleep", faults.PAUSE_S)]


def test_a_point_armed_for_another_point_does_nothing(monkeypatch, calls):
    monkeypatch.setenv(faults.ENV, "kill:0:0")
    faults.pause("kill")
    faults.pause("0:0")
    monkeypatch.setenv(faults.ENV, "pause:0:0")
    _run_kill(0, 0)
    assert calls == []


def test_setting_arms_the_point_it_names(monkeypatch, calls):
    for key, value in faults.setting(faults.KILL, "0:2").items():
        monkeypatch.setenv(key, value)
    assert faults.armed(faults.KILL) == "0:2" and faults.armed(faults.PAUSE) is None
    _run_kill(0, 0)
    assert calls == [("kill", os.getpid(), signal.SIGKILL)]


def test_a_malformed_kill_is_one_clear_error(monkeypatch):
    monkeypatch.setenv(faults.ENV, "kill:three")
    with pytest.raises(ConfigError, match=r"ZEROSHARD_FAULT=kill:three: expected RANK:STEP"):
        faults.kill_hook(0, 0)


def test_the_seam_is_the_only_reader_of_test_hooks():
    """No other module reads a ZEROSHARD_*TEST* or the fault variable itself."""
    root = os.path.join(os.path.dirname(__file__), os.pardir, "src", "zeroshard")
    readers = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            if not name.endswith(".py") or os.path.samefile(path, faults.__file__):
                continue
            text = open(path, encoding="utf-8").read()
            if "ZEROSHARD_FAULT" in text or "_TEST_" in text:
                readers.append(os.path.relpath(path, root))
    assert readers == []
