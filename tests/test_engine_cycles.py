"""A process that builds and closes engines many times (a hyperparameter search, a notebook)
neither races nor leaks (issue 46): 20 cycles of initialize -> one step -> close on 2 ranks,
with the default process group made and destroyed by each engine, and with a group the
caller owns (which close() must leave alone). Open file descriptors and OS threads stay
constant after the first cycles (within 2: under load, as with two tests at once, one rank's count
was seen to flap by 1 or 2 without growing); resident memory grows by less than 16 MiB over the last 15.
(Measured here: constant fds and threads, +5 MiB RSS over 20 cycles. Before Engine.close()
collected its reference cycles, the caller-owned case grew to 5 live groups: +45 fds, +27 threads.)"""

from __future__ import annotations

import os
from statistics import median

import pytest

from distributed import run_ranks

CYCLES = 20


def _status() -> tuple[int, int]:
    """(OS threads, resident KiB) of this process, from /proc."""
    fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


def _cycles(rank: int, world: int, own_group: bool, stage: int) -> list[tuple]:
    import torch.distributed as dist

    import zeroshard
    from oracle import MICRO, Case, batch, config_for, loss_of, make_model

    if own_group:
        dist.init_process_group("gloo")
    case = Case(model="gpt", stage=stage, optimizer="adamw", steps=1)
    seen = []
    for i in range(CYCLES):
        engine = zeroshard.initialize(make_model(case), config_for(case, world))
        x, y = batch(case, i, world)
        loss = loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO])
        engine.backward(loss)
        engine.step()
        engine.close()
        seen.append((dist.is_initialized(), len(os.listdir("/proc/self/fd")), *_status()))
    if own_group:
        dist.destroy_process_group()
    return seen


@pytest.mark.parametrize("own_group, stage", [pytest.param(False, 3, marks=pytest.mark.slow), (True, 2)])
def test_twenty_engines_in_one_process_leave_nothing_behind(own_group, stage):
    for seen in run_ranks(_cycles, 2, own_group, stage, timeout=600):
        assert all(s[0] == own_group for s in seen)  # close() destroys only the group it made
        fds, threads = [s[1] for s in seen[2:]], [s[2] for s in seen[2:]]
        for counts in (fds, threads):  # no growth; a flap of one or two (seen only under load) allowed
            assert max(counts) - min(counts) <= 2 and median(counts[-5:]) <= median(counts[:5]), (fds, threads)
        assert seen[-1][3] - seen[4][3] < 16 * 1024, [s[3] for s in seen]


def _late_closer(rank: int, world: int, stage: int) -> list[float]:
    """Three engines in turn, each making and destroying the default group; rank 0 closes each one
    a second after rank 1, which goes straight on to its next engine. Seconds each build took."""
    import time

    import zeroshard
    from oracle import MICRO, Case, batch, config_for, loss_of, make_model

    case = Case(model="gpt", stage=stage, optimizer="sgd", steps=1)
    built = []
    for i in range(3):
        started = time.perf_counter()
        cfg = {**config_for(case, world), "zeroshard": {"comm_timeout_s": 20}}
        engine = zeroshard.initialize(make_model(case), cfg)
        built.append(time.perf_counter() - started)
        x, y = batch(case, i, world)
        engine.backward(loss_of(engine, x[rank * MICRO:(rank + 1) * MICRO], y[rank * MICRO:(rank + 1) * MICRO]))
        engine.step()
        if rank == 0:
            time.sleep(1.0)
        engine.close()
    return built


def test_a_rank_that_closes_late_does_not_hang_the_next_engine():
    # Before: rank 1's next group joined the rendezvous server of rank 0's closing group, and rank 0's
    # new server waited for it until the timeout ("1/2 clients joined"): a hang. Now every default
    # group zeroshard makes rendezvouses on one store kept for the process's life, each under a prefix.
    late, early = run_ranks(_late_closer, 2, 2, timeout=200)
    assert all(t < 15 for t in late + early), (late, early)
    assert all(t > 0.5 for t in early[1:]), early  # rank 1 waited in the rendezvous for rank 0

