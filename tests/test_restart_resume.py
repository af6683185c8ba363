"""A restart that resumes: `zeroshard train --save DIR --save-every 4 --max-restarts 1` with rank 1
killed by SIGKILL at step 6 (after the step-4 checkpoint, before the step-8 one). torchrun
restarts both ranks; they continue from `latest` (global_step4), redo steps 4-7 on the batches
the uninterrupted run saw at those steps, and end with the same parameters and optimizer states,
bit for bit in fp32, as a run that was never interrupted.

The kill comes from the fault point `kill:RANK:STEP` (zeroshard.faults; first attempt only).
The in-process tests below cover the resume decision itself on one rank.

The two-job form with the bit-for-bit comparison is marked `slow` (`python -m pytest -m slow`).
The default run has the short form: the killed job alone, 4 steps with a checkpoint every 2 and
rank 1 killed at step 3, which must be restarted by torchrun and resume from global_step2."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
from checkpoint_files import assert_bit_equal, checkpoint_tensors, client_state

from zeroshard import faults

STEPS, EVERY, KILL = 8, 4, 6  # the long form
SHORT_STEPS, SHORT_EVERY, SHORT_KILL = 4, 2, 3  # the default run's short form


def _train(cwd, save: str, *extra: str, env_extra: dict | None = None, steps: int = STEPS,
           every: int = EVERY) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT", faults.ENV)}
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "zeroshard.cli.main", "train", "--model", "tiny", "--seq-len", "16",
           "--micro-batch", "4", "--steps", str(steps), "--save", save, "--save-every", str(every),
           "--report", "", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def _killed(cwd, steps: int, every: int, kill: int) -> subprocess.CompletedProcess:
    return _train(cwd, "restarted", "--max-restarts", "1", env_extra=faults.setting(faults.KILL, f"1:{kill}"),
                  steps=steps, every=every)


def _assert_restarted_and_resumed(cwd, killed, steps: int, every: int) -> None:
    assert killed.returncode == 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    # torchrun saw rank 1 die of SIGKILL, then restarted it (one line of zeroshard's for torchrun's log)
    assert "local rank 1 was killed by SIGKILL; torchrun restarts every rank (restart 1 of 1)" in killed.stderr, \
        killed.stderr[-3000:]
    out = " ".join(killed.stdout.split())
    assert f"resumed at step {every} from restarted/global_step{every} (torchrun restart 1:" in out, out[-3000:]
    # the second attempt trained steps every..steps-1 only, not all of them from scratch
    assert f"for {steps - every} steps" in out, out[-2000:]
    assert (cwd / "restarted" / "latest").read_text().strip() == f"global_step{steps}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("restart")
    ref = _train(cwd, "uninterrupted")
    killed = _killed(cwd, STEPS, EVERY, KILL)
    return cwd, ref, killed


@pytest.mark.timeout(900)  # one torchrun job, restarted once; its two attempts are most of it
def test_short_form_the_killed_rank_is_restarted_and_the_job_resumes_from_latest(tmp_path):
    killed = _killed(tmp_path, SHORT_STEPS, SHORT_EVERY, SHORT_KILL)
    _assert_restarted_and_resumed(tmp_path, killed, SHORT_STEPS, SHORT_EVERY)


@pytest.mark.slow
@pytest.mark.timeout(900)  # two torchrun jobs; ~1 min on an idle 2-core machine, far more when it is shared
def test_the_killed_rank_is_restarted_and_the_job_resumes_from_latest(runs):
    cwd, ref, killed = runs
    assert ref.returncode == 0, ref.stdout[-3000:] + ref.stderr[-3000:]
    _assert_restarted_and_resumed(cwd, killed, STEPS, EVERY)
    assert "resumed" not in ref.stdout


@pytest.mark.slow
def test_final_parameters_and_optimizer_states_equal_the_uninterrupted_run_bit_for_bit(runs):
    cwd, ref, killed = runs
    assert ref.returncode == 0 and killed.returncode == 0
    final = f"global_step{STEPS}"
    assert_bit_equal(checkpoint_tensors(cwd / "uninterrupted" / final), checkpoint_tensors(cwd / "restarted" / final))
    # the loss of every step (steps 0-3 from the checkpoint, 4-7 recomputed after the restart)
    a, b = client_state(cwd / "uninterrupted" / final), client_state(cwd / "restarted" / final)
    assert a["step"] == b["step"] == STEPS and len(a["losses"]) == STEPS
    assert a["losses"] == b["losses"]


# -- the resume decision, in one process (world size 1) --------------------------------------------------


@pytest.fixture()
def engine(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    import zeroshard
    from zeroshard.cli.train.config import default_config
    from zeroshard.cli.train.model import build_model

    torch.manual_seed(0)
    tm = build_model("tiny", 0)
    eng = zeroshard.initialize(tm.module, default_config(10, 2, tm.unit_classes))
    x = torch.randint(0, tm.vocab_size, (2, 8))
    eng.backward(tm.loss(eng, x, x))
    eng.step()
    yield eng
    eng.close()


def _args(save, resume=False) -> argparse.Namespace:
    return argparse.Namespace(save=save and str(save), resume=resume, steps=10, model="tiny", lora=0)


def test_resume_decides_from_the_save_folder(engine, tmp_path, monkeypatch):
    from zeroshard.cli.train.resume import client_state as state_of
    from zeroshard.cli.train.resume import describe, resume
    from zeroshard.policies import ConfigError

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert resume(engine, _args(None)) is None  # no --save: nothing to resume
    assert resume(engine, _args(tmp_path)) is None  # an empty folder: a fresh start
    with pytest.raises(ConfigError, match="--resume: no checkpoint in"):
        resume(engine, _args(tmp_path, resume=True))
    engine.save_checkpoint(tmp_path, client_state=state_of(1, [4.5], _args(tmp_path)))
    got = resume(engine, _args(tmp_path))  # a plain re-run of the same command continues
    assert got["step"] == 1 and got["losses"] == [4.5] and got.tag_dir == str(tmp_path / "global_step1")
    assert "already holds a checkpoint" in got.reason
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    got = resume(engine, _args(tmp_path))
    assert got.reason.startswith("torchrun restart 2")
    assert describe(got, 1).endswith("nothing left to train (--steps 1)")


def test_the_kill_hook_fires_only_for_its_rank_step_and_first_attempt(monkeypatch):
    """(That it really kills is seen above: torchrun reports rank 1's exitcode -9.)"""
    import signal

    from zeroshard.policies import ConfigError

    kills = []
    monkeypatch.setattr(faults.os, "kill", lambda pid, sig: kills.append((pid, sig)))

    def fired(rank: int, restart: int) -> list[int]:
        hook, steps = faults.kill_hook(rank, restart), []
        for step in range(5):
            before = len(kills)
            hook(step)
            steps += [step] * (len(kills) - before)
        return steps

    monkeypatch.delenv(faults.ENV, raising=False)
    assert fired(1, 0) == []  # unset
    monkeypatch.setenv(faults.ENV, "kill:1:3")
    assert fired(1, 0) == [3] and kills[-1] == (os.getpid(), signal.SIGKILL)
    assert fired(0, 0) == []  # another rank
    assert fired(1, 1) == []  # torchrun's restarted attempt
    monkeypatch.setenv(faults.ENV, "kill:three")
    with pytest.raises(ConfigError, match="expected RANK:STEP"):
        faults.kill_hook(1, 0)


def test_max_restarts_reaches_torchrun_without_its_shared_store(monkeypatch, capsys):
    """--max-restarts N is passed on, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (pytorch#135712:
    a restarted worker could read the dead attempt's peer address from the shared store)."""
    from zeroshard.cli.main import main

    seen = {}

    def call(cmd, env, command, describe_stop=None):
        seen["cmd"], seen["env"] = cmd, env
        return 0

    monkeypatch.delenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", raising=False)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    import zeroshard.cli.supervise

    monkeypatch.setattr(zeroshard.cli.supervise, "supervise", call)
    assert main(["train", "--model", "tiny", "--seq-len", "16", "--steps", "2", "--max-restarts", "2",
                 "--report", ""]) == 0
    assert "--max-restarts=2" in seen["cmd"] and seen["env"]["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert main(["train", "--model", "tiny", "--seq-len", "16", "--steps", "2", "--report", ""]) == 0
    assert not any(a.startswith("--max-restarts") for a in seen["cmd"])
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in seen["env"]
    assert main(["train", "--max-restarts", "-1"]) == 2
    assert "--max-restarts must be 0 or more" in capsys.readouterr().err
    assert main(["train", "--reload-checkpoints"]) == 2
    assert "--reload-checkpoints reads back what --save DIR writes" in capsys.readouterr().err
