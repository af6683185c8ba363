"""Stage strategies: how gradients (and, at stage 3, parameters) are stored and reduced."""

from zeroshard.stages.gradients import (
    AllReducedGradients,
    BucketedGradients,
    PartitionedGradients,
    ScatteredGradients,
)
from zeroshard.stages.params import PartitionedParams, ParamPublisher, ReplicatedParams
from zeroshard.stages.strategy import build_gradients, shard_count_for

__all__ = ["AllReducedGradients", "BucketedGradients", "ParamPublisher", "PartitionedGradients", "PartitionedParams", "ReplicatedParams",
           "ScatteredGradients", "build_gradients", "shard_count_for"]
