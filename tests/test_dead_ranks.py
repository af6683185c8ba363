"""A peer killed with SIGKILL mid-step, or alive but stuck in forward: every other rank raises
within `comm_timeout_s`, naming the collective, the bucket or unit and the step, at stages 1,
2 and 3, even when the script made the process group itself (its timeout is torch's
30-minute default: zeroshard's collectives run on a group of their own with comm_timeout_s).
No process is left behind.

A stuck peer waits up to STUCK_S (until the survivor has reported) before it goes on and fails:
the default run has it at stage 3, its stage-1 and stage-2 forms are marked `slow`
(`python -m pytest -m slow`); the killed peer runs at every stage."""

from __future__ import annotations

import os
import signal
import time
from queue import Empty

import pytest
import torch

from distributed import _entry, _from_wire, free_port, rank_context
from oracle import Case, config_for, make_model

TIMEOUT_S = 4
STUCK_S = 12


def _worker(rank, world, stage, mode, reported):
    import torch.distributed as dist

    import zeroshard

    dist.init_process_group("gloo")  # the script's own group: torch's default 30-minute timeout
    case = Case(stage=stage, zero=(("stage3_param_persistence_threshold", 0),) if stage == 3 else ())
    cfg = config_for(case, world)
    cfg.setdefault("zeroshard", {})["comm_timeout_s"] = TIMEOUT_S
    model = make_model(case)
    engine = zeroshard.initialize(model, cfg)
    x = torch.randint(0, 64, (2, 16))
    engine.backward(engine(x, x)[1])  # step 0 is fine
    engine.step()
    if rank == 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        reported.wait(STUCK_S)  # stuck in its data loader / forward until the survivor has reported
    started = time.perf_counter()
    try:
        engine.backward(engine(x, x)[1])
        engine.step()
    except zeroshard.CommError as exc:
        return {"message": str(exc), "seconds": time.perf_counter() - started}
    return {"message": "no error", "seconds": time.perf_counter() - started}


def _run(stage, mode):
    ctx = rank_context()
    queue, port, reported = ctx.Queue(), free_port(), ctx.Event()
    procs = [ctx.Process(target=_entry, args=(_worker, r, 2, port, (stage, mode, reported), queue, {}, dict(os.environ)),
                         daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    got = {}
    deadline = time.monotonic() + 120
    try:
        while 0 not in got and time.monotonic() < deadline:
            try:
                rank, ok, value = queue.get(timeout=5)
            except Empty:
                continue
            got[rank] = _from_wire(value) if ok else {"message": value, "seconds": None}
        reported.set()
        for p in procs:  # every process ends by itself (the stuck one fails once it wakes)
            p.join(timeout=STUCK_S + 30)
        left = [p.pid for p in procs if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    return got.get(0), left


@pytest.mark.parametrize("stage, mode", [
    (1, "kill"), pytest.param(1, "stuck", marks=pytest.mark.slow),
    (2, "kill"), pytest.param(2, "stuck", marks=pytest.mark.slow),
    (3, "kill"), (3, "stuck"),
], ids=["1-kill", "1-stuck", "2-kill", "2-stuck", "3-kill", "3-stuck"])
def test_survivor_raises_within_the_timeout_naming_where(stage, mode):
    survivor, left = _run(stage, mode)
    assert survivor is not None, "rank 0 never finished"
    msg = survivor["message"]
    assert survivor["seconds"] is not None, msg
    assert survivor["seconds"] < TIMEOUT_S * 3 + 5, f"took {survivor['seconds']:.1f}s with a {TIMEOUT_S}s timeout"
    assert "step 1" in msg, msg
    assert any(op in msg for op in ("reduce_scatter", "all_gather", "all_reduce")), msg
    assert ("bucket" in msg) or ("unit" in msg), msg
    assert left == [], f"processes left behind: {left}"
