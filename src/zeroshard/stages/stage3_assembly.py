"""Putting a model into stage-3 units, one unit at a time so the peak is about one unit
beyond the shards: give the unit's parameters their full values (from `zeroshard.Init`
shards, the meta device, or as they are), copy them into unit buckets, make every rank
agree with rank 0, keep fp32 masters of the trainable shards, cast, and drop all but
this rank's shard. Small parameters stay whole in persistent (stage-2 style) buckets."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.stages.assembly import ModelParts, broadcast_model, plan_layouts, take_masters_and_cast
from zeroshard.partition.param_shards import forget, materialize
from zeroshard.comm import Comm, QuantizedAllGather
from zeroshard.offload import make_tier
from zeroshard.partition import FlatBucket, MemoryLedger
from zeroshard.partition.buffer_pool import BufferPool
from zeroshard.partition.layout import alignment_for
from zeroshard.partition.unit_bucket import UnitBucket
from zeroshard.policies import ConfigError, OffloadDevice, Settings
from zeroshard.stages.stage3 import Stage3Collectives
from zeroshard.stages.unit_state import Unit
from zeroshard.stages.units import plan_stage3

WHOLE_UNIT = 2**62  # a unit's parameters of one dtype and group form one bucket


@dataclass
class Stage3Parts:
    trainable: list[FlatBucket]  # unit buckets first, then persistent buckets
    masters: list[torch.Tensor]  # fp32 master of each trainable bucket's shard
    frozen: list[UnitBucket]  # frozen parameters of units (sharded, never stepped)
    persistent: set[int]  # indices into `trainable` of persistent (whole) buckets
    units: list[Unit]
    external_users: dict[int, list[nn.Module]]
    rule: str = ""  # how the units were chosen


def _full_values(model: nn.Module, params: list[nn.Parameter], comm: Comm, device: torch.device) -> bool:
    """Give `params` their full values; True when all came from `Init` shards (already agreed)."""
    from_init = [materialize(p, comm) for p in params]
    meta = {id(p) for p in params if p.is_meta}
    if meta:
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in meta]
            if not own:
                continue
            if not hasattr(module, "reset_parameters"):
                raise ConfigError(
                    f"cannot materialize '{name}' ({type(module).__name__}) from the meta device: it has no "
                    "reset_parameters(); build the model under zeroshard.Init instead, or give it one.")
            for p in own:  # swapped in place: the Parameter objects (and ties between modules) stay
                real = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                torch.utils.swap_tensors(p, real)
            module.reset_parameters()
    for p in params:  # one unit at a time onto the device: the peak stays one unit
        if p.device != device:
            p.data = p.data.to(device)
    return bool(params) and all(from_init)


def _shard_sizes_estimate(plan, world: int, alignment: int) -> list[int]:
    """Elements of this rank's trainable shards, per unit and for the persistent parameters,
    rounded up to `alignment` (a bucket's padding): for space checks before anything is built."""
    groups = [[p for p in up.params if p.requires_grad] for up in plan.units]
    groups.append([p for p in plan.persistent if p.requires_grad])
    sizes = [-(-sum(p.numel() for p in g) // world) for g in groups if g]
    return [-(-n // alignment) * alignment for n in sizes]


def build_stage3(model: nn.Module, parts: ModelParts, group_of: dict[int, int], settings: Settings,
                 comm: Comm, memory: MemoryLedger, device: torch.device, masters_to=None,
                 pool: BufferPool | None = None) -> Stage3Parts:
    """`pool` reuses the units' full buffers between gathers. `masters_to`, when given, takes
    each fp32 master as soon as its unit is built and returns what to keep in its place
    (`optim.nvme_swap.MasterWriter`: a placeholder, the values in a file); its
    `prepare(sizes)` runs first, on the estimated shard sizes."""
    dtype = settings.precision.compute.dtype
    rank, world = comm.rank, comm.world_size
    plan = plan_stage3(model, settings.zero.stage3, settings.zero.stage3.min_unit_params)
    offload = settings.zero.offload_param
    param_tier = make_tier(offload, device, settings.aio, rank, "params") if offload.device is not OffloadDevice.NONE \
        else None
    param_files = None
    if param_tier is not None and param_tier.name == "nvme":  # space checked before any shard is written
        need = sum(p.numel() * dtype.itemsize for up in plan.units for p in up.params) // world
        need += 4096 * 2 * len(plan.units)
        param_tier.prepare(need, comm.topology.local_world_size, memory)
        param_files = (param_tier.folder, need)
    if masters_to is not None:  # and the masters' (with the parameters' when on the same disk)
        masters_to.prepare(_shard_sizes_estimate(plan, world, alignment_for(4)), param_files)
    keep = (lambda ms: ms) if masters_to is None else (lambda ms: [m if m is None else masters_to(m) for m in ms])
    trainable: list[FlatBucket] = []
    masters: list[torch.Tensor] = []
    frozen: list[UnitBucket] = []
    units: list[Unit] = []
    for i, up in enumerate(plan.units):
        agreed = _full_values(model, up.params, comm, device)
        buckets: list[UnitBucket] = []
        for kind, params in (("t", [p for p in up.params if p.requires_grad]),
                             ("f", [p for p in up.params if not p.requires_grad])):
            groups = group_of if kind == "t" else {}  # frozen parameters are in no optimizer group
            for lay in plan_layouts(params, parts.names, groups, [dtype] * len(params), WHOLE_UNIT, world):
                buckets.append(UnitBucket(lay, [params[s.index] for s in lay.slots], rank, memory,
                                          name=up.name, key=f"unit{i}.{kind}{lay.index}", pool=pool))
        if not agreed:
            broadcast_model(model, buckets, comm, loose=False)
        train = [b for b in buckets if b.params[0].requires_grad]
        masters += keep(take_masters_and_cast(train, dtype))
        trainable += train
        for b in buckets:
            b.to_dtype(dtype)
            b.partition()
            if param_tier is not None:
                b.move_shard(param_tier)
            if not b.params[0].requires_grad:
                frozen.append(b)
        for p in up.params:
            forget(p)
        units.append(Unit(i, up.name, up.module, buckets))
    persistent = [p for p in plan.persistent if p.requires_grad]
    first = len(trainable)
    if persistent:
        agreed = _full_values(model, persistent, comm, device)
        whole = [FlatBucket(lay, [persistent[s.index] for s in lay.slots], rank, memory, key=f"persistent{lay.index}")
                 for lay in plan_layouts(persistent, parts.names, group_of, [dtype] * len(persistent),
                                         settings.zero.reduce_bucket_size, world)]
        if not agreed:
            broadcast_model(model, whole, comm, loose=False)
        masters += keep(take_masters_and_cast(whole, dtype))
        trainable += whole
    loose_frozen = [p for p in plan.persistent if not p.requires_grad]
    _full_values(model, loose_frozen, comm, device)
    in_buckets = {id(p) for b in trainable + frozen for p in b.params}
    _place_rest(model, in_buckets, comm, device)
    return Stage3Parts(trainable, masters, frozen, set(range(first, len(trainable))), units,
                       {i: up.external_users for i, up in enumerate(plan.units)}, plan.rule)


def _place_rest(model: nn.Module, in_buckets: set[int], comm: Comm, device: torch.device) -> None:
    """Parameters outside buckets and buffers: onto the device, equal to rank 0's."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if id(t) in in_buckets:
            continue
        if t.is_meta:
            raise ConfigError(f"'{name}' is still on the meta device; materialize buffers before initialize() "
                              "(zeroshard materializes parameters only, through reset_parameters())")
        if t.device != device:
            t.data = t.data.to(device)
        if comm.world_size > 1:
            comm.broadcast(t.data, 0, what=f"initial value of {name}").wait()


def stage3_collectives(comm: Comm, settings: Settings) -> Stage3Collectives:
    """ZeRO++'s parameter gathers: qwZ (int8) forward, and backward too unless hpZ serves it
    from the node; quantized_nontrainable_weights alone quantizes the frozen buckets' gathers."""
    zpp = settings.zero.zeropp
    plain = Stage3Collectives.plain(comm)
    hierarchy = None
    if zpp.hpz_partition_size > 1:  # checked at any world size: the size must divide the ranks per node
        hierarchy = comm.topology.hierarchy(zpp.hpz_partition_size, comm.timeout_s)
    if comm.world_size == 1 or not (zpp.quantized_weights or zpp.quantized_nontrainable_weights
                                    or zpp.hpz_partition_size > 1):
        return plain
    hpz = comm.on(hierarchy.hpz) if hierarchy is not None else None
    quant = QuantizedAllGather(comm)
    train = quant if zpp.quantized_weights else comm
    frozen = quant if zpp.quantized_weights or zpp.quantized_nontrainable_weights else comm
    return Stage3Collectives(forward=train, backward=train, forward_frozen=frozen, backward_frozen=frozen, hpz=hpz,
                             exact=comm)
