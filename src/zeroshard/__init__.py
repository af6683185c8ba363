"""zeroshard: ZeRO stages for PyTorch, small, measured, DeepSpeed-config compatible.

The public names are imported on first use (PEP 562), so `import zeroshard.cli...` and
`zeroshard --help` do not pay for torch."""

from __future__ import annotations

from zeroshard.lazy_exports import lazy_exports

__version__ = "0.1.0"

_HOMES = {
    "Engine": "zeroshard.api", "GatheredParameters": "zeroshard.api", "Init": "zeroshard.api",
    "initialize": "zeroshard.api",
    "checkpoint_activations": ("zeroshard.offload.activations", "checkpoint"),
    "CheckpointError": "zeroshard.policies", "CommError": "zeroshard.policies",
    "CommTimeoutError": "zeroshard.policies", "ConfigError": "zeroshard.policies",
    "NotSupportedYetError": "zeroshard.policies", "ZeroShardError": "zeroshard.policies",
}

__all__ = [
    "CheckpointError", "CommError", "CommTimeoutError", "ConfigError", "Engine", "GatheredParameters", "Init", "checkpoint_activations",
    "NotSupportedYetError", "ZeroShardError", "__version__", "initialize",
]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES)
