"""Test models and synthetic data: what the tests, benchmarks and CLI train.

Names are imported on first use (PEP 562): `zeroshard.models.presets` has no torch."""

from __future__ import annotations

from zeroshard.lazy_exports import lazy_exports

_HOMES = {
    "batch_iterator": "zeroshard.models.data", "global_batch": "zeroshard.models.data", "synthetic_tokens": "zeroshard.models.data",
    "GPT": "zeroshard.models.gpt", "Block": "zeroshard.models.gpt", "build_gpt": "zeroshard.models.gpt", "num_parameters": "zeroshard.models.gpt",
    "GPT_PRESETS": "zeroshard.models.presets", "GPTConfig": "zeroshard.models.presets", "FrozenMLP": "zeroshard.models.mlp",
}

__all__ = sorted(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES)
