"""The sharded optimizer: fp32 master copies of this rank's shards, stepped by any torch optimizer.

Each bucket's owned shard gets one fp32 master tensor; the torch optimizer sees
those tensors (grouped by the user's param groups) as its parameters, so its states
are exactly K x (shard elements). Steps run in sub-groups of `sub_group_size`
elements (DeepSpeed's knob): only one sub-group's fp32 gradients exist at a time,
and each bucket's updated shard is handed back (`after_bucket`) for publishing while
the next sub-group steps.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

from zeroshard.partition import FlatBucket, MemoryLedger

Builder = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def sub_groups(sizes: list[int], cap: int) -> list[list[int]]:
    """Consecutive indices whose sizes sum to at most `cap` (a larger item stands alone)."""
    out: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not out or used + size > cap:
            out.append([])
            used = 0
        out[-1].append(i)
        used += size
    return out


class ShardedOptimizer:
    def __init__(self, buckets: list[FlatBucket], masters: list[torch.Tensor | None], build: Builder,
                 group_options: list[dict[str, Any]], memory: MemoryLedger, sub_group_size: int) -> None:
        """`masters[b]` is the fp32 value of bucket b's shard, taken before any cast to 16 bits,
        or None when the shard is fp32 already: then the shard itself is the master."""
        self.buckets, self.memory = buckets, memory
        self.masters = [m if m is not None else b.shard() for m, b in zip(masters, buckets)]
        self._separate = [m is not None for m in masters]
        groups = [
            {**options, "params": [m for m, b in zip(self.masters, buckets) if b.layout.group == g]}
            for g, options in enumerate(group_options)
        ]
        self.optimizer = build(groups)
        self._sub_groups = sub_groups([m.numel() for m in self.masters], sub_group_size)
        self._count_states()

    # The torch optimizer's surface that users and LR schedulers reach for.
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)
        self._count_states()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Gradients are owned by the engine and cleared after each step; nothing to do."""

    def step(self, grad_shard: Callable[[int], torch.Tensor], scale: float,
             after_bucket: Callable[[int], None]) -> None:
        """Step every master with `grad_shard(b) * scale` in fp32, then write it back to bucket b.

        `scale` folds loss-scale removal and clipping into one multiply. A gradient
        already in fp32 is scaled in place (the engine clears it after the step
        anyway); a 16-bit one is upcast into a temporary that lives for one sub-group."""
        for indices in self._sub_groups:
            upcast = 0
            for b in indices:
                g = grad_shard(b)
                if g.dtype == torch.float32:
                    self.masters[b].grad = g.mul_(scale) if scale != 1.0 else g
                else:
                    self.masters[b].grad = g.float().mul_(scale)
                    upcast += g.numel() * 4
            self.memory.hold("grads", "fp32_subgroup", upcast)
            self.optimizer.step()
            for b in indices:
                self.masters[b].grad = None
                if self._separate[b]:
                    self.buckets[b].shard().copy_(self.masters[b])
                after_bucket(b)
            self.memory.release("grads", "fp32_subgroup")
        self._count_states()

    def _state_tensors(self) -> Iterator[torch.Tensor]:
        for per_param in self.optimizer.state.values():
            for value in per_param.values():
                if torch.is_tensor(value) and value.dim() > 0:  # skip scalar step counters
                    yield value

    def _count_states(self) -> None:
        """Masters that are the parameter shards themselves are counted as parameters, not here."""
        master_bytes = sum(m.numel() * m.element_size() for m, own in zip(self.masters, self._separate) if own)
        state_bytes = sum(t.numel() * t.element_size() for t in self._state_tensors())
        self.memory.hold("optimizer_states", "master", master_bytes)
        self.memory.hold("optimizer_states", "states", state_bytes)
