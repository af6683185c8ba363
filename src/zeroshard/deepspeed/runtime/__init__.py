"""`deepspeed.runtime`: the parts scripts and libraries import (engine, lr_schedules, zero)."""

from zeroshard.deepspeed.runtime import engine, lr_schedules, zero

__all__ = ["engine", "lr_schedules", "zero"]
