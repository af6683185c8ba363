"""Global gradient norm over shards, the clipping coefficient (torch's formula), and which
parameters overflowed."""

from __future__ import annotations

import math

import torch

from zeroshard.comm import Comm


def square_norm(g: torch.Tensor) -> torch.Tensor:
    """Sum of squares of one gradient shard, in fp32 (a 1-element tensor)."""
    return torch.linalg.vector_norm(g, dtype=torch.float32).square()


def global_grad_norm(shards: list[torch.Tensor], comm: Comm, partitioned: bool,
                     known: dict[int, torch.Tensor] | None = None) -> float:
    """L2 norm of the whole gradient. Shards held by different ranks (`partitioned`) are
    combined with one 1-element all-reduce of the sum of squares; inf/nan propagate, so the
    same number tells every rank whether any rank overflowed. `known` holds the `square_norm`
    of shards already taken (during backward, as each became final), by index."""
    device = shards[0].device if shards else torch.device("cpu")
    sq = torch.zeros(1, dtype=torch.float32, device=device)
    for i, g in enumerate(shards):
        sq += known[i] if known and i in known else square_norm(g)
    if partitioned and comm.world_size > 1:
        comm.all_reduce(sq, what="global gradient norm").wait()
    return math.sqrt(sq.item())  # inf and nan stay what they are


def clip_coefficient(norm: float, max_norm: float) -> float:
    """As `torch.nn.utils.clip_grad_norm_`: max_norm / (norm + 1e-6), at most 1. 0 disables."""
    if max_norm <= 0 or not math.isfinite(norm):
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


def nonfinite_parameters(buckets, grad_shard, limit: int = 3) -> list[str]:
    """Names of parameters whose reduced gradient in this rank's shard (`grad_shard(b)` of each
    bucket) holds inf or nan: called only after an overflow, to say where it came from."""
    names: list[str] = []
    for b, bucket in enumerate(buckets):
        shard, (lo, _) = grad_shard(b), bucket.shard_range
        if bool(torch.isfinite(shard).all()):
            continue
        for slot in bucket.slots:
            part = bucket.layout.slot_in_shard(slot, bucket.shard_index)
            if part and not bool(torch.isfinite(shard[part[0] - lo : part[1] - lo]).all()):
                names.append(slot.name)
                if len(names) >= limit:
                    return names
    return names
