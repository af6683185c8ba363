"""DeepSpeed's OneCycle and LRRangeTest schedules (`deepspeed/runtime/lr_schedules.py`, 0.19.8)
as torch LR schedulers, with DeepSpeed's parameters, defaults and formulas.

LRRangeTest: lr = min_lr * (1 + step_rate * interval), interval = (i + 1) / step_size at
DeepSpeed iteration i (floored with `lr_range_test_staircase`).

OneCycle (Smith's 1cycle): over a cycle of `cycle_first_step_size` + `cycle_second_step_size`
iterations the lr rises linearly from `cycle_min_lr` to `cycle_max_lr` and falls back (in
stairs with the stair counts); after the cycle it decays as min_lr / (1 + decay_lr_rate * j /
decay_step_size) at the j-th iteration past it (no decay when either is 0). When the optimizer
has `betas` (Adam, AdamW) and `cycle_momentum` is on, beta1 moves the other way between
`cycle_max_mom` and `cycle_min_mom`, and after the cycle is max_mom * (1 + decay_mom_rate * j /
decay_step_size). As in DeepSpeed, the betas become (momentum, 0.99): the optimizer's beta2 is
replaced by 0.99, and at construction beta1 is `cycle_min_mom` (DeepSpeed's initial value,
before the formula takes over at the first step). An optimizer without betas (SGD) keeps its
momentum, with a warning, as in DeepSpeed.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import torch

from zeroshard.optim.lr_base import DeepSpeedSchedule, per_group
from zeroshard.policies import ConfigError

log = logging.getLogger("zeroshard")

BETA2 = 0.99  # DeepSpeed's OneCycle pins the second beta to this


class LRRangeTest(DeepSpeedSchedule):
    """Leslie Smith's learning-rate range test: the lr grows linearly (or in stairs) from `min_lr`."""

    def __init__(self, optimizer: torch.optim.Optimizer, lr_range_test_min_lr: float | Sequence[float] = 1e-3,
                 lr_range_test_step_size: int = 2000, lr_range_test_step_rate: float = 1.0,
                 lr_range_test_staircase: bool = False, last_batch_iteration: int = -1) -> None:
        if isinstance(lr_range_test_step_size, bool) or not isinstance(lr_range_test_step_size, int) \
                or lr_range_test_step_size <= 0:
            raise ConfigError(f"lr_range_test_step_size must be a positive integer, got {lr_range_test_step_size!r}")
        self.min_lrs = per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size, self.step_rate = lr_range_test_step_size, float(lr_range_test_step_rate)
        self.staircase = bool(lr_range_test_staircase)
        super().__init__(optimizer, last_batch_iteration)

    def get_lr(self) -> list[float]:
        interval = (self.last_batch_iteration + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


class OneCycle(DeepSpeedSchedule):
    """One cycle of lr (and inverse momentum), then optional decay; DeepSpeed's parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: float | Sequence[float],
                 cycle_max_lr: float | Sequence[float], decay_lr_rate: float = 0.0,
                 cycle_first_step_size: float = 2000, cycle_second_step_size: float | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: float = 0, cycle_momentum: bool = True,
                 cycle_min_mom: float | Sequence[float] = 0.8, cycle_max_mom: float | Sequence[float] = 0.9,
                 decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if first <= 0:
            raise ConfigError(f"cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ConfigError(f"cycle_second_step_size must be non-negative, got {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size, self.total_size = first, second, first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = int(cycle_first_stair_count)
        self.second_stair_count = self.first_stair_count if cycle_second_stair_count is None \
            else int(cycle_second_stair_count)
        self.decay_step_size = float(decay_step_size)
        self.min_lrs = per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate, self.decay_mom_rate = float(decay_lr_rate), float(decay_mom_rate)
        no_decay = math.isclose(self.decay_step_size, 0)
        self.skip_lr_decay = no_decay or math.isclose(self.decay_lr_rate, 0)
        self.skip_mom_decay = no_decay or math.isclose(self.decay_mom_rate, 0)
        self.cycle_momentum = bool(cycle_momentum)
        if self.cycle_momentum and "betas" not in optimizer.defaults:
            log.warning("OneCycle: cycle_momentum is disabled because %s has no betas (as in DeepSpeed)",
                        type(optimizer).__name__)
            self.cycle_momentum = False
        self.min_moms = per_group(optimizer, cycle_min_mom, "cycle_min_mom")
        self.max_moms = per_group(optimizer, cycle_max_mom, "cycle_max_mom")
        super().__init__(optimizer, last_batch_iteration)

    def _scale(self, it: int) -> float:
        """Position in the cycle at DeepSpeed iteration `it`: 0 at the bottom, 1 at the top."""
        n = it + 1
        x = 1.0 + n / self.total_size - math.floor(1 + n / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # hold flat across each stair, counted from the integer offset (as DeepSpeed)
            k = n % self.total_size
            pos = k * stairs / self.first_step_size if k <= self.first_step_size \
                else (self.total_size - k) * stairs / self.second_step_size
            scale = math.floor(pos) / stairs
        return scale

    def get_lr(self) -> list[float]:
        it = self.last_batch_iteration
        if it < self.total_size:
            scale = self._scale(it)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * ((it - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def momenta(self) -> list[float] | None:
        """beta1 of each group at the current iteration; None when momentum does not cycle."""
        if not self.cycle_momentum:
            return None
        it = self.last_batch_iteration
        if it < 0:
            return list(self.min_moms)  # DeepSpeed's constructor value
        if it < self.total_size:
            scale = self._scale(it)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((it - self.total_size + 1) / self.decay_step_size)
        return [hi * factor for hi in self.max_moms]

    def step(self, epoch: int | None = None) -> None:
        super().step(epoch)
        moms = self.momenta()
        if moms is not None:
            for group, mom in zip(self.optimizer.param_groups, moms):
                group["betas"] = (mom, BETA2)
