"""The state torch's Adam / AdamW create at a parameter's first step, made in memory the
caller already holds (the NVMe tier's swap buffers, optim.nvme_swap), so that the first step
does not allocate and fault in 8 bytes per element afresh."""

from __future__ import annotations

from typing import Any

import torch

ZERO_FIRST_STATE = (torch.optim.Adam, torch.optim.AdamW)  # classes whose first step starts from zeros


def first_state_in(optimizer: torch.optim.Optimizer, master: torch.Tensor, views: list[torch.Tensor]) -> bool:
    """Give `master`, before its first step, the state torch's Adam / AdamW create then
    (torch/optim/adam.py `_init_group`: `step` 0, exp_avg, exp_avg_sq and with amsgrad
    max_exp_avg_sq zeros), its per-element states zeroed in `views` (a swap buffer, in the
    order of `state_names`) instead of fresh allocations: 8 bytes per element allocated anew
    fault in every page, most of the 3.15B demo's first-step gap (bench/RESULTS.md). False
    (torch creates them) for other optimizers or a master that has a state already."""
    if type(optimizer) not in ZERO_FIRST_STATE or optimizer.state.get(master):
        return False
    group = next(g for g in optimizer.param_groups if any(p is master for p in g["params"]))
    names = sorted(["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad") else []))
    if len(views) < len(names):
        return False
    fused, on_device = group.get("fused"), group.get("capturable") or group.get("fused")
    scalar = torch.float32 if fused or torch.get_default_dtype() != torch.float64 else torch.float64
    state: dict[str, Any] = {"step": torch.zeros((), dtype=scalar, device=master.device if on_device else "cpu")}
    for name, view in zip(names, views):
        state[name] = view.view_as(master).zero_()
    optimizer.state[master] = state
    return True
