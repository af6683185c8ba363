"""Parameters partitioned one at a time, before any unit exists (`zeroshard.Init`).

Each such parameter keeps its true shape but points at a one-element NaN (as a released
stage-3 parameter does); this rank's slice of its flattened value, padded to a multiple
of the world size, is kept here, keyed weakly by the parameter (nothing is attached to it).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING
from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.partition.flat_bucket import placeholder

if TYPE_CHECKING:
    from zeroshard.comm import Comm


@dataclass
class ParamShard:
    shard: torch.Tensor  # this rank's slice of the flattened, padded value
    numel: int
    world_size: int
    timeout_s: float | None = None  # comm_timeout_s of the run that sharded it (its collectives' limit)


# id(param) -> (weak reference, shard). Not a WeakKeyDictionary: it compares keys with ==,
# which for tensors is elementwise.
_SHARDS: dict[int, tuple[weakref.ref, ParamShard]] = {}


def shard_parameter(param: nn.Parameter, rank: int, world_size: int, timeout_s: float | None = None) -> ParamShard:
    """Keep rank `rank`'s slice of `param` and free the rest; `timeout_s`: the sharding run's
    `comm_timeout_s`, which a later gather of it (`GatheredParameters` before `initialize`) keeps."""
    flat = param.detach().reshape(-1)
    per_rank = -(-flat.numel() // world_size)
    padded = torch.zeros(per_rank * world_size, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()].copy_(flat)
    entry = ParamShard(padded[rank * per_rank : (rank + 1) * per_rank].clone(), flat.numel(), world_size, timeout_s)
    param.data = placeholder(param.shape, param.dtype, param.device)
    key = id(param)
    _SHARDS[key] = (weakref.ref(param, lambda _: _SHARDS.pop(key, None)), entry)
    return entry


def shard_of(param: nn.Parameter) -> ParamShard | None:
    found = _SHARDS.get(id(param))
    return found[1] if found is not None and found[0]() is param else None


def forget(param: nn.Parameter) -> None:
    if shard_of(param) is not None:
        del _SHARDS[id(param)]


def materialize(param: nn.Parameter, comm: "Comm") -> bool:
    """Give a parameter sharded by `Init` its full value again (all-gather). False if it was not."""
    entry = shard_of(param)
    if entry is None:
        return False
    full = torch.empty(entry.shard.numel() * entry.world_size, dtype=entry.shard.dtype, device=entry.shard.device)
    comm.all_gather(full, entry.shard, what="materialize a parameter built under zeroshard.Init").wait()
    param.data = full[: entry.numel].view(param.shape)
    return True
