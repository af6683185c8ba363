"""Free heap pages go back to the system after each step (partition/malloc_trim.py): measured in
a fresh process as resident memory (VmRSS), on the heap pattern stage 3 leaves behind (holes
between blocks that stay alive)."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from oracle import MICRO, Case, batch, config_for, loss_of, make_model

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _rss() -> int:
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))


def _holes_worker(rank, world_size, trim):
    from zeroshard.partition.malloc_trim import HeapTrim

    big = torch.ones(4 << 18)  # 16 MiB: freeing it moves glibc's mmap threshold up, as a gathered unit does
    del big
    blocks = [torch.ones(1 << 18) for _ in range(400)]  # 1 MiB each, now from the heap
    before = _rss()
    kept = blocks[1::2]  # every other block stays alive: the freed ones are holes, not the heap's top
    del blocks
    freed = _rss()
    heap = HeapTrim(None if trim else False, host_in_use=True)
    heap()
    return {"before": before, "freed": freed, "after": _rss(), "active": heap.active, "kept": len(kept)}


@pytest.mark.parametrize("trim", [True, False])
def test_trim_returns_the_holes_the_heap_keeps(trim):
    (r,) = run_ranks(_holes_worker, 1, trim, timeout=120)
    mib = 1 << 20
    assert r["freed"] > r["before"] - 50 * mib, "the freed blocks should still be resident before a trim"
    if trim:
        assert r["active"]
        assert r["after"] < r["freed"] - 150 * mib, r  # 200 MiB of holes: most go back
    else:
        assert not r["active"] and r["after"] > r["freed"] - 50 * mib, r


def _engine_worker(rank, world_size, key):
    import logging

    import torch.distributed as dist

    import zeroshard

    dist.init_process_group("gloo")
    case = Case(stage=3, optimizer="sgd", steps=2)
    cfg = config_for(case, world_size)
    if key is not None:
        cfg["zeroshard"] = {"trim_host_memory": key}
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("zeroshard").addHandler(handler)
    logging.getLogger("zeroshard").setLevel(logging.INFO)
    engine = zeroshard.initialize(make_model(case), cfg)
    for step in range(case.steps):
        x, y = batch(case, step, world_size)
        lo, hi = rank * MICRO, (rank + 1) * MICRO
        engine.backward(loss_of(engine, x[lo:hi], y[lo:hi]))
        engine.step()
    out = {"active": engine.heap_trim.active, "seconds": engine.heap_trim.seconds,
           "banner": [line for line in lines if "host memory" in line]}
    engine.close()
    return out


def test_engine_trims_after_each_step_on_cpu_unless_told_not_to():
    on = run_ranks(_engine_worker, 2, None, timeout=180, env={"ZEROSHARD_VERBOSE": "1"})  # the whole start-up block
    off = run_ranks(_engine_worker, 2, False, timeout=180, env={"ZEROSHARD_VERBOSE": "1"})
    assert on[0]["active"] and on[0]["seconds"] > 0 and "malloc_trim" in on[0]["banner"][0]
    assert not off[0]["active"] and off[0]["seconds"] == 0 and "false" in off[0]["banner"][0]


def test_trims_after_the_first_step_then_only_when_resident_memory_grew(monkeypatch):
    import zeroshard.partition.malloc_trim as ht

    calls = []
    seen = iter([100, 90, 94, 200, 205])  # resident bytes after steps 1..5
    monkeypatch.setattr(ht, "_malloc_trim", lambda: (lambda pad: calls.append(pad)))
    monkeypatch.setattr(ht, "_resident_bytes", lambda: next(seen))
    trim = ht.HeapTrim(None, host_in_use=True)
    for _ in range(5):
        trim()
    assert trim.trims == 2 and calls == [0, 0]  # step 1, and step 4 (+113 %); 94 and 205 are within 5 %
