"""`deepspeed.runtime.fp16.onebit.adam.OnebitAdam` over zeroshard's OneBitAdam (see the package)."""

from __future__ import annotations

from zeroshard.optim.onebit import OneBitAdam

__all__ = ["OnebitAdam"]


class OnebitAdam(OneBitAdam):
    def __init__(self, params, deepspeed=None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        super().__init__(params, lr=lr, freeze_step=freeze_step, bias_correction=bias_correction, betas=tuple(betas),
                         eps=eps, eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, amsgrad=amsgrad)
