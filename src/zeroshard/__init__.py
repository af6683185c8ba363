"""zeroshard: ZeRO stages for PyTorch, small, measured, DeepSpeed-config compatible."""

from zeroshard.api import Engine, GatheredParameters, Init, initialize
from zeroshard.offload.activations import checkpoint as checkpoint_activations
from zeroshard.policies import (
    CheckpointError,
    CommError,
    CommTimeoutError,
    ConfigError,
    NotSupportedYetError,
    ZeroShardError,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "CommError", "CommTimeoutError", "ConfigError", "Engine", "GatheredParameters", "Init", "checkpoint_activations",
    "NotSupportedYetError", "ZeroShardError", "__version__", "initialize",
]
