"""`deepspeed.runtime.fp16.onebit.lamb.OnebitLamb` over zeroshard's OneBitLamb (see the package)."""

from __future__ import annotations

from zeroshard.optim.onebit_lamb import OneBitLamb

__all__ = ["OnebitLamb"]


class OnebitLamb(OneBitLamb):
    def __init__(self, params, deepspeed=None, lr: float = 1e-3, freeze_step: int = 100000,
                 bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_grad_norm: float = 0.0, max_coeff: float = 10.0,
                 min_coeff: float = 0.01, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl", coeff_beta: float = 0.9, factor_max: float = 4.0,
                 factor_min: float = 0.5, factor_threshold: float = 0.1) -> None:
        super().__init__(params, lr=lr, freeze_step=freeze_step, bias_correction=bias_correction, betas=tuple(betas),
                         eps=eps, eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff, amsgrad=amsgrad, coeff_beta=coeff_beta, factor_max=factor_max,
                         factor_min=factor_min, factor_threshold=factor_threshold)
