"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedule names and zeroshard's schedules.

`VALID_LR_SCHEDULES` is DeepSpeed's list of names (Accelerate and Trainer test a
scheduler's type name against it). WarmupLR, WarmupDecayLR and WarmupCosineLR are
zeroshard's (zeroshard.optim.schedulers: DeepSpeed's formulas as torch LR schedulers);
OneCycle and LRRangeTest are named but not built: constructing one says so.
"""

from zeroshard.deepspeed.shadow import not_served
from zeroshard.optim.schedulers import WarmupCosineLR, WarmupDecayLR, WarmupLR
from zeroshard.policies import NotSupportedYetError

__all__ = ["LR_RANGE_TEST", "LRRangeTest", "ONE_CYCLE", "OneCycle", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR",
           "WARMUP_DECAY_LR", "WARMUP_LR", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]


class _NotBuilt:
    def __init__(self, *args, **kwargs) -> None:
        raise NotSupportedYetError(not_served(f"deepspeed.runtime.lr_schedules.{type(self).__name__}") +
                                   "; zeroshard builds WarmupLR, WarmupDecayLR and WarmupCosineLR")


class OneCycle(_NotBuilt):
    pass


class LRRangeTest(_NotBuilt):
    pass
