"""Frozen typed settings, enums and errors. Imports nothing internal."""

from zeroshard.policies.errors import (
    CheckpointError, CommError, CommTimeoutError, ConfigError, NotSupportedYetError, NvmeError, NvmeSpaceError,
    ZeroShardError,
)
from zeroshard.policies.onebit import ONEBIT_KINDS, ONEBIT_SHARDED, onebit_kwargs, onebit_notes
from zeroshard.policies.settings import (
    HIDDEN_SIZE_AUTO, MONITOR_LIBRARIES, ActivationOffloadPolicy, AioPolicy, BatchPolicy, CommsLoggerPolicy, GradientReducePolicy,
    LossScalePolicy, OffloadDevice, OffloadPolicy, OptimizerSpec, Precision, PrecisionPolicy, RuntimePolicy,
    SchedulerSpec, Settings, Stage, Stage3Policy, ZeroPlusPlusPolicy, ZeroPolicy,
)

__all__ = [
    "HIDDEN_SIZE_AUTO", "MONITOR_LIBRARIES", "ActivationOffloadPolicy", "AioPolicy", "NvmeError", "NvmeSpaceError",
    "BatchPolicy", "CheckpointError", "CommError", "CommTimeoutError", "CommsLoggerPolicy",
    "ConfigError", "GradientReducePolicy", "LossScalePolicy", "NotSupportedYetError", "OffloadDevice",
    "OffloadPolicy",
    "OptimizerSpec", "Precision", "PrecisionPolicy", "RuntimePolicy", "SchedulerSpec", "Settings",
    "Stage", "Stage3Policy", "ZeroPlusPlusPolicy", "ZeroPolicy", "ZeroShardError",
]
