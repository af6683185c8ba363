"""`assemble`: the one place that decides by ZeRO stage.

From a model and its settings it builds everything the training loop drives: the parameter
buckets and fp32 masters, the gradient strategy (stages 0-2 bucketed, stage 3 per unit),
the parameter strategy (`ReplicatedParams` or `PartitionedParams`), stage 3's units, the
tiers of the optimizer states and parameter shards (NVMe space checks and self-tests run
here, before any shard is written), the sharded optimizer, and the start-up lines saying
what was chosen. The Engine receives the result whole (`Assembled`) and only runs the loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from zeroshard.comm import Comm, QuantizedHierarchicalReduceScatter
from zeroshard.config.model_defaults import choose_for_model
from zeroshard.offload import Tier, host_step_threads, optimizer_offload_tier, optimizer_tiers
from zeroshard.optim.muon_groups import tag_for_muon
from zeroshard.optim.sharded import ShardedOptimizer
from zeroshard.optim.template import OptimizerArg, OptimizerPlan, plan_optimizer
from zeroshard.partition import FlatBucket, MemoryLedger
from zeroshard.partition.buffer_pool import BufferPool
from zeroshard.partition.layout import shard_count_for
from zeroshard.partition.malloc_trim import HeapTrim
from zeroshard.policies import ConfigError, NotSupportedYetError, OffloadDevice, Settings, Stage
from zeroshard.stages.assembly import (
    ModelParts,
    broadcast_model,
    build_buckets,
    split_parameters,
    take_masters_and_cast,
)
from zeroshard.stages.accumulated_gradients import AccumulatedScatteredGradients
from zeroshard.stages.gradients import (
    AllReducedGradients,
    BucketedGradients,
    ScatteredGradients,
)
from zeroshard.stages.param_status import ParamStatus, label_bucket, label_whole
from zeroshard.stages.params import ParamPublisher, ParamStrategy, PartitionedParams, ReplicatedParams
from zeroshard.stages.partitioned_gradients import MAX_IN_FLIGHT, PartitionedGradients
from zeroshard.stages.stage3 import Stage3Runtime
from zeroshard.stages.unit_state import Unit
from zeroshard.stages.stage3_assembly import build_stage3, stage3_collectives


@dataclass(frozen=True)
class Assembled:
    settings: Settings  # as given, with the bucket sizes the config left out chosen for this model
    parts: ModelParts
    plan: OptimizerPlan
    buckets: list[FlatBucket]  # trainable: stages 0-2 all, stage 3 unit buckets then persistent ones
    frozen_buckets: list[FlatBucket]  # stage 3: frozen parameters of units, sharded, never stepped
    grads: BucketedGradients
    params: ParamStrategy
    optimizer: ShardedOptimizer
    units: list[Unit]  # stage 3's gather units (empty below stage 3)
    unit_rule: str  # how the units were chosen
    param_tiers: list[Tier]  # tiers holding stage-3 parameter shards away from the device
    step_early: bool  # optimizer sub-groups step during backward
    step_mode: str  # the start-up line saying when the optimizer steps, and why
    host_threads: str  # the host step's threads ("" when no optimizer state is on the host)
    heap_trim: HeapTrim
    nvme_lines: list[str]  # NVMe space checks, self-tests and knobs
    inference_only: bool = False  # built without an optimizer: every parameter frozen


def assemble(module: nn.Module, settings: Settings, comm: Comm, memory: MemoryLedger, pool: BufferPool,
             optimizer: OptimizerArg = None) -> Assembled:
    """Put `module` into buckets (stage 3: units, one at a time) and build the strategies and the
    sharded optimizer over them. Collective: every rank calls it with the same model."""
    topology = comm.topology
    stage3 = settings.zero.stage == Stage.PARAMETERS
    inference_only = optimizer is None and settings.optimizer is None
    if inference_only:  # a reference or reward model: no gradients, no masters, no optimizer states
        for p in module.parameters():
            p.requires_grad_(False)
    if not stage3:
        module.to(topology.device)  # stage 3 moves one unit at a time
    parts = split_parameters(module)
    # bucket sizes the config left out are chosen for this model (and printed)
    settings = choose_for_model(settings, sum(p.numel() for p in parts.trainable))
    zero, dtype = settings.zero, settings.precision.compute.dtype
    if optimizer is None and settings.optimizer is not None and settings.optimizer.type == "muon":
        tag_for_muon(module, overwrite=False)  # DeepSpeed's rule where the user set no use_muon
    plan = plan_optimizer(optimizer, settings.optimizer, parts.trainable, topology.device)
    offload = optimizer_offload_tier(zero.offload_optimizer, topology.device, settings.aio, topology.rank)
    writer = _early_masters(offload, settings, plan, topology.local_world_size)
    if stage3:
        s3 = build_stage3(module, parts, plan.group_of, settings, comm, memory, topology.device, writer, pool)
        buckets, masters, frozen, units, unit_rule = s3.trainable, s3.masters, s3.frozen, s3.units, s3.rule
    else:
        shards = shard_count_for(zero.stage, topology.world_size)
        buckets = build_buckets(parts, plan.group_of, zero.reduce_bucket_size, shards,
                                topology.rank if shards > 1 else 0, memory, dtype)
        broadcast_model(module, buckets, comm)
        masters = take_masters_and_cast(buckets, dtype)
        frozen, units, unit_rule = [], [], ""
    if dtype != torch.float32:
        module.to(dtype)  # parameters outside buckets and buffers
    grads = build_gradients(settings, buckets, comm, memory, pool)
    publisher = ParamPublisher(buckets, comm, zero.allgather_bucket_size)
    if stage3:
        runtime = Stage3Runtime(units, zero.stage3, s3.external_users, stage3_collectives(comm, settings),
                                module)
        for b in sorted(s3.persistent):  # units' parameters are labelled by their Unit
            label_bucket(buckets[b], ParamStatus.AVAILABLE, persist=True)
        in_units = {id(p) for bucket in frozen for p in bucket.params}
        label_whole(p for p in parts.frozen if id(p) not in in_units)  # frozen and kept whole
        params: ParamStrategy = PartitionedParams(runtime, publisher, s3.persistent)
    else:
        params = ReplicatedParams(publisher if grads.publishes_params else None)
    sharded = {id(p) for bucket in frozen for p in bucket.params}  # counted by their buckets
    memory.hold("params", "frozen", sum(p.nbytes for p in parts.frozen if id(p) not in sharded))
    # a sub-group's 16-bit gradients are upcast to fp32 together: at most one bucket's worth
    sub_group = min(zero.sub_group_size, zero.reduce_bucket_size)
    sizes = [b.shard().numel() for b in buckets]
    tiers = optimizer_tiers(zero.offload_optimizer, sizes, topology.device, offload)
    on_host = any(t.name in ("host", "nvme") for t in tiers)
    host_threads = host_step_threads(topology.local_world_size)[1] if on_host else ""
    param_tiers = list({id(t): t for u in units for b in u.buckets if (t := b.home_tier) is not None}.values())
    nvme_lines = [line for t in param_tiers for line in getattr(t, "startup_lines", [])]
    nvme_lines += _prepare_nvme(tiers, sizes, writer, settings, plan, topology.local_world_size)
    sharded_optimizer = ShardedOptimizer(buckets, masters, plan.build, plan.group_options, memory, sub_group, tiers,
                                         zero.offload_optimizer.buffer_count, comm=comm)
    hand_over_reduction(sharded_optimizer.optimizer, grads, comm)
    step_early, step_mode = step_during_backward(settings, sharded_optimizer.can_step_early)
    host_in_use = topology.device.type == "cpu" or on_host or zero.offload_param.device is not OffloadDevice.NONE
    return Assembled(settings, parts, plan, buckets, frozen, grads, params, sharded_optimizer, units, unit_rule,
                     param_tiers, step_early, step_mode, host_threads,
                     HeapTrim(settings.runtime.trim_host_memory, host_in_use), nvme_lines, inference_only)


def _early_masters(offload, settings: Settings, plan: OptimizerPlan, sharers: int):
    """Stage 3 in 16 bits with every master in NVMe files: the build writes each unit's fp32
    masters to the file as it goes (`MasterWriter`) instead of holding them all until the
    optimizer is made. None otherwise (fp32 steps the shards themselves; a `ratio` below 1
    decides per shard once every size is known)."""
    zero = settings.zero
    if (offload is None or offload.name != "nvme" or zero.stage != Stage.PARAMETERS
            or zero.offload_optimizer.ratio < 1.0 or settings.precision.compute.dtype == torch.float32):
        return None
    from zeroshard.optim.nvme_swap import MasterWriter

    return MasterWriter(offload, plan.build, plan.group_options, sharers, zero.offload_optimizer)


def _prepare_nvme(tiers: list[Tier], sizes: list[int], writer, settings: Settings, plan: OptimizerPlan,
                  sharers: int) -> list[str]:
    """offload_optimizer: nvme: space check and I/O self-test before any shard is written
    (done by the build already when it wrote the masters as it went)."""
    nvme = [t for t in tiers if t.name == "nvme"]
    if not nvme:
        return []
    if writer is not None:
        return writer.lines + ["nvme optimizer masters: written to the file unit by unit as the model was built"]
    from zeroshard.optim.nvme_swap import prepare_disk

    return prepare_disk(nvme[0], [n for n, t in zip(sizes, tiers) if t.name == "nvme"], plan.build,
                        plan.group_options, sharers, settings.zero.offload_optimizer)


def build_gradients(settings: Settings, buckets: list[FlatBucket], comm: Comm,
                    memory: MemoryLedger, pool: BufferPool | None = None) -> BucketedGradients:
    """The gradient strategy of the stage."""
    zero = settings.zero
    common = dict(reduce_dtype=settings.precision.reduce.dtype, overlap=zero.overlap_comm,
                  ignore_unused=zero.ignore_unused_parameters, scaling=settings.gradient_reduce)
    if zero.stage == Stage.DATA_PARALLEL:
        return AllReducedGradients(buckets, comm, memory, **common)
    accum = settings.precision.grad_accum.dtype if settings.precision.grad_accum else None
    if zero.stage == Stage.OPTIMIZER_STATES and accum is not None:
        return AccumulatedScatteredGradients(buckets, comm, memory, use_all_reduce=not zero.reduce_scatter,
                                             accum_dtype=accum, **common)
    if zero.stage == Stage.OPTIMIZER_STATES:
        return ScatteredGradients(buckets, comm, memory, use_all_reduce=not zero.reduce_scatter, **common)
    if zero.stage in (Stage.GRADIENTS, Stage.PARAMETERS):
        reducer = None
        if zero.stage == Stage.PARAMETERS and zero.zeropp.quantized_gradients and comm.world_size > 1:
            # qgZ: the reduce-scatter becomes a 2-hop quantized all-to-all (it replaces the
            # all-reduce of reduce_scatter=false as well: it is the reduction)
            hierarchy = comm.topology.hierarchy(zero.zeropp.hpz_partition_size, comm.timeout_s)
            reducer = QuantizedHierarchicalReduceScatter(comm, hierarchy)
        return PartitionedGradients(buckets, comm, memory, contiguous=zero.contiguous_gradients,
                                    use_all_reduce=not zero.reduce_scatter and reducer is None, reducer=reducer,
                                    pool=pool, max_in_flight=MAX_IN_FLIGHT, accum_dtype=accum, **common)
    raise NotSupportedYetError(f"zero_optimization.stage = {int(zero.stage)}: not supported")


def hand_over_reduction(optimizer, grads, comm: Comm) -> None:
    """An optimizer that exchanges values itself (the 1-bit family: `reduces_gradients`) gets the
    world group and decides, step by step, whether stage 0 all-reduces the gradients."""
    if not hasattr(optimizer, "reduces_gradients"):
        return
    if not isinstance(grads, AllReducedGradients):
        raise ConfigError(optimizer.sharded_refusal)
    optimizer.connect(comm)
    grads.hand_reduction_to(optimizer)


def step_during_backward(settings: Settings, optimizer_can: bool) -> tuple[bool, str]:
    """Whether each optimizer sub-group steps as soon as its gradient shard is final (during
    backward, overlapping the rest of it and its reductions), and the start-up line saying why.
    At stage 3 a unit's shard is updated once its gradients are reduced: backward never reads
    it again (its own gathered copy, or the hpZ secondary, serve the rest of the pass).

    Global clipping needs the norm of every gradient before any step, and an fp16 overflow
    anywhere skips the step everywhere: both wait for the end of backward, as DeepSpeed always
    does. `zeroshard.step_during_backward` true where that cannot be honoured is an error."""
    asked = settings.runtime.step_during_backward
    forbid = []
    if settings.gradient_clipping > 0:
        forbid.append(f"gradient_clipping = {settings.gradient_clipping:g} needs the global norm first")
    if settings.precision.loss_scale is not None:
        forbid.append("fp16 loss scaling must see every gradient for overflow first")
    # offload_param nvme reads shards ahead along the recorded order while backward's updates
    # write them: offload/read_ahead.py waits a read before a write of the same shard and serves
    # reads of a shard being written from the buffer that holds its new values
    if not optimizer_can:
        forbid.append("the optimizer steps its sub-groups in order after backward (NVMe swaps, or Muon's gathers)")
    if asked is False:
        return False, "after backward (zeroshard.step_during_backward = false)"
    if forbid:
        if asked:
            raise ConfigError("zeroshard.step_during_backward = true cannot be honoured: "
                              f"{'; '.join(forbid)}. Remove the key or set it to false.")
        return False, f"after backward ({'; '.join(forbid)})"
    return True, ("during backward: each sub-group as soon as its gradients are reduced, overlapping "
                  "the rest of backward (no clipping, no fp16 overflow check; a non-finite gradient is "
                  "applied, as in DDP, not skipped; zeroshard.step_during_backward = false steps after "
                  "backward and skips such steps)")
