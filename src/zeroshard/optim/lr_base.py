"""What zeroshard's DeepSpeed schedules share: DeepSpeed's step counter on a torch LRScheduler,
and per-group values.

Step indexing. DeepSpeed keeps `last_batch_iteration`, -1 at construction, and sets the lr for
that iteration at once; each `step()` after an optimizer step increments it. torch keeps
`last_epoch`, 0 after construction. So `last_batch_iteration == last_epoch - 1`, and the lr the
k-th optimizer step uses (k = 0, 1, ...) is DeepSpeed's lr at iteration k - 1.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.optim.lr_scheduler import LRScheduler

from zeroshard.policies import ConfigError


def per_group(optimizer: torch.optim.Optimizer, value: float | Sequence[float], name: str) -> list[float]:
    """A scalar for every group, or one value per group as DeepSpeed allows."""
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ConfigError(f"{name}: expected {n} values (one per param group), got {list(value)}")
        return [float(v) for v in value]
    return [float(value)] * n


class DeepSpeedSchedule(LRScheduler):
    """A torch LRScheduler counting steps as DeepSpeed does.

    `last_batch_iteration` (DeepSpeed's resume argument): -1 starts the schedule and sets its
    first values at once; k >= 0 continues from iteration k and, as in DeepSpeed, leaves the
    optimizer's lr (and betas) as they are until the next `step()`."""

    def __init__(self, optimizer: torch.optim.Optimizer, last_batch_iteration: int = -1) -> None:
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, int) \
                or last_batch_iteration < -1:
            raise ConfigError(f"last_batch_iteration must be an integer >= -1, got {last_batch_iteration!r}")
        kept = [{k: g[k] for k in ("lr", "betas") if k in g} for g in optimizer.param_groups]
        super().__init__(optimizer)
        if last_batch_iteration >= 0:
            self.last_epoch = last_batch_iteration + 1
            for group, values in zip(optimizer.param_groups, kept):
                group.update(values)
            self._last_lr = [group["lr"] for group in optimizer.param_groups]

    @property
    def last_batch_iteration(self) -> int:
        """DeepSpeed's step counter: -1 before the first `step()`."""
        return self.last_epoch - 1
