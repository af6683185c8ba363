"""Adam without bias correction: DeepSpeed's `Adam` / `AdamW` with `"bias_correction": false`
(DeepSpeed's BERT configs set it). torch's Adam always corrects the bias, so this is written
here, from DeepSpeed 0.19.8's kernels (csrc/adam/cpu_adam_impl.cpp, csrc/adam/multi_tensor_adam.cu),
where `bias_correction` false sets both corrections to 1:

    g = g + weight_decay * p            (adam_w_mode false: L2, before the moments)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - lr * weight_decay * p       (adam_w_mode true: decoupled, from the same p)
    p = p - lr * m / (sqrt(v) + eps)

Elementwise, so the sharded optimizer steps it over flat fp32 shards at every stage; states
`exp_avg`, `exp_avg_sq` (8 bytes per element) and `step`, as torch's Adam names them.
"""

from __future__ import annotations

import torch

from zeroshard.optim.per_tensor import PerTensorOptimizer

__all__ = ["UncorrectedAdam"]


class UncorrectedAdam(PerTensorOptimizer):
    algorithm = "Adam"

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, adam_w_mode: bool = True) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid lr {lr}, eps {eps} or weight_decay {weight_decay}: each must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      adam_w_mode=adam_w_mode))

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state = self._adam_state(p)
        g, m, v = p.grad, state["exp_avg"], state["exp_avg_sq"]
        if wd and not group["adam_w_mode"]:
            g = g.add(p, alpha=wd)
        m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        if wd and group["adam_w_mode"]:
            p.mul_(1.0 - lr * wd)
        p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
