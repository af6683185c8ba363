"""Putting a model into stage-3 units: unit buckets (sharded at rest), persistent buckets
(small parameters kept whole, stage-2 style), and the runtime that gathers units."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.api.assembly import ALIGN_BYTES, ModelParts
from zeroshard.comm import Comm
from zeroshard.partition import FlatBucket, MemoryLedger, ParamInfo, plan_buckets
from zeroshard.partition.unit_bucket import UnitBucket
from zeroshard.policies import Settings
from zeroshard.stages.stage3 import Stage3Runtime, Unit
from zeroshard.stages.units import plan_stage3

WHOLE_UNIT = 2**62  # a unit's parameters of one dtype and group form one bucket


@dataclass
class Stage3Parts:
    trainable: list[FlatBucket]  # unit buckets first, then persistent buckets
    frozen: list[UnitBucket]  # frozen parameters of units (sharded, never stepped)
    persistent: set[int]  # indices into `trainable` of persistent (whole) buckets
    units: list[Unit]
    external_users: dict[int, list[nn.Module]]


def _layouts(params: list[nn.Parameter], names: dict[int, str], group_of: dict[int, int], bucket_numel: int,
             shards: int, dtype: torch.dtype):
    infos = [ParamInfo(names[id(p)], tuple(p.shape), str(dtype), group_of.get(id(p), 0)) for p in params]
    itemsize = torch.empty((), dtype=dtype).element_size()
    return plan_buckets(infos, bucket_numel, shards, alignment=max(1, ALIGN_BYTES // itemsize))


def build_stage3(model: nn.Module, parts: ModelParts, group_of: dict[int, int], settings: Settings,
                 rank: int, world: int, memory: MemoryLedger) -> Stage3Parts:
    dtype = settings.precision.compute.dtype
    plan = plan_stage3(model, settings.zero.stage3, settings.zero.stage3.min_unit_params)
    trainable: list[FlatBucket] = []
    frozen: list[UnitBucket] = []
    units: list[Unit] = []
    external: dict[int, list[nn.Module]] = {}
    for i, up in enumerate(plan.units):
        buckets: list[UnitBucket] = []
        for kind, params in (("t", [p for p in up.params if p.requires_grad]),
                             ("f", [p for p in up.params if not p.requires_grad])):
            if not params:
                continue
            for lay in _layouts(params, parts.names, group_of if kind == "t" else {}, WHOLE_UNIT, world, dtype):
                bucket = UnitBucket(lay, [params[s.index] for s in lay.slots], rank, memory,
                                    name=up.name, key=f"unit{i}.{kind}{lay.index}")
                buckets.append(bucket)
                (trainable if kind == "t" else frozen).append(bucket)
        units.append(Unit(i, up.name, up.module, buckets))
        external[i] = up.external_users
    persistent_params = [p for p in plan.persistent if p.requires_grad]
    first = len(trainable)
    if persistent_params:
        for lay in _layouts(persistent_params, parts.names, group_of, settings.zero.reduce_bucket_size, world, dtype):
            trainable.append(FlatBucket(lay, [persistent_params[s.index] for s in lay.slots], rank, memory,
                                        key=f"persistent{lay.index}"))
    return Stage3Parts(trainable, frozen, set(range(first, len(trainable))), units, external)


def make_runtime(parts: Stage3Parts, comm: Comm, memory: MemoryLedger, settings: Settings) -> Stage3Runtime:
    return Stage3Runtime(parts.units, comm, memory, settings.zero.stage3, parts.external_users)
