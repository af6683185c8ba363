"""Run a function on N real ranks (gloo process group), with a hard timeout.

The spawner is zeroshard.bench.ranks (shared with the scripts in bench/): each rank is a
spawned process with torchrun's environment variables set, so the code under test creates
(or finds) the process group exactly as it does under torchrun. A rank that raises fails the
test with its traceback; ranks that hang are killed after `timeout` seconds and the test fails
instead of freezing CI.
"""

from __future__ import annotations

import contextlib

import functools
import os

from zeroshard.bench import ranks
from zeroshard.bench.ranks import free_port, from_wire, rank_entry, to_wire

# The suite's ranks fork from one forkserver that imported torch and zeroshard once, then froze
# that heap for the garbage collector (zeroshard.bench.frozen_heap): ~0.1 s of CPU a rank against
# several seconds for a spawned interpreter's imports; hundreds of rank starts per run.
# ZEROSHARD_TEST_RANK_START=spawn gives every rank a fresh interpreter, as the benchmarks do.
# A rank sees the caller's os.environ of the moment; what a process reads only at its start
# (glibc's MALLOC_* variables, torch's import-time settings) needs start="spawn".
START = os.environ.get("ZEROSHARD_TEST_RANK_START", "forkserver")
run_ranks = functools.partial(ranks.run_ranks, start=START)


def rank_context():
    """The multiprocessing context run_ranks starts the suite's ranks with, for tests that start
    ranks themselves (their rank_entry gets `parent_env=dict(os.environ)`)."""
    return ranks.start_context(START)

# the names tests that start ranks themselves use (test_dead_ranks)
_entry, _from_wire, _to_wire = rank_entry, from_wire, to_wire

__all__ = ["free_port", "one_group", "rank_context", "run_ranks"]


@contextlib.contextmanager
def one_group():
    """One gloo process group for a rank that builds several engines in turn. Each engine then
    makes (and releases) a group of its own on it. Otherwise each engine makes and destroys the
    default group: before session 53 a fast rank's next rendezvous could reach rank 0's old store
    while rank 0 tore it down ("Failed to recv, got 0 bytes" twice in full runs of
    test_resume_matches_deepspeed_on_two_ranks; a hang in another test). zeroshard now keeps one
    rendezvous store per process (comm/topology.py, tested in test_engine_cycles); one group is
    still the cheaper way: no rendezvous per engine."""
    import torch.distributed as dist

    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo")
    try:
        yield
    finally:
        if made and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
