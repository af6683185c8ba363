"""`deepspeed.runtime.zero.offload_config`: the enums DeepSpeed 0.19.8's scripts import
(OpenRLHF's `offload_states(include=[OffloadStateTypeEnum.optim_states, ...],
device=OffloadDeviceEnum.cpu)`)."""

from __future__ import annotations

from enum import Enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
