"""`deepspeed.ops.lion`: DeepSpeed's Lion classes over zeroshard's Lion (optim/lion.py), nothing
compiled. `FusedLion(params, lr, betas, weight_decay, set_grad_none)` and
`DeepSpeedCPULion(model_params, lr, betas, weight_decay, fp32_optimizer_states)` take
DeepSpeed's arguments and defaults; `fp32_optimizer_states=False` is refused (states are fp32).
"""

from __future__ import annotations

from zeroshard.optim.lion import Lion
from zeroshard.policies import ConfigError

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class FusedLion(Lion):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 set_grad_none: bool = True, foreach: bool | None = True) -> None:
        super().__init__(params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=foreach)


class DeepSpeedCPULion(Lion):
    def __init__(self, model_params, lr: float = 1e-3, betas=(0.9, 0.999), weight_decay: float = 0.0,
                 fp32_optimizer_states: bool = True, foreach: bool | None = True) -> None:
        if not fp32_optimizer_states:
            raise ConfigError("deepspeed.ops.lion.DeepSpeedCPULion(fp32_optimizer_states=False) is not served by "
                              "zeroshard: optimizer states are fp32")
        super().__init__(model_params, lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=foreach)
