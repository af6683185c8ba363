"""The test suite's rank spawner (zeroshard.bench.ranks.run_ranks) fails fast: a rank that
dies without a word or raises ends the call within its grace, not after the whole timeout
(a peer left waiting in a rendezvous or a collective would otherwise hold CI for minutes)."""

from __future__ import annotations

import os
import time

import pytest

from zeroshard.bench.ranks import run_ranks


def _dies(rank: int, world_size: int) -> None:
    if rank == 0:
        os._exit(3)  # no exception, nothing on the queue: a segfault or an OOM kill looks like this
    time.sleep(120)


def _raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("planted failure")
    time.sleep(120)


@pytest.mark.parametrize("fn, says", [(_dies, "exited with code 3 without reporting"),
                                      (_raises, "ValueError: planted failure")])
def test_a_failed_rank_ends_the_call_within_the_grace(fn, says):
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(fn, 2, timeout=100, grace=2)
    took = time.monotonic() - start
    assert says in str(failed.value)
    assert "killed: no result 2s after a peer failed" in str(failed.value)  # the sleeping peer
    assert took < 40, f"the call took {took:.0f}s: it waited for the sleeping peer"


def test_allow_failures_returns_every_ranks_outcome():
    out = run_ranks(_raises_fast, 2, timeout=60, allow_failures=True)
    assert out[0] == 0 and "planted failure" in out[1]


def _raises_fast(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("planted failure")
    return rank


def _env_of(rank: int, world_size: int, names: list[str]) -> dict:
    return {n: os.environ.get(n) for n in names}


@pytest.mark.parametrize("start", ["spawn", "forkserver"])
def test_a_rank_sees_the_callers_environment_of_the_moment(monkeypatch, start):
    """The forkserver started with the first call's environment; a later call's changes (a
    test's monkeypatch.setenv / delenv) reach its ranks as they reach a spawned one's."""
    monkeypatch.setenv("ZEROSHARD_PROBE_KEEP", "1")
    run_ranks(_env_of, 1, ["ZEROSHARD_PROBE_KEEP"], timeout=60, start=start)  # forkserver up
    monkeypatch.setenv("ZEROSHARD_PROBE_SET", "later")
    monkeypatch.delenv("ZEROSHARD_PROBE_KEEP")
    out = run_ranks(_env_of, 2, ["ZEROSHARD_PROBE_SET", "ZEROSHARD_PROBE_KEEP"], timeout=60, start=start)
    assert out == [{"ZEROSHARD_PROBE_SET": "later", "ZEROSHARD_PROBE_KEEP": None}] * 2


def _faults_of_a_full_collection(rank: int, world_size: int) -> int:
    import gc
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    gc.collect()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_a_forked_ranks_full_collection_leaves_the_servers_pages_shared():
    """The forkserver froze what its imports made (zeroshard.bench.frozen_heap), so a forked
    rank's garbage collections do not walk those ~400,000 objects, each walk writing to every
    page that holds one (a copy of ~100 MB per rank: ~25,000 page faults, measured)."""
    faults = run_ranks(_faults_of_a_full_collection, 1, timeout=120, start="forkserver")[0]
    assert faults < 2_500, f"a full collection in a forked rank took {faults} page faults"
