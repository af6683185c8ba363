"""`deepspeed.runtime`: the parts scripts and libraries import (engine, lr_schedules, utils, zero)."""

from zeroshard.deepspeed.runtime import engine, lr_schedules, utils, zero

__all__ = ["engine", "lr_schedules", "utils", "zero"]
