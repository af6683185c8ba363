"""`deepspeed.ops`: `adam.DeepSpeedCPUAdam` and `adam.FusedAdam` over torch's Adam kernels."""

from zeroshard.deepspeed.ops import adam

__all__ = ["adam"]
