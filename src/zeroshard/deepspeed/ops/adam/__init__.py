"""`deepspeed.ops.adam`: DeepSpeed's Adam classes over torch's Adam, nothing compiled.

Each takes DeepSpeed 0.19.8's own signature: `DeepSpeedCPUAdam(model_params, lr, bias_correction,
betas, eps, weight_decay, amsgrad, adamw_mode=True, fp32_optimizer_states=True)` and
`FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode=True, weight_decay, amsgrad,
set_grad_none=True)` (note the different name and place of the decay mode). They are
`torch.optim.Adam` with decoupled weight decay in AdamW mode (DeepSpeed's default) and L2 decay
otherwise. Built over zeroshard's shards by `deepspeed.initialize`, they get torch's fused
kernel (on the host: zeroshard's host Adam; on CUDA: the fused device kernel), as any torch Adam
does. With `bias_correction=False` (torch's Adam always corrects the bias) the constructor
returns zeroshard's `UncorrectedAdam` (optim/uncorrected_adam.py), DeepSpeed's kernel update with
both corrections 1, as the config's `{"type": "Adam", "params": {"bias_correction": false}}`
builds it. `amsgrad` is refused where DeepSpeed refuses it (FusedAdam; any class without bias
correction, whose kernels have none).
"""

from __future__ import annotations

import inspect

import torch

from zeroshard.optim.uncorrected_adam import UncorrectedAdam
from zeroshard.policies import ConfigError

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

_TORCH_OPTIONS = ("foreach", "maximize", "capturable", "differentiable", "fused")


class _DeepSpeedAdam(torch.optim.Adam):
    _MODE = "adamw_mode"  # the name of the decay-mode argument in this class's DeepSpeed signature

    def __new__(cls, *args, **kwargs):
        try:
            bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
        except TypeError:
            return super().__new__(cls)  # __init__ raises the same TypeError, naming the argument
        bound.apply_defaults()
        a = bound.arguments
        if a["bias_correction"]:
            return super().__new__(cls)
        name = f"deepspeed.ops.adam.{cls.__name__}"
        _check(name, bool(a["amsgrad"]), a.get("fp32_optimizer_states", True), a["torch_options"])
        params = a["model_params"] if "model_params" in a else a["params"]
        return UncorrectedAdam(params, lr=a["lr"], betas=tuple(a["betas"]), eps=a["eps"],
                               weight_decay=a["weight_decay"], adam_w_mode=bool(a[cls._MODE]))

    def _build(self, model_params, lr, betas, eps, weight_decay, amsgrad, adamw_mode, fp32_optimizer_states,
               torch_options) -> None:
        _check(f"deepspeed.ops.adam.{type(self).__name__}", False, fp32_optimizer_states, torch_options)
        # rebuilt by zeroshard from its own `defaults`, which name the decay mode torch's way
        decoupled = bool(torch_options.pop("decoupled_weight_decay", adamw_mode))
        super().__init__(model_params, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                         amsgrad=amsgrad, decoupled_weight_decay=decoupled, **torch_options)
        self.adamw_mode = decoupled


def _check(name: str, amsgrad: bool, fp32_optimizer_states: bool, torch_options: dict) -> None:
    if amsgrad:
        raise ConfigError(f"{name}: amsgrad is not supported with bias_correction=False (DeepSpeed's Adam kernels "
                          "have no AMSGrad variant); use torch.optim.Adam(amsgrad=True)")
    if not fp32_optimizer_states:
        raise ConfigError(f"{name}(fp32_optimizer_states=False) is not served by zeroshard: optimizer states are fp32")
    unknown = sorted(set(torch_options) - set(_TORCH_OPTIONS) - {"decoupled_weight_decay"})
    if unknown:
        raise ConfigError(f"{name}: unknown argument(s) {unknown}")


class DeepSpeedCPUAdam(_DeepSpeedAdam):
    """DeepSpeed's host Adam: torch's Adam/AdamW (fused CPU kernel where zeroshard builds it)."""

    def __init__(self, model_params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, adamw_mode: bool = True,
                 fp32_optimizer_states: bool = True, **torch_options) -> None:
        self._build(model_params, lr, betas, eps, weight_decay, amsgrad, adamw_mode, fp32_optimizer_states,
                    torch_options)


class FusedAdam(_DeepSpeedAdam):
    """DeepSpeed's fused device Adam: torch's Adam/AdamW (fused kernel where zeroshard builds it)."""

    _MODE = "adam_w_mode"

    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, adam_w_mode: bool = True, weight_decay: float = 0.0, amsgrad: bool = False,
                 set_grad_none: bool = True, **torch_options) -> None:
        if amsgrad:  # DeepSpeed's FusedAdam raises RuntimeError here
            raise ConfigError("deepspeed.ops.adam.FusedAdam does not support the AMSGrad variant (as in DeepSpeed); "
                              "use torch.optim.Adam(amsgrad=True)")
        self._build(params, lr, betas, eps, weight_decay, False, adam_w_mode, True, torch_options)
