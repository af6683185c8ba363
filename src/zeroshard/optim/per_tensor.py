"""The step loop the optimizers zeroshard writes share: run the closure, then each parameter
with a gradient, one at a time, through the subclass's `_step_param(p, group)`."""

from __future__ import annotations

import torch

__all__ = ["PerTensorOptimizer"]


class PerTensorOptimizer(torch.optim.Optimizer):
    algorithm = "this optimizer"  # named in the refusal of sparse gradients

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
                    raise RuntimeError(f"{self.algorithm} does not support sparse gradients")
                self._step_param(p, group)
        return loss

    def _step_param(self, p: torch.Tensor, group: dict) -> None:
        raise NotImplementedError

    def _adam_state(self, p: torch.Tensor) -> dict:
        """`p`'s state with Adam's two moments (zeros at its first step) and its step, counted."""
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        return state
