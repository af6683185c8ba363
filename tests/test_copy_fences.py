"""Asynchronous master -> shard copies are fenced before the master is written again (issue 46).

On CUDA with `offload_optimizer` (pinned host masters), each updated fp32 master is copied to
its device shard with `non_blocking=True`; stepping or editing that master again before the copy
has read it would hand the device a mix of old and new values, silently. The optimizer records a
fence (a CUDA event) per sub-group after those copies and waits on it before the sub-group's
masters are written again: the next step, a `GatheredParameters` write-back, a checkpoint load.

This machine has no CUDA: the fences here are stand-ins that log what was recorded and waited
for, around the real optimizer of a bf16 engine (separate fp32 masters, copied into bf16 shards
through the same asynchronous write)."""

from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.offload.fences import CopyFences


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []
        self.made = 0

    def event(self):
        log, self.made = self, self.made + 1
        number = self.made

        class Event:
            def record(self):
                log.events.append(("record", number))

            def synchronize(self):
                log.events.append(("wait", number))

        return Event()


def test_fences_wait_for_what_was_recorded_once():
    log = _Log()
    fences = CopyFences(enabled=True, make_event=log.event)
    fences.wait(0)  # nothing recorded: nothing to wait for
    fences.record(0)
    fences.record(1)
    assert fences.pending == 2
    fences.wait(0)
    fences.wait(0)
    fences.wait_all()
    assert log.events == [("record", 1), ("record", 2), ("wait", 1), ("wait", 2)] and fences.pending == 0
    off = CopyFences(enabled=False, make_event=log.event)
    off.record(0)
    assert off.pending == 0


def _engine(stage: int, sub_group_size: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "sub_group_size": sub_group_size, "reduce_bucket_size": 300,
                                 "allgather_bucket_size": 300, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    return zeroshard.initialize(model, cfg)


def _train(engine, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(2, 16, generator=g).to(torch.bfloat16)
        engine.backward(engine(x).float().square().mean())
        engine.step()


@pytest.mark.parametrize("stage", [1, 3])
def test_a_sub_groups_masters_are_stepped_only_after_last_steps_copies(stage):
    engine = _engine(stage, sub_group_size=400)  # several sub-groups
    opt = engine.train_state.optimizer
    assert any(opt._separate), "bf16 should keep separate fp32 masters, copied into the shards"
    log = _Log()
    opt.fences = CopyFences(enabled=True, make_event=log.event)
    inner_step = opt.optimizer.step
    steps: list[int] = []

    def step(*args, **kwargs):
        log.events.append(("step", len(steps)))
        steps.append(1)
        return inner_step(*args, **kwargs)

    opt.optimizer.step = step
    _train(engine, 3)
    groups = len(opt._sub_groups)
    assert groups > 1 and log.made == 3 * groups
    # every event recorded after a sub-group's copies is waited for before that sub-group's next step
    recorded_at = {}
    for i, (kind, n) in enumerate(log.events):
        if kind == "record":
            recorded_at[n] = i
    for n, at in recorded_at.items():
        if n > 2 * groups:  # the last step's fences are pending until the next step
            continue
        waits = [i for i, e in enumerate(log.events) if e == ("wait", n)]
        assert len(waits) == 1, f"fence {n} waited {len(waits)} times: {log.events}"
        next_steps = [i for i, e in enumerate(log.events[at:], at) if e[0] == "step"]
        # the sub-group's own next step comes `groups` steps of the torch optimizer later
        assert waits[0] < next_steps[groups - 1], log.events
    assert opt.fences.pending == groups
    b = next(b for b, separate in enumerate(opt._separate) if separate)
    with opt.resident(b):  # an edit of a master (GatheredParameters, a load) waits too
        pass
    assert opt.fences.pending == groups - 1
    engine.close()
