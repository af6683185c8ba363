"""A small MLP with frozen layers and an optional unused parameter.

Exists for the edge paths of every stage: parameters with `requires_grad=False`
(LoRA-style freezing) must be kept out of gradient buckets and optimizer shards,
and a parameter that forward never touches never gets a gradient, so its bucket
must still complete (`ignore_unused_parameters`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["FrozenMLP"]


class FrozenMLP(nn.Module):
    """`n_layers` Linear layers with Tanh between them; layers listed in `frozen` do not train."""

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8, n_layers: int = 4,
                 frozen: Iterable[int] = (0,), with_unused: bool = False) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"n_layers must be >= 1, got {n_layers}")
        dims = [d_in] + [d_hidden] * (n_layers - 1) + [d_out]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.frozen = tuple(sorted(set(frozen)))
        for i in self.frozen:
            if not 0 <= i < n_layers:
                raise ValueError(f"frozen layer {i} out of range for {n_layers} layers")
            self.layers[i].requires_grad_(False)
        # Registered but never called in forward: it never receives a gradient.
        self.unused = nn.Linear(d_hidden, d_hidden) if with_unused else None

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        loss = F.mse_loss(x, y) if y is not None else None
        return x, loss
