"""Choose the gradient strategy for a ZeRO stage."""

from __future__ import annotations

from zeroshard.comm import Comm
from zeroshard.partition import FlatBucket, MemoryLedger
from zeroshard.policies import NotSupportedYetError, Settings, Stage
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
                    memory: MemoryLedger) -> BucketedGradients:
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
        return PartitionedGradients(buckets, comm, memory, contiguous=zero.contiguous_gradients,
                                    use_all_reduce=not zero.reduce_scatter,
                                    max_in_flight=0 if zero.stage == Stage.PARAMETERS else MAX_IN_FLIGHT, **common)
    raise NotSupportedYetError(f"zero_optimization.stage = {int(zero.stage)}: not supported")
