"""`deepspeed.ops.adam`: DeepSpeed's Adam classes over torch's Adam, nothing compiled.

`DeepSpeedCPUAdam(model_params, lr, bias_correction, betas, eps, weight_decay, amsgrad,
adamw_mode=True)` and `FusedAdam(...)` are `torch.optim.Adam` with decoupled weight decay
when `adamw_mode` (AdamW, DeepSpeed's default) and L2 decay otherwise. Built over
zeroshard's shards by `deepspeed.initialize`, they get torch's fused kernel (on the host:
zeroshard's host Adam; on CUDA: the fused device kernel), as any torch Adam does.
`bias_correction=False` is refused here (torch's Adam always corrects the bias); the config's
`"optimizer": {"type": "Adam", "params": {"bias_correction": false}}` builds it (optim/uncorrected_adam.py).
"""

from __future__ import annotations

import torch

from zeroshard.policies import ConfigError

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

_TORCH_OPTIONS = ("foreach", "maximize", "capturable", "differentiable", "fused")


class _DeepSpeedAdam(torch.optim.Adam):
    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True, set_grad_none: bool = True, **torch_options) -> None:
        name = type(self).__name__
        if not bias_correction:
            raise ConfigError(f"deepspeed.ops.adam.{name}(bias_correction=False) is not served by zeroshard: "
                              "name the optimizer in the config instead ({\"type\": \"Adam\", \"params\": "
                              "{\"bias_correction\": false}}), which builds DeepSpeed's uncorrected update")
        if not fp32_optimizer_states:
            raise ConfigError(f"deepspeed.ops.adam.{name}(fp32_optimizer_states=False) is not served by "
                              "zeroshard: optimizer states are fp32")
        # rebuilt by zeroshard from its own `defaults`, which name the decay mode torch's way
        decoupled = bool(torch_options.pop("decoupled_weight_decay", adamw_mode))
        unknown = sorted(set(torch_options) - set(_TORCH_OPTIONS))
        if unknown:
            raise ConfigError(f"deepspeed.ops.adam.{name}: unknown argument(s) {unknown}")
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=decoupled, **torch_options)
        self.adamw_mode = decoupled


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's host Adam: torch's Adam/AdamW (fused CPU kernel where zeroshard builds it)."""


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's fused device Adam: torch's Adam/AdamW (fused kernel where zeroshard builds it)."""
