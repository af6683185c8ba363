"""The buffer pool: large transient CPU buffers (stage 3's gathered units and gradient buckets,
gloo's reduce-scatter receive buffer) are handed out again instead of being freed and faulted in
anew. It must change nothing but where the bytes come from: training is bit-equal with it on and
off, and a buffer whose storage something else still uses (a view autograd saved) is never
handed out. The default pools only blocks of 32 MiB or more; these tests pool every size."""

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
    pool = BufferPool(MemoryLedger())  # default: 32 MiB and more
    a = pool.empty(1000, torch.float32, torch.device("cpu"))
    pool.give(a)
    assert pool.empty(1000, torch.float32, torch.device("cpu")).data_ptr() != a.data_ptr() or pool.reused == 0
    assert pool.reused == 0


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


def _worker(rank: int, world: int):
    dist.init_process_group("gloo")
    return _train(rank, world, 0), _train(rank, world, 1 << 62)


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_worker, 2, timeout=180)


def test_training_is_bit_equal_with_the_pool_on_and_off(runs):
    (pooled, reused), (plain, never) = runs[0]
    assert reused > 0 and never == 0
    for name, value in plain.items():
        assert torch.equal(pooled[name], value), f"{name} differs with the buffer pool on"
