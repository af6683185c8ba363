"""Soak, short form: the default job's model and config (GPT mini, ZeRO stage 3, 2 ranks) for 120
steps, a checkpoint saved and loaded back every 6 (20 round trips), each rank's RSS, open files,
threads and memory mappings logged after each (`--resource-log`). Steps are made cheap (seq 16,
micro-batch 2) so the round trips dominate: they are what a leak per save or load multiplies.

Bounds, from step 30 on (the first 5 round trips are warm-up: the allocator and torch's pools
grow to their working size), 15 judged round trips per rank:
- RSS at most 24 MiB above the first judged sample. One rank's checkpoint here is 4.77 MiB
  (fp32 master 1.59 + AdamW states 3.18 MiB of its shard); keeping what one save wrote or one
  load read would add 72 MiB over 15 round trips, keeping the master alone 24 MiB. Without a
  leak the allocator moves RSS in 2-3 MiB steps (up to ~11 MiB seen in this short form on a
  loaded machine). bench/soak.py runs the 2,000-step form with a 16 MiB bound.
- open files and threads: exactly equal at every judged sample (a descriptor or thread left
  per save or load adds 15).
- memory mappings: at most 8 new ones (one per round trip would be 15).

That form is marked `slow` (`python -m pytest -m slow`). The default run has the smoke form:
the same command for 12 steps with a round trip every 3 (4 of them), whose log must hold every
round trip on both ranks; the flatness bounds are judged on the long form only (4 round trips
are still warm-up), and `judge` itself is checked on planted leaks below.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zeroshard.cli.train.resources import judge, read_log

MiB = 2**20
STEPS, EVERY, WARMUP = 120, 6, 30  # the long form
SHORT_STEPS, SHORT_EVERY = 12, 3  # the default run's smoke form


def _soak(cwd, steps: int, every: int) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "train", "--seq-len", "16",
                           "--micro-batch", "2", "--steps", str(steps), "--save", "ckpt", "--save-every", str(every),
                           "--reload-checkpoints", "--resource-log", "res", "--report", ""],
                          capture_output=True, text=True, timeout=600, env=env, cwd=cwd)


_RUNS: dict = {}  # (steps, every) -> (cwd, proc): each form runs once per session


def _run_once(tmp_path_factory, steps: int, every: int):
    if (steps, every) not in _RUNS:
        cwd = tmp_path_factory.mktemp("soak")
        _RUNS[steps, every] = cwd, _soak(cwd, steps, every)
    return _RUNS[steps, every]


@pytest.fixture(scope="module", params=[(SHORT_STEPS, SHORT_EVERY), pytest.param((STEPS, EVERY), marks=pytest.mark.slow)],
                ids=["short", "long"])
def soak_run(request, tmp_path_factory):
    steps, every = request.param
    return (*_run_once(tmp_path_factory, steps, every), steps, every)


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    """The long form, for the bounds (the same run as soak_run's long form)."""
    return _run_once(tmp_path_factory, STEPS, EVERY)


@pytest.mark.timeout(900)  # long form ~40 s on an idle 2-core machine
def test_the_soak_ran_every_round_trip_on_both_ranks(soak_run):
    cwd, proc, steps, every = soak_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GPT mini" in proc.stdout and "3 / 2 (gloo)" in proc.stdout
    ranks = read_log(str(cwd / "res"))
    assert sorted(ranks) == [0, 1]
    for rows in ranks.values():
        assert [r["step"] for r in rows if r["event"] == "checkpoint"] == list(range(every, steps + 1, every))
        assert rows[0]["event"] == "start" and rows[-1]["event"] == "end"


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("rank", [0, 1])
def test_rss_open_files_threads_and_mappings_stay_flat_after_warm_up(soak, rank):
    cwd, proc = soak
    assert proc.returncode == 0
    d, problems = judge(read_log(str(cwd / "res"))[rank], WARMUP, rss_rise=24 * MiB, maps_rise=8)
    assert d["samples"] == (STEPS - WARMUP) // EVERY + 1
    assert not problems, (problems, d)


def test_judge_sees_a_leak():
    """The bounds themselves: a leak of one descriptor, one thread or 4.77 MiB per round trip fails."""
    rows = [{"step": s, "event": "checkpoint", "rss_bytes": 400 * MiB, "open_fds": 9, "threads": 5, "mappings": 460}
            for s in range(EVERY, STEPS + 1, EVERY)]
    assert judge(rows, WARMUP, 24 * MiB, 8)[1] == []
    for key, per in (("open_fds", 1), ("threads", 1), ("mappings", 1), ("rss_bytes", int(4.77 * MiB))):
        leaky = [{**r, key: r[key] + i * per} for i, r in enumerate(rows)]
        assert judge(leaky, WARMUP, 24 * MiB, 8)[1], key
