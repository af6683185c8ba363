"""A nanoGPT-style decoder: the model every parity test and benchmark trains.

Kept close to nanoGPT's `model.py` so a reader can check it in one sitting. Two
features matter to ZeRO and are here on purpose: the LM head shares its weight
with the token embedding (one Parameter used by two modules, which stage 3 must
gather once), and each transformer layer is one `Block` module (the natural
stage-3 gather unit, `leaf_module.classes = ["Block"]`).

Exact parameter counts (tied weight counted once), V = vocab, T = block size,
C = n_embd, L = n_layer, with biases: V*C + T*C + L*(12*C*C + 13*C) + 2*C.

    preset  V    T    L  heads  C    parameters
    tiny    64   16   2  2      32       28,032
    mini    256  64   4  4      128     834,304
    small   256  128  6  6      384  10,795,008
    10m     256  128  6  6      384  10,795,008   (small, named by size for `zeroshard bench`)
    50m     256  256  8  11     704  48,014,208
    150m    256  256  12 16    1024 151,681,024
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zeroshard.models.presets import GPT_PRESETS, GPTConfig

__all__ = ["GPTConfig", "GPT", "Block", "GPT_PRESETS", "build_gpt", "num_parameters"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LN transformer layer; the unit stage 3 gathers and releases."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two users
        # True: each block runs under zeroshard's activation checkpointing (its kept input lives on
        # the tier the engine's config names: device, host with cpu_checkpointing, or NVMe files)
        self.checkpoint_blocks = False
        self._init_weights()

    def _init_weights(self) -> None:
        # nanoGPT's scheme (GPT-2 paper): N(0, 0.02) everywhere, and the projections
        # that write into the residual stream scaled by 1/sqrt(2 * n_layer) so the
        # residual variance does not grow with depth. Module order is fixed, so the
        # result depends only on the torch RNG state.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                if module is self.lm_head:
                    continue  # same weight as wte, initialised there
                std = residual_std if name.endswith("c_proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor,
                targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits for every position, and the mean cross-entropy when targets are given."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            if self.checkpoint_blocks and torch.is_grad_enabled():
                from zeroshard.offload.activations import checkpoint

                x = checkpoint(block, x)
            else:
                x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_gpt(preset: str | GPTConfig) -> GPT:
    """A GPT from a preset name ("tiny", "mini", "small", "10m", "50m", "150m") or an explicit config."""
    if isinstance(preset, GPTConfig):
        return GPT(preset)
    if preset not in GPT_PRESETS:
        raise ValueError(f"unknown GPT preset {preset!r}; choose one of {sorted(GPT_PRESETS)}")
    return GPT(GPT_PRESETS[preset])


def num_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameter count with shared (tied) Parameters counted once (`parameters()` deduplicates them)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
