"""Lamb (You et al. 2019, "Large Batch Optimization for Deep Learning"), DeepSpeed's `Lamb`.

torch has no Lamb; this follows DeepSpeed's FusedLamb kernel (ops/csrc/lamb) element for
element, one tensor at a time:

    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    u = m / (sqrt(v) + eps) + weight_decay * p          (eps_inside_sqrt: m / sqrt(v + eps))
    coeff = clamp(|p| / |u|, min_coeff, max_coeff)       (1 where either norm is 0)
    p = p - step_size * coeff * u,  step_size = lr * sqrt(1 - beta2^t) / (1 - beta1^t)
                                                        (lr without bias_correction)

The trust ratio needs each parameter's whole tensor. zeroshard steps flat fp32 buckets, so
the sharded optimizer tells Lamb where each parameter lies in a bucket (`split_into_tensors`)
and the norms are taken per parameter, as DeepSpeed's FusedLamb takes them per tensor. That
needs the whole bucket on the rank: stage 0. At stages 1-3 a parameter's elements are split
across ranks; DeepSpeed refuses Lamb there unless `zero_allow_untested_optimizer`, and then
takes each rank's flat partition as one tensor (a different trust ratio on every rank);
zeroshard refuses it (config/support.py).
"""

from __future__ import annotations

import math

import torch

__all__ = ["LAMB_SHARDED", "Lamb"]

LAMB_SHARDED = ("Lamb at ZeRO stages 1-3 is not built: its trust ratio needs each parameter's whole tensor, "
                "which stages 1-3 split across ranks (DeepSpeed refuses it too unless "
                "zero_allow_untested_optimizer, and then takes each rank's partition as one tensor); use "
                "zero_optimization.stage 0 with Lamb, or Adam/AdamW/Lion at stages 1-3")


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, bias_correction: bool = True, betas=(0.9, 0.999),
                 eps: float = 1e-8, eps_inside_sqrt: bool = False, weight_decay: float = 0.0,
                 max_coeff: float = 10.0, min_coeff: float = 0.01, amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("Lamb has no AMSGrad variant (DeepSpeed's FusedLamb refuses it too)")
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid lr {lr}, eps {eps} or weight_decay {weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"invalid min_coeff {min_coeff} / max_coeff {max_coeff}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))
        self._tensors: dict[int, list[tuple[int, int]]] = {}  # id(param) -> its tensors' (start, length)

    def split_into_tensors(self, param: torch.Tensor, spans: list[tuple[int, int]]) -> None:
        """`param` (a flat bucket) holds one model tensor at each (start, length) of `spans`;
        elements outside them (padding) are never changed. Default: `param` is one tensor."""
        self._tensors[id(param)] = list(spans)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("Lamb does not support sparse gradients")
                self._step_param(p, group)
        return loss

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step, (beta1, beta2) = int(state["step"].item()), group["betas"]
        m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        denom = (v + group["eps"]).sqrt_() if group["eps_inside_sqrt"] else v.sqrt().add_(group["eps"])
        update = m / denom
        if group["weight_decay"]:
            update.add_(p, alpha=group["weight_decay"])
        step_size = group["lr"]
        if group["bias_correction"]:
            step_size *= math.sqrt(1.0 - beta2 ** step) / (1.0 - beta1 ** step)
        flat_p, flat_u = p.view(-1), update.view(-1)
        for start, length in self._tensors.get(id(p), [(0, p.numel())]):
            w, u = flat_p[start:start + length], flat_u[start:start + length]
            w_norm, u_norm = w.norm(), u.norm()  # tensors: no device sync per parameter
            coeff = torch.where((w_norm > 0) & (u_norm > 0),
                                (w_norm / u_norm).clamp(group["min_coeff"], group["max_coeff"]), 1.0)
            w.sub_(u * (coeff * step_size))
