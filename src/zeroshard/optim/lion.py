"""Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), DeepSpeed's `Lion`.

torch has no Lion, so this is the one optimizer zeroshard writes itself; it is elementwise
(like Adam), so the sharded optimizer steps it over flat fp32 shards unchanged:

    c = beta1 * m + (1 - beta1) * g
    p = p * (1 - lr * weight_decay) - lr * sign(c)
    m = beta2 * m + (1 - beta2) * g

One state per element, `exp_avg` (DeepSpeed's name), 4 bytes. Defaults are DeepSpeed's
(FusedLion / DeepSpeedCPULion: lr 1e-3, betas (0.9, 0.999), weight_decay 0).

Where `c` is exactly 0 (an element whose gradient and momentum are both 0: padding, an
embedding row no batch has touched yet) the paper's sign(0) = 0 leaves it alone. DeepSpeed's
kernels never do: its CUDA kernel moves it by +lr, its CPU kernel by -lr (copysign of +0),
so they disagree with each other there; zeroshard follows the paper and the same result on
every device, and equals DeepSpeed everywhere else.
"""

from __future__ import annotations

import torch

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, foreach: bool | None = None) -> None:
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}: each must be in [0, 1)")
        if weight_decay < 0:
            raise ValueError(f"invalid weight_decay {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, foreach=foreach))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError("Lion does not support sparse gradients")
                if not self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            grads = [p.grad for p in params]
            moms = [self.state[p]["exp_avg"] for p in params]
            lr, (beta1, beta2), wd = group["lr"], group["betas"], group["weight_decay"]
            if group["foreach"]:  # one foreach call per device and dtype (offloaded masters are on the host)
                kinds: dict = {}
                for p, g, m in zip(params, grads, moms):
                    kinds.setdefault((p.device, p.dtype), []).append((p, g, m))
                for triples in kinds.values():
                    _step_foreach(*map(list, zip(*triples)), lr, beta1, beta2, wd)
            else:
                for p, g, m in zip(params, grads, moms):
                    _step_one(p, g, m, lr, beta1, beta2, wd)
        return loss


def _step_one(p, g, m, lr, beta1, beta2, wd) -> None:
    update = m.mul(beta1).add_(g, alpha=1.0 - beta1).sign_()
    if wd:
        p.mul_(1.0 - lr * wd)
    p.add_(update, alpha=-lr)
    m.mul_(beta2).add_(g, alpha=1.0 - beta2)


def _step_foreach(params, grads, moms, lr, beta1, beta2, wd) -> None:
    updates = torch._foreach_mul(moms, beta1)
    torch._foreach_add_(updates, grads, alpha=1.0 - beta1)
    torch._foreach_sign_(updates)
    if wd:
        torch._foreach_mul_(params, 1.0 - lr * wd)
    torch._foreach_add_(params, updates, alpha=-lr)
    torch._foreach_mul_(moms, beta2)
    torch._foreach_add_(moms, grads, alpha=1.0 - beta2)
