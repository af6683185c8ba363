"""The GPT presets' shapes (tiny, mini, small, 10m, 50m, 150m): plain numbers, no torch, so the
command line can name and check them before it imports torch. The model is in gpt.py."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GPTConfig", "GPT_PRESETS", "model_choices"]


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int  # longest sequence the position embedding covers
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd={self.n_embd} is not a multiple of n_head={self.n_head}")


GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32),
    "mini": GPTConfig(vocab_size=256, block_size=64, n_layer=4, n_head=4, n_embd=128),
    "small": GPTConfig(vocab_size=256, block_size=128, n_layer=6, n_head=6, n_embd=384),
    "50m": GPTConfig(vocab_size=256, block_size=256, n_layer=8, n_head=11, n_embd=704),
    "150m": GPTConfig(vocab_size=256, block_size=256, n_layer=12, n_head=16, n_embd=1024),
}
GPT_PRESETS["10m"] = GPT_PRESETS["small"]  # the benchmark sizes are 10m / 50m / 150m


def model_choices() -> str:
    """What `zeroshard train --model` accepts: a preset, or a transformers config."""
    return "|".join(sorted(GPT_PRESETS)) + "|hf:PATH/config.json"
