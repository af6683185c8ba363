"""TrainState: the one explicit object that checkpoints, exports and the CLI read.

It names everything a training run consists of besides the user's code: the module, the
settings, the collectives, the parameter buckets (trainable, then frozen sharded ones), the
sharded optimizer (fp32 masters and states), the loss scaler, the LR scheduler and the step
counters. The Engine builds it once and drives it; nobody else reads the Engine's private
attributes. `refresh_params()` republishes the parameters from the masters after a load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.comm import Comm
from zeroshard.optim.sharded import ShardedOptimizer
from zeroshard.partition import FlatBucket
from zeroshard.policies import Settings


@dataclass
class Counters:
    global_steps: int = 0  # optimizer steps taken (skipped ones included)
    micro_steps: int = 0  # backward passes
    skipped_steps: int = 0  # steps skipped for non-finite gradients (fp16)


@dataclass
class TrainState:
    module: nn.Module
    settings: Settings
    comm: Comm
    buckets: list[FlatBucket]  # trainable: stages 0-2 all, stage 3 unit buckets then persistent ones
    frozen_buckets: list[FlatBucket]  # stage 3: frozen parameters of units, sharded, never stepped
    optimizer: ShardedOptimizer
    loss_scaler: Any
    lr_scheduler: Any
    refresh_params: Callable[[], None]
    counters: Counters = field(default_factory=Counters)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def device(self) -> torch.device:
        return self.comm.topology.device

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.settings.precision.compute.dtype
