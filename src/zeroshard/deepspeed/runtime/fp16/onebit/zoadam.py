"""`deepspeed.runtime.fp16.onebit.zoadam.ZeroOneAdam` over zeroshard's ZeroOneAdam (see the package)."""

from __future__ import annotations

from zeroshard.optim.zeroone import ZeroOneAdam as _ZeroOneAdam

__all__ = ["ZeroOneAdam"]


class ZeroOneAdam(_ZeroOneAdam):
    def __init__(self, params, deepspeed=None, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_grad_norm: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, var_freeze_step=var_freeze_step,
                         var_update_scaler=var_update_scaler, local_step_scaler=local_step_scaler,
                         local_step_clipper=local_step_clipper, amsgrad=amsgrad)
