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
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from zeroshard.cli.train_resources import judge, read_log

MiB = 2**20
STEPS, EVERY, WARMUP = 120, 6, 30


@pytest.fixture(scope="module")
def soak(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("soak")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "zeroshard.cli.main", "train", "--seq-len", "16",
                           "--micro-batch", "2", "--steps", str(STEPS), "--save", "ckpt", "--save-every", str(EVERY),
                           "--reload-checkpoints", "--resource-log", "res", "--report", ""],
                          capture_output=True, text=True, timeout=600, env=env, cwd=cwd)
    return cwd, proc


@pytest.mark.timeout(900)  # ~40 s on an idle 2-core machine
def test_the_soak_ran_every_round_trip_on_both_ranks(soak):
    cwd, proc = soak
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "GPT mini" in proc.stdout and "3 / 2 (gloo)" in proc.stdout
    ranks = read_log(str(cwd / "res"))
    assert sorted(ranks) == [0, 1]
    for rows in ranks.values():
        assert [r["step"] for r in rows if r["event"] == "checkpoint"] == list(range(EVERY, STEPS + 1, EVERY))
        assert rows[0]["event"] == "start" and rows[-1]["event"] == "end"


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
