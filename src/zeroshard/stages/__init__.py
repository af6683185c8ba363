"""Stage strategies: how gradients (and, at stage 3, parameters) are stored and reduced;
`build.assemble` chooses them by stage."""

from zeroshard.stages.gradients import (
    AllReducedGradients,
    BucketedGradients,
    ScatteredGradients,
)
from zeroshard.stages.params import ParamPublisher, ParamStrategy, PartitionedParams, ReplicatedParams
from zeroshard.stages.partitioned_gradients import PartitionedGradients

__all__ = ["AllReducedGradients", "BucketedGradients", "ParamPublisher", "ParamStrategy", "PartitionedGradients",
           "PartitionedParams", "ReplicatedParams", "ScatteredGradients"]
