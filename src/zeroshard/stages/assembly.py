"""Putting a model into buckets: which parameters train, their layout, their storage.

Kept apart from the Engine so the Engine reads as the training loop it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Comm, Handle
from zeroshard.partition import FlatBucket, MemoryLedger, ParamInfo, plan_buckets
from zeroshard.partition.layout import alignment_for

@dataclass
class ModelParts:
    names: dict[int, str]  # id(param) -> first name (tied parameters appear once)
    trainable: list[nn.Parameter]
    frozen: list[nn.Parameter]


def split_parameters(module: nn.Module) -> ModelParts:
    names: dict[int, str] = {}
    trainable, frozen = [], []
    for name, p in module.named_parameters():
        names[id(p)] = name
        (trainable if p.requires_grad else frozen).append(p)
    return ModelParts(names, trainable, frozen)


def plan_layouts(params: list[nn.Parameter], names: dict[int, str], group_of: dict[int, int],
                 dtypes: list[torch.dtype], bucket_numel: int, shard_count: int):
    """The bucket layouts of `params`, each computing in its entry of `dtypes` (group 0 where
    `group_of` has none), shards aligned for the smallest of those dtypes."""
    if not params:
        return ()
    infos = [ParamInfo(names[id(p)], tuple(p.shape), str(t), group_of.get(id(p), 0)) for p, t in zip(params, dtypes)]
    return plan_buckets(infos, bucket_numel, shard_count, alignment=alignment_for(min(t.itemsize for t in dtypes)))


def build_buckets(parts: ModelParts, group_of: dict[int, int], bucket_numel: int, shard_count: int,
                  shard_index: int, memory: MemoryLedger, compute_dtype: torch.dtype) -> list[FlatBucket]:
    """Buckets hold the parameters in their original dtype until `take_masters_and_cast`; they are
    grouped by the dtype they will compute in."""
    target = [compute_dtype if p.is_floating_point() else p.dtype for p in parts.trainable]
    layouts = plan_layouts(parts.trainable, parts.names, group_of, target, bucket_numel, shard_count)
    return [FlatBucket(lay, [parts.trainable[s.index] for s in lay.slots], shard_index, memory) for lay in layouts]


def take_masters_and_cast(buckets: list[FlatBucket], compute_dtype: torch.dtype) -> list[torch.Tensor | None]:
    """fp32 master shards from the full-precision values, then the buckets move to the
    compute dtype: rounding to 16 bits happens once, in the compute copy only. In fp32 the
    shard itself is the master (None here: the optimizer steps the shard in place, as
    FSDP does; DeepSpeed keeps a second fp32 copy, 4 bytes per parameter / N more)."""
    if compute_dtype == torch.float32 and all(b.dtype == torch.float32 for b in buckets):
        return [None] * len(buckets)
    masters = [b.shard().detach().to(torch.float32, copy=True) for b in buckets]
    for b in buckets:
        b.to_dtype(compute_dtype)
    return masters


def broadcast_model(module: nn.Module, buckets: list[FlatBucket], comm: Comm, loose: bool = True) -> None:
    """Make every rank start from rank 0's values: one call per bucket, and (with `loose`)
    one per parameter or buffer outside the buckets."""
    if comm.world_size == 1:
        return
    handles: list[Handle] = [comm.broadcast(b.data, 0, what=f"initial parameters, bucket {b.key}")
                             for b in buckets]
    if loose:
        in_buckets = {id(p) for b in buckets for p in b.params}
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if id(t) not in in_buckets:
                handles.append(comm.broadcast(t.data, 0, what=f"initial value of {name}"))
    for h in handles:
        h.wait()
