"""Choose the gradient strategy for a ZeRO stage."""

from __future__ import annotations

from zeroshard.comm import Comm, QuantizedHierarchicalReduceScatter
from zeroshard.partition import FlatBucket, MemoryLedger
from zeroshard.policies import ConfigError, NotSupportedYetError, OffloadDevice, Settings, Stage
from zeroshard.stages.gradients import (
    MAX_IN_FLIGHT,
    AllReducedGradients,
    BucketedGradients,
    PartitionedGradients,
    ScatteredGradients,
)


def shard_count_for(stage: Stage, world_size: int) -> int:
    """How many ways optimizer state is split: stage 0 keeps it whole on every rank."""
    return 1 if stage == Stage.DATA_PARALLEL else world_size


def build_gradients(settings: Settings, buckets: list[FlatBucket], comm: Comm,
                    memory: MemoryLedger, pool=None) -> BucketedGradients:
    zero = settings.zero
    common = dict(
        reduce_dtype=settings.precision.reduce.dtype,
        overlap=zero.overlap_comm,
        ignore_unused=zero.ignore_unused_parameters,
    )
    if zero.stage == Stage.DATA_PARALLEL:
        return AllReducedGradients(buckets, comm, memory, **common)
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
                                    pool=pool, max_in_flight=MAX_IN_FLIGHT, **common)
    raise NotSupportedYetError(f"zero_optimization.stage = {int(zero.stage)}: not supported")


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
    if settings.zero.offload_param.device == OffloadDevice.NVME:
        forbid.append("offload_param nvme reads parameter shards ahead along the recorded order, "
                      "which an update during backward would overtake")
    if not optimizer_can:
        forbid.append("the NVMe tier pipelines the sub-groups in order after backward")
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
