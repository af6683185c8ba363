"""The buffer pool: large transient CPU buffers (stage 3's gathered units and gradient buckets,
gloo's reduce-scatter receive buffer) are handed out again instead of being freed and faulted in
anew. It must change nothing but where the bytes come from: training is bit-equal with it on and
off, and a buffer whose storage something else still uses (a view autograd saved) is never
handed out. The default pools only blocks of 1 MiB or more; these tests pool every size."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from distributed import run_ranks
from zeroshard.partition import MemoryLedger
from zeroshard.partition.buffer_pool import BufferPool


def test_reuses_exact_sizes_and_counts_idle_bytes():
    memory = MemoryLedger()
    pool = BufferPool(memory, min_bytes=0)
    a = pool.empty(1000, torch.float32, torch.device("cpu"))
    ptr = a.data_ptr()
    pool.give(a)
    assert memory.stats()["comm_buffers"] == 4000
    del a
    assert pool.empty(999, torch.float32, torch.device("cpu")).data_ptr() != ptr  # other size: new
    b = pool.empty(1000, torch.float32, torch.device("cpu"))
    assert b.data_ptr() == ptr and pool.reused == 1 and memory.stats()["comm_buffers"] == 0


def test_a_buffer_still_viewed_elsewhere_is_not_handed_out():
    pool = BufferPool(MemoryLedger(), min_bytes=0)
    a = pool.empty(1000, torch.float32, torch.device("cpu"))
    kept = a[10:20]  # e.g. a view autograd saved for backward
    ptr = a.data_ptr()
    pool.give(a)
    del a
    assert pool.empty(1000, torch.float32, torch.device("cpu")).data_ptr() != ptr
    assert pool.reused == 0 and kept.numel() == 10


def test_small_buffers_are_left_to_the_allocator():
    pool = BufferPool(MemoryLedger())  # default: 1 MiB and more
    a = pool.empty(1000, torch.float32, torch.device("cpu"))
    pool.give(a)
    assert pool.empty(1000, torch.float32, torch.device("cpu")).data_ptr() != a.data_ptr() or pool.reused == 0
    assert pool.reused == 0


def test_keeps_as_many_as_were_out_at_once_and_lets_a_larger_peak_go_after_the_next_period():
    memory = MemoryLedger()
    pool = BufferPool(memory, min_bytes=0, keep=2)
    cpu = torch.device("cpu")
    for _ in range(3):  # a step holding five units at once (every unit kept from forward to backward)
        bufs = [pool.empty(1000, torch.float32, cpu) for _ in range(5)]
        for b in bufs:
            pool.give(b)
        del bufs
        pool.end_period()
    assert pool.fresh == 5 and pool.reused == 10 and memory.stats()["comm_buffers"] == 5 * 4000
    for _ in range(2):  # then steps with one out at a time: the five stay idle for one period only
        pool.give(pool.empty(1000, torch.float32, cpu))
        pool.end_period()
    assert pool.fresh == 5 and memory.stats()["comm_buffers"] == 2 * 4000  # the floor, keep=2


class Lin(nn.Module):
    """`x @ weight.t()`: autograd saves the transposed *view* of the gathered weight, which keeps
    the unit's full buffer alive after the unit is released at the end of its forward."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d ** 0.5)

    def forward(self, x):
        return torch.tanh(x @ self.weight.t())


def _train(rank: int, world: int, min_bytes: int):
    import zeroshard
    from zeroshard.partition import buffer_pool

    buffer_pool.MIN_BYTES = min_bytes
    torch.manual_seed(0)
    model = nn.Sequential(*[Lin(48) for _ in range(4)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                                 "stage3_param_persistence_threshold": 0},
           "zeroshard": {"stage3_unit_classes": ["Lin"]}}
    engine = zeroshard.initialize(model, cfg)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(4):
        x = torch.randn(4, 48, generator=g)
        loss = engine(x).pow(2).mean()
        engine.backward(loss)
        engine.step()
    state = engine.full_state_dict()
    reused = engine.pool.reused
    engine.close()
    return state, reused


def _fresh_per_step(rank: int, world: int) -> list[int]:
    """Stage 3 with its defaults on a model that fits: every unit stays gathered from its forward
    to its backward, so four full buffers are out at once (a pool of two unmapped the others and
    faulted them in again every step). New buffers taken per step."""
    import zeroshard
    from zeroshard.partition import buffer_pool

    buffer_pool.MIN_BYTES = 0
    torch.manual_seed(0)
    model = nn.Sequential(*[Lin(48) for _ in range(4)])
    cfg = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "zeroshard": {"stage3_unit_classes": ["Lin"]}}
    engine = zeroshard.initialize(model, cfg)
    fresh = []
    for _ in range(5):
        before = engine.pool.fresh
        engine.backward(engine(torch.randn(4, 48)).pow(2).mean())
        engine.step()
        fresh.append(engine.pool.fresh - before)
    engine.close()
    return fresh


def _worker(rank: int, world: int):
    dist.init_process_group("gloo")
    return _train(rank, world, 0), _train(rank, world, 1 << 62), _fresh_per_step(rank, world)


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_worker, 2, timeout=180)


def test_training_is_bit_equal_with_the_pool_on_and_off(runs):
    (pooled, reused), (plain, never), _ = runs[0]
    assert reused > 0 and never == 0
    for name, value in plain.items():
        assert torch.equal(pooled[name], value), f"{name} differs with the buffer pool on"


def test_a_step_holding_every_unit_takes_no_new_buffer_once_its_order_is_recorded(runs):
    # step 1 records the order, step 2 is the first to prefetch along it (more out at once)
    for _, _, fresh in runs:
        assert fresh[0] > 0 and fresh[2:] == [0, 0, 0], fresh
