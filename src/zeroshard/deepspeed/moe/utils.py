"""`deepspeed.moe.utils`: the helpers DeepSpeedExamples call on every model.

zeroshard has no mixture-of-experts layer, so no parameter is an expert parameter:
`is_moe_param` is False for every tensor and
`split_params_into_different_moe_groups_for_optimizer` returns the groups unchanged, as
DeepSpeed's does for a model without MoE layers.
"""

from __future__ import annotations

from typing import Any

import torch

from zeroshard.deepspeed.config import unsupported
from zeroshard.policies import ConfigError

__all__ = ["has_moe_layers", "is_moe_param", "split_params_into_different_moe_groups_for_optimizer",
           "split_params_into_shared_and_expert_params"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed marks expert parameters with `allreduce=False`; zeroshard makes none."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(model: torch.nn.Module) -> tuple[bool, int]:
    return False, 0


def split_params_into_shared_and_expert_params(params) -> tuple[list, list]:
    shared, expert = [], []
    for p in params:
        (expert if is_moe_param(p) else shared).append(p)
    return shared, expert


def split_params_into_different_moe_groups_for_optimizer(param_groups: Any, max_group_size: int | None = 178956971):
    """Param groups (a dict, a list/tuple of dicts, or a list of tensors) with expert
    parameters moved to groups of their own. Without expert parameters (zeroshard has no
    MoE layer) the groups come back as given, as a list, like DeepSpeed's."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")
    for group in param_groups:
        params = group["params"] if isinstance(group, dict) else [group]
        expert = [p for p in params if is_moe_param(p)]
        if expert:
            raise ConfigError(unsupported("mixture-of-experts parameters (deepspeed.moe.utils found parameters "
                                          "marked allreduce=False)"))
    return param_groups
