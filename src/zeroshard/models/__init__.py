"""Test models and synthetic data: what the tests, benchmarks and CLI train."""

from zeroshard.models.data import batch_iterator, global_batch, synthetic_tokens
from zeroshard.models.gpt import GPT, GPT_PRESETS, Block, GPTConfig, build_gpt, num_parameters
from zeroshard.models.mlp import FrozenMLP

__all__ = [
    "GPT", "GPT_PRESETS", "Block", "FrozenMLP", "GPTConfig", "batch_iterator", "build_gpt",
    "global_batch", "num_parameters", "synthetic_tokens",
]
