"""GatheredParameters on parameters `zeroshard.Init` sharded (before `initialize`) runs its
collectives with the run's configured `zeroshard.comm_timeout_s`, not a fixed 600 s, and
gives back the process group it made for them (2 real gloo ranks on the user's own group)."""

from __future__ import annotations

import torch
from torch import nn

from distributed import run_ranks

TIMEOUT_S = 37.0


def _worker(rank, world_size):
    import torch.distributed as dist

    import zeroshard
    from zeroshard.comm import topology

    dist.init_process_group("gloo")  # the user's group: zeroshard makes (and must release) its own
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
           "zeroshard": {"comm_timeout_s": TIMEOUT_S}}
    with zeroshard.Init(cfg):
        torch.manual_seed(rank)  # different on each rank: rank 0's values are broadcast
        model = nn.Sequential(nn.Linear(6, 5))
    weight = model[0].weight
    groups_before = len(topology._own_groups)
    with zeroshard.GatheredParameters(weight, modifier_rank=0) as gathered:
        timeout, full = gathered._comm_obj.timeout_s, weight.detach().clone()
        if rank == 0:
            weight.data.fill_(0.5)  # an edit on rank 0 goes to every rank's shard
    with zeroshard.GatheredParameters(weight):
        after = weight.detach().clone()
    return {"timeout": timeout, "full": full, "after": after,
            "groups_left": len(topology._own_groups) - groups_before}


def test_init_parameters_gather_with_the_configured_timeout():
    out = run_ranks(_worker, 2, timeout=120)
    for r in out:
        assert r["timeout"] == TIMEOUT_S
        assert r["full"].shape == (5, 6) and torch.equal(r["full"], out[0]["full"])
        assert torch.equal(r["after"], torch.full((5, 6), 0.5))
        assert r["groups_left"] == 0  # the group made for the gather is destroyed on exit
