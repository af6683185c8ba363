"""`deepspeed.runtime`: the parts scripts and libraries import (engine, lr_schedules, utils, zero;
fp16.onebit's 1-bit optimizers)."""

from zeroshard.deepspeed.runtime import engine, lr_schedules, utils, zero

__all__ = ["engine", "lr_schedules", "utils", "zero"]
