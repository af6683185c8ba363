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


def _top_worker(rank, world_size, trim):
    """glibc's own malloc and free (torch's tensors would leave small blocks of their own above)."""
    import ctypes

    from zeroshard.partition.malloc_trim import HeapTrim

    heap = HeapTrim(None if trim else False, host_in_use=True)
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes, libc.memset.argtypes = [ctypes.c_void_p], [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
    mib = 1 << 20
    big = libc.malloc(16 * mib)  # freeing 16 MiB moves glibc's own thresholds up, as a gathered unit does
    libc.memset(big, 1, 16 * mib)
    libc.free(big)
    blocks = [0] * 200  # no list growth (a heap block) between the blocks below
    for i in range(200):  # 1 MiB each, from the heap, at its top
        blocks[i] = libc.malloc(mib)
        libc.memset(blocks[i], 1, mib)
    before = _rss()
    for i in reversed(range(200)):  # all freed: the heap's top is 200 MiB of free space
        libc.free(blocks[i])
    return {"before": before, "after": _rss(), "kept": heap.top_kept}


@pytest.mark.parametrize("trim", [True, False])
def test_the_heap_top_freed_at_the_end_of_a_step_stays_for_the_next(trim):
    """glibc gives the free top back at the free that leaves more than M_TRIM_THRESHOLD there
    (stage 3's end of backward), and the next step faults it all in again; with the engine's
    trimming on, that top stays resident until zeroshard's own malloc_trim decides."""
    (r,) = run_ranks(_top_worker, 1, trim, timeout=120)
    mib = 1 << 20
    if trim:
        assert r["kept"] and r["after"] > r["before"] - 50 * mib, r
    else:
        assert not r["kept"] and r["after"] < r["before"] - 150 * mib, r
