"""`deepspeed.runtime.lr_schedules`: DeepSpeed's schedule names and zeroshard's schedules.

`VALID_LR_SCHEDULES` is DeepSpeed's list of names (Accelerate and Trainer test a
scheduler's type name against it). The five schedules are zeroshard's
(zeroshard.optim.schedulers: DeepSpeed's formulas and parameters as torch LR schedulers).
"""

from zeroshard.optim.schedulers import LRRangeTest, OneCycle, WarmupCosineLR, WarmupDecayLR, WarmupLR

__all__ = ["LR_RANGE_TEST", "LRRangeTest", "ONE_CYCLE", "OneCycle", "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR",
           "WARMUP_DECAY_LR", "WARMUP_LR", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR"]

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]
