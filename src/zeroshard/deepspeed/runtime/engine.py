"""`deepspeed.runtime.engine.DeepSpeedEngine`: the class `deepspeed.initialize` returns first."""

from zeroshard.deepspeed.engine import DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
