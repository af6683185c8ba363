"""Deterministic synthetic data and the rank-sliced batches the parity oracle relies on.

The oracle (DESIGN.md section 9) says N ranks with micro-batch b train like one
process with batch N*b. That holds only if rank r's rows are exactly rows
r*b:(r+1)*b of a global batch that does not depend on N's split: so every batch
is cut from `global_batch`, which depends only on (tokens, N*b, seq_len, step, seed).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch

__all__ = ["synthetic_tokens", "global_batch", "batch_iterator"]


def synthetic_tokens(num_tokens: int, vocab_size: int, seed: int = 0, noise: float = 0.1) -> torch.Tensor:
    """A learnable token stream: walk a fixed random cycle through the vocabulary.

    Each token is followed by its successor on the cycle with probability
    1 - noise and by a uniformly random token otherwise, so a model can bring
    the loss from ln(vocab) down towards the entropy of the noise. Vectorised:
    the position on the cycle is t plus the cumulative sum of random jumps.
    """
    if num_tokens < 1 or vocab_size < 2:
        raise ValueError(f"need num_tokens >= 1 and vocab_size >= 2, got {num_tokens}, {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(vocab_size, generator=g)
    jumps = torch.randint(0, vocab_size, (num_tokens,), generator=g)
    jumps[torch.rand(num_tokens, generator=g) >= noise] = 0
    pos = torch.arange(num_tokens) + torch.cumsum(jumps, 0)
    return cycle[pos % vocab_size]


def global_batch(tokens: torch.Tensor, batch_size: int, seq_len: int, step: int, world_size: int = 1,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole (world_size * batch_size, seq_len) batch of `step`: inputs and next-token targets."""
    rows = world_size * batch_size
    if tokens.numel() < seq_len + 2:
        raise ValueError(f"{tokens.numel()} tokens are too few for seq_len {seq_len}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (rows,), generator=g)
    windows = tokens[starts[:, None] + torch.arange(seq_len + 1)]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def batch_iterator(tokens: torch.Tensor, batch_size: int, seq_len: int, rank: int = 0, world_size: int = 1,
                   seed: int = 0, steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Rank `rank`'s (x, y) micro-batches: rows rank*b:(rank+1)*b of each global batch; endless
    unless `steps` is given."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    for step in itertools.count() if steps is None else range(steps):
        x, y = global_batch(tokens, batch_size, seq_len, step, world_size, seed)
        lo, hi = rank * batch_size, (rank + 1) * batch_size
        yield x[lo:hi], y[lo:hi]
