"""A dead or diverging rank produces a clear error on the others within the timeout, not a hang."""

from __future__ import annotations

import time

import pytest

import torch

from distributed import run_ranks
from oracle import Case, config_for, make_model


def _dead_rank_worker(rank, world_size):
    import zeroshard

    cfg = config_for(Case(stage=2), world_size)
    cfg["zeroshard"] = {"comm_timeout_s": 5}
    engine = zeroshard.initialize(make_model(Case()), cfg)
    if rank == 1:
        raise RuntimeError("rank 1 crashed in its data loader")
    x = torch.randint(0, 64, (2, 16))
    started = time.perf_counter()
    try:
        engine.backward(engine(x, x)[1])
        engine.step()
    except zeroshard.CommError as exc:
        return {"message": str(exc), "seconds": time.perf_counter() - started, "type": type(exc).__name__}
    return {"message": "no error", "seconds": time.perf_counter() - started, "type": None}


def test_dead_rank_gives_a_clear_error_within_the_timeout():
    survivor, dead = run_ranks(_dead_rank_worker, 2, timeout=90, allow_failures=True)
    assert "rank 1 crashed" in dead
    assert survivor["type"] in ("CommError", "CommTimeoutError"), survivor
    msg = survivor["message"]
    assert "step 0" in msg and "backward" in msg, msg  # where in training
    assert "reduce_scatter" in msg and "gradients of bucket" in msg, msg  # which collective, on what
    assert survivor["seconds"] < 30, f"took {survivor['seconds']:.1f}s with a 5s timeout"


def _stage3_diverging_worker(rank, world_size, mode):
    """diverge: rank 0 skips block 1 (as MoE routing or a rank-local branch would);
    raise: rank 1 raises inside block 1's forward."""
    import zeroshard
    from oracle import Case, config_for, make_model

    case = Case(stage=3, zero=(("stage3_max_reuse_distance", 0), ("stage3_param_persistence_threshold", 0)))
    cfg = config_for(case, world_size)
    cfg["zeroshard"]["comm_timeout_s"] = 5
    model = make_model(case)
    engine = zeroshard.initialize(model, cfg)
    if mode == "diverge" and rank == 0:
        model.h[1].forward = lambda x: x  # instance attribute: this rank never enters block 1
    if mode == "raise" and rank == 1:
        def boom(x):
            raise ValueError("bad batch on rank 1")
        model.h[1].forward = boom
    x = torch.randint(0, 64, (2, 16))
    started = time.perf_counter()
    try:
        engine.backward(engine(x, x)[1])
        engine.step()
    except Exception as exc:  # the test asserts which kind
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.perf_counter() - started}
    return {"type": None, "message": "finished", "seconds": time.perf_counter() - started}


@pytest.mark.parametrize("mode", ["diverge", "raise"])
def test_stage3_diverging_ranks_fail_clearly_within_the_timeout(mode):
    results = run_ranks(_stage3_diverging_worker, 2, mode, timeout=90)
    for rank, r in enumerate(results):
        assert r["type"] is not None, f"rank {rank} finished a step its peer never took: {r}"
        assert r["seconds"] < 40, r
        if r["type"] in ("CommError", "CommTimeoutError"):
            assert "unit" in r["message"] and "step 0" in r["message"], r["message"]
    if mode == "raise":
        assert results[1]["type"] == "ValueError"
        assert results[0]["type"] in ("CommError", "CommTimeoutError")
