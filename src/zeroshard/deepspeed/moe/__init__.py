"""`deepspeed.moe`: zeroshard has no mixture-of-experts layer (`moe.layer.MoE` says so when built)."""

from zeroshard.deepspeed.moe import layer

__all__ = ["layer"]
