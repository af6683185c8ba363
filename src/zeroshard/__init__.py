"""zeroshard: ZeRO stages for PyTorch, small, measured, DeepSpeed-config compatible.

The public names are imported on first use (PEP 562), so `import zeroshard.cli...` and
`zeroshard --help` do not pay for torch."""

from __future__ import annotations

import importlib

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


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zeroshard' has no attribute {name!r}")
    module, attr = home if isinstance(home, tuple) else (home, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
