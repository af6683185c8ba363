"""Run a function on N real ranks (gloo process group), with a hard timeout.

The spawner is zeroshard.bench.ranks (shared with the scripts in bench/): each rank is a
spawned process with torchrun's environment variables set, so the code under test creates
(or finds) the process group exactly as it does under torchrun. A rank that raises fails the
test with its traceback; ranks that hang are killed after `timeout` seconds and the test fails
instead of freezing CI.
"""

from __future__ import annotations

from zeroshard.bench.ranks import free_port, from_wire, rank_entry, run_ranks, to_wire

# the names tests that start ranks themselves use (test_dead_ranks)
_entry, _from_wire, _to_wire = rank_entry, from_wire, to_wire

__all__ = ["free_port", "run_ranks"]
