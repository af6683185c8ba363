"""Stage 3's linear (`memory_efficient_linear`, on unless the config says false, as in DeepSpeed).

torch's `F.linear` saves a view of its weight (`weight.t()`) for backward. At stage 3 that view
keeps the gathered full buffer of every unit alive from the unit's forward to its backward, so
releasing a unit after forward frees nothing: a forward held every unit's parameters at once
(measured in bench/RESULTS.md, issue 24; tests/test_zero_linear.py). This linear saves the Parameter
itself; backward reads its values again from the unit's gather for backward (stage 3's hooks),
or gathers the unit if it is released then (a weight read outside its unit's backward).

Used for a managed Parameter while grad is enabled, autocast is off on the input's device
(autocast decides the matmul's dtype) and no saved-tensor hooks are active. Under hooks, torch's
own linear is kept: a non-reentrant activation checkpoint's hooks keep nothing of what is saved
(so no view holds memory) and its recompute, in backward, must save what the forward saved, and
stage 3's torch-function mode does not reach into backward to choose this linear again.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, gathered: Callable[[torch.Tensor], None]):
        ctx.save_for_backward(x, weight, bias)
        ctx.gathered = gathered
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        x, weight, bias = ctx.saved_tensors
        ctx.gathered(weight)
        gx = g.matmul(weight) if ctx.needs_input_grad[0] else None
        g2 = g.reshape(-1, g.shape[-1])
        gw = g2.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if bias is not None and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def _saved_tensor_hooks() -> bool:
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None  # unknown (another torch): as if hooks were on


def linear(args: tuple, kwargs: dict, managed: Callable[[Any], bool],
           gathered: Callable[[torch.Tensor], None]) -> torch.Tensor | None:
    """`F.linear(*args, **kwargs)` saving the weight itself, or None where torch's own applies:
    the weight is not one stage 3 manages, grad is off, autocast is on, or saved-tensor hooks are."""
    x, weight, bias = (args[i] if i < len(args) else kwargs.get(name) for i, name in enumerate(("input", "weight", "bias")))
    if not (torch.is_grad_enabled() and torch.is_tensor(x) and managed(weight)) \
            or torch.is_autocast_enabled(x.device.type) or _saved_tensor_hooks():
        return None
    return _Linear.apply(x, weight, bias, gathered)
