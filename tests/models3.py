"""Awkward models for stage 3 (DESIGN.md section 8): built here, not shipped."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from zeroshard.models import GPT
from zeroshard.models.gpt import GPT_PRESETS


class CheckpointedGPT(GPT):
    """Every block runs under activation checkpointing; half of each block's MLP is frozen."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__(GPT_PRESETS["tiny"])
        self.reentrant = reentrant
        for block in self.h:
            block.mlp.c_fc.requires_grad_(False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class SkippingGPT(GPT):
    """Block 1 is skipped on every third call: control flow that changes between steps.
    The count is per process, so every rank (and the reference) skips on the same calls."""

    def __init__(self) -> None:
        super().__init__(GPT_PRESETS["tiny"])
        self.calls = 0

    def forward(self, idx, targets=None):
        self.calls += 1
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for i, block in enumerate(self.h):
            if not (i == 1 and self.calls % 3 == 0):
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


class OutsideReadGPT(GPT):
    """The root's forward reads a block's parameter directly (a parameter read outside its
    module's forward): a small penalty on h.0's MLP weight joins the loss."""

    def __init__(self) -> None:
        super().__init__(GPT_PRESETS["tiny"])

    def forward(self, idx, targets=None):
        logits, loss = super().forward(idx, targets)
        return logits, loss + 1e-3 * self.h[0].mlp.c_proj.weight.square().sum()


class LoRALinear(torch.nn.Module):
    """A frozen base weight plus a trainable low-rank update (LoRA). In backward the LoRA
    branch (built later in forward) runs before the frozen product: a unit released when
    its trainable gradients are done would hand the frozen product a released weight."""

    def __init__(self, d: int, rank: int = 4) -> None:
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.base.requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(rank, d) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(d, rank) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


class LoRAStack(torch.nn.Module):
    def __init__(self, d_in: int = 16, d: int = 32, d_out: int = 8, layers: int = 3) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(d_in, d)
        self.layers = torch.nn.ModuleList(LoRALinear(d) for _ in range(layers))
        self.out = torch.nn.Linear(d, d_out)

    def forward(self, x, y=None):
        h = self.inp(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        out = self.out(h)
        return out, F.mse_loss(out, y)


class ReusedBlockGPT(GPT):
    """Block 0 runs twice per forward (weights shared across depth): one unit, two uses."""

    def __init__(self) -> None:
        super().__init__(GPT_PRESETS["tiny"])

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in (self.h[0], self.h[1], self.h[0]):
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
