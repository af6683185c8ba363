"""DeepSpeed's warmup schedules (`scheduler` section) as torch LR schedulers.

Same formulas as DeepSpeed's `deepspeed/runtime/lr_schedules.py`, so a config
moved from DeepSpeed trains with the same learning rate at every step, but built
on `torch.optim.lr_scheduler.LRScheduler` so torch's own tooling (get_last_lr,
SequentialLR, checkpointing of plain state dicts) works.

Step indexing (optim/lr_base.py): `last_batch_iteration == last_epoch - 1`, and the lr the
k-th optimizer step uses is DeepSpeed's lr at iteration k - 1 (at -1: the min lr, or 0 for
WarmupCosineLR). With log warmup the lr at iterations -1 and 0 are both the min lr.
OneCycle and LRRangeTest are in optim/cycle_schedules.py.

Defaults follow current DeepSpeed: WarmupLR's `warmup_max_lr` defaults to the
optimizer's lr (of the first group), WarmupDecayLR's to 0.001.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.optim.cycle_schedules import LRRangeTest, OneCycle
from zeroshard.optim.lr_base import DeepSpeedSchedule, per_group
from zeroshard.policies import ConfigError, SchedulerSpec

__all__ = ["LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "build_scheduler"]

_WARMUP_TYPES = ("log", "linear")


def _check_warmup(warmup_num_steps: Any, warmup_type: str) -> int:
    if not isinstance(warmup_num_steps, int) or isinstance(warmup_num_steps, bool) or warmup_num_steps <= 0:
        raise ConfigError(f"warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in _WARMUP_TYPES:
        raise ConfigError(f"warmup_type must be one of {list(_WARMUP_TYPES)}, got {warmup_type!r}")
    # DeepSpeed clamps to 2 so that log(warmup_num_steps) is never 0.
    return max(2, warmup_num_steps)


def _warmup_fraction(it: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Progress through warmup at iteration `it` < warmup_num_steps: 0 at it = 0."""
    if warmup_type == "log":
        return math.log(it + 1) / math.log(warmup_num_steps)
    return it / warmup_num_steps


class WarmupLR(DeepSpeedSchedule):
    """From `warmup_min_lr` to `warmup_max_lr` over `warmup_num_steps`, then constant."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: float | Sequence[float] = 0.0,
                 warmup_max_lr: float | Sequence[float] | None = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        if warmup_max_lr is None:
            warmup_max_lr = float(optimizer.param_groups[0]["lr"])
        self.min_lrs = per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def get_lr(self) -> list[float]:
        it = self.last_batch_iteration
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at `total_num_steps`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: float | Sequence[float] = 0.0, warmup_max_lr: float | Sequence[float] = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type, last_batch_iteration)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        return max(0.0, (self.total_num_steps - it) / decay_steps)


class WarmupCosineLR(DeepSpeedSchedule):
    """Ratio of the optimizer's lr: warmup from `warmup_min_ratio` to 1, cosine down to `cos_min_ratio`."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = "log",
                 last_batch_iteration: int = -1) -> None:
        self.total_num_steps = int(total_num_steps)
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = _check_warmup(warmup_num_steps, warmup_type)
        self.warmup_type = warmup_type
        super().__init__(optimizer, last_batch_iteration)

    def lr_ratio(self, it: int) -> float:
        if it < 0:
            return 0.0  # DeepSpeed's value before the first step, not warmup_min_ratio
        if it < self.warmup_num_steps:
            frac = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        decay_steps = max(1, self.total_num_steps - self.warmup_num_steps)
        # Clamped: after total_num_steps the ratio stays at cos_min_ratio.
        progress = min(1.0, (it - self.warmup_num_steps + 1) / decay_steps)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> list[float]:
        ratio = self.lr_ratio(self.last_batch_iteration)
        return [float(base) * ratio for base in self.base_lrs]


_SCHEDULERS: dict[str, type[LRScheduler]] = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR,
                                              "WarmupCosineLR": WarmupCosineLR, "OneCycle": OneCycle,
                                              "LRRangeTest": LRRangeTest}


def build_scheduler(spec: SchedulerSpec, optimizer: torch.optim.Optimizer) -> LRScheduler:
    """The scheduler `spec` names, over `optimizer`; ConfigError names any bad type or key."""
    if spec.type not in _SCHEDULERS:
        raise ConfigError(f"unknown scheduler type {spec.type!r}; valid types: {sorted(_SCHEDULERS)}")
    params = dict(spec.params)
    keys = dict(inspect.signature(_SCHEDULERS[spec.type]).parameters)  # the constructor's, past the optimizer
    keys.pop("optimizer")
    unknown = sorted(set(params) - set(keys))
    if unknown:
        raise ConfigError(f"scheduler {spec.type!r}: unknown parameter(s) {unknown}; valid keys: {sorted(keys)}")
    missing = [k for k, p in keys.items() if p.default is p.empty and k not in params]
    if missing:
        raise ConfigError(f"scheduler {spec.type!r}: '{missing[0]}' is required")
    return _SCHEDULERS[spec.type](optimizer, **params)


def make_scheduler(arg: Any, user_optimizer: Any, inner: torch.optim.Optimizer,
                   spec: SchedulerSpec | None) -> Any:
    """The scheduler of a run over the shard optimizer `inner`: the config's (`spec`), a callable
    `optimizer -> scheduler`, or a scheduler the user built over `user_optimizer`, re-pointed at
    `inner` (same groups, same order, so its base_lrs hold)."""
    if arg is None:
        return build_scheduler(spec, inner) if spec is not None else None
    if not isinstance(arg, LRScheduler):
        return arg(inner)
    if arg.optimizer is not user_optimizer:
        raise ConfigError("lr_scheduler must be built over the optimizer given to initialize(), "
                          "or be a callable optimizer -> scheduler")
    # torch's schedulers check that the optimizer steps before them, through a mark every
    # scheduler puts on the optimizer it is built over: a scheduler that changes nothing
    # (a constant factor of 1) built over `inner` gives it that mark, as the user's had
    had_initial = ["initial_lr" in g for g in inner.param_groups]
    torch.optim.lr_scheduler.ConstantLR(inner, factor=1.0, total_iters=0)
    for group, had in zip(inner.param_groups, had_initial):
        if not had:
            del group["initial_lr"]
    arg.optimizer = inner
    for group, lr in zip(inner.param_groups, arg.get_last_lr()):
        group["lr"] = lr
    return arg
