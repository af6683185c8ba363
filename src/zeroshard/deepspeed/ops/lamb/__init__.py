"""`deepspeed.ops.lamb.FusedLamb`: DeepSpeed's Lamb class over zeroshard's Lamb (optim/lamb.py),
nothing compiled; DeepSpeed's arguments and defaults. `max_grad_norm` > 0 is refused: clip with
the config's `gradient_clipping` (DeepSpeed's engine refuses it in an optimizer section too)."""

from __future__ import annotations

from zeroshard.optim.lamb import Lamb
from zeroshard.policies import ConfigError

__all__ = ["FusedLamb"]


class FusedLamb(Lamb):
    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999), eps: float = 1e-8,
                 eps_inside_sqrt: bool = False, weight_decay: float = 0.0, max_grad_norm: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if max_grad_norm:
            raise ConfigError("deepspeed.ops.lamb.FusedLamb(max_grad_norm=...) is not served by zeroshard: set the "
                              "config's gradient_clipping instead")
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                         eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay, max_coeff=max_coeff,
                         min_coeff=min_coeff, amsgrad=amsgrad)
