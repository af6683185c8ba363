"""gloo's reduce-scatter, done as an all-to-all plus a local sum.

torch's gloo `reduce_scatter_tensor` clones the whole input on the calling thread and
all-reduces the clone: twice a reduce-scatter's bytes, and the clone blocks the caller (the
~17 ms per 25 MiB bucket of issue 13). zeroshard's Comm sends chunk j to rank j instead and
sums what it received at the wait. This checks the result on 3 ranks (a sum of three values,
in place and out of place, fp32 and bf16), that torch's gloo reduce-scatter is never called,
and that the ledger's wire bytes are a reduce-scatter's: (N-1)/N of the tensor."""

from __future__ import annotations

import torch
import torch.distributed as dist

from distributed import run_ranks

WORLD = 3


def _worker(rank: int, world_size: int):
    from zeroshard.comm import Comm, CommLedger, setup_topology

    topology = setup_topology(30.0)

    def refuse(*args, **kwargs):
        raise AssertionError("torch's gloo reduce_scatter_tensor was called")

    import zeroshard.comm.collectives as collectives

    collectives._RS = refuse  # what Comm calls for a native reduce-scatter
    dist.reduce_scatter_tensor = refuse
    comm = Comm(topology, CommLedger(world_size), 30.0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        numel = 4 * world_size
        full = (torch.arange(numel, dtype=torch.float32) * (rank + 1)).to(dtype)
        separate = torch.empty(numel // world_size, dtype=dtype)
        comm.reduce_scatter(separate, full.clone(), what="test").wait()
        in_place = full.clone()
        mine = in_place[rank * 4:(rank + 1) * 4]
        comm.reduce_scatter(mine, in_place, what="test in place").wait()
        out[str(dtype)] = (separate.float(), mine.float())
    stats = comm.ledger.stats()["reduce_scatter"]
    topology.destroy()
    return out, stats


def test_sums_every_rank_and_sends_a_reduce_scatters_bytes():
    ranks = run_ranks(_worker, WORLD, timeout=120)
    total = sum(r + 1 for r in range(WORLD))  # rank r contributes (r + 1) * arange
    for rank, (out, stats) in enumerate(ranks):
        expect = torch.arange(rank * 4, (rank + 1) * 4, dtype=torch.float32) * total
        for dtype, (separate, in_place) in out.items():
            assert torch.equal(separate, expect), (dtype, separate, expect)
            assert torch.equal(in_place, expect), (dtype, in_place, expect)
        # 4 calls of 12 elements: 2 fp32 (48 B each), 2 bf16 (24 B each); each rank sends 2/3
        assert stats["calls"] == 4 and stats["elements"] == 48
        assert stats["sent_bytes"] == 2 * (2 * 48 // 3) + 2 * (2 * 24 // 3)
