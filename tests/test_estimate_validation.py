"""Estimates against the engine's ledgers (issue 5): skipped until the engine exists.

When `zeroshard.api.initialize` returns an engine with `memory_stats()` (bytes per rank,
keys `params`, `grads`, `optimizer_states`, `comm_buffers`) and `comm_stats()` (per
collective: `calls`, `elements`, `bytes`, `sent_bytes`), these tests train the small GPT on
gloo, world size 2, and compare with `estimate_memory` (within 5%) and `estimate_comm`
(elements exactly, padding to a multiple of N per bucket as the engine's layout states).
"""

import pytest


def _engine_ready() -> str | None:
    try:
        from zeroshard import api
    except ImportError as e:  # pragma: no cover
        return f"zeroshard.api not importable: {e}"
    if not hasattr(api, "initialize"):
        return "engine not built yet: zeroshard.api.initialize is missing (validation waits for the stages)"
    return "engine exists but the ledger validation is not written yet: needs memory_stats()/comm_stats() keys"


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_predicted_memory_and_comm_match_engine_ledgers(stage):
    pytest.skip(_engine_ready())
