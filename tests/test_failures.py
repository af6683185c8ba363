"""A dead or diverging rank produces a clear error on the others within the timeout, not a hang."""

from __future__ import annotations

import time

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
    assert "reduce_scatter" in msg and "gradient bucket" in msg, msg  # which collective, on what
    assert survivor["seconds"] < 30, f"took {survivor['seconds']:.1f}s with a 5s timeout"
