"""`deepspeed.moe`: zeroshard has no mixture-of-experts layer (`moe.layer.MoE` says so when built);
`moe.utils` serves the helpers scripts call on any model (groups unchanged without MoE layers)."""

from zeroshard.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
