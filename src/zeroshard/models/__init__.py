"""Test models and synthetic data: what the tests, benchmarks and CLI train.

Names are imported on first use (PEP 562): `zeroshard.models.presets` has no torch."""

from __future__ import annotations

import importlib

_HOMES = {
    "batch_iterator": "data", "global_batch": "data", "synthetic_tokens": "data",
    "GPT": "gpt", "Block": "gpt", "build_gpt": "gpt", "num_parameters": "gpt",
    "GPT_PRESETS": "presets", "GPTConfig": "presets", "FrozenMLP": "mlp",
}

__all__ = [
    "GPT", "GPT_PRESETS", "Block", "FrozenMLP", "GPTConfig", "batch_iterator", "build_gpt",
    "global_batch", "num_parameters", "synthetic_tokens",
]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zeroshard.models' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"zeroshard.models.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
