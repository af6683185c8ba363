"""UnitBucket: a stage-3 gather unit's storage. At rest only this rank's shard exists.

Between `bind(full)` and `release()` the parameters are views into the full buffer
(filled by an all-gather the caller ran). At rest each parameter keeps its true
shape but points at a one-element NaN expanded to that shape: shape queries work,
an accidental read gives NaN (visible) instead of stale values, and an in-place write
raises. Nothing is attached to the parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from zeroshard.partition.buffer_pool import BufferPool, empty_from
from zeroshard.partition.flat_bucket import FlatBucket, placeholder, slot_views
from zeroshard.partition.layout import BucketLayout
from zeroshard.partition.memory import MemoryLedger


class UnitBucket(FlatBucket):
    def __init__(self, layout: BucketLayout, params: list[nn.Parameter], shard_index: int,
                 memory: MemoryLedger, name: str, key: str, pool: BufferPool | None = None) -> None:
        super().__init__(layout, params, shard_index, memory, key)
        self.name = name  # the unit's module path, for messages
        self._shard: torch.Tensor | None = None
        self._dtype, self._device = self.data.dtype, self.data.device
        self._home = None  # a tier (zeroshard.offload) holding the shard, when not the device
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's slice within its hpZ group
        self.pool = pool  # reuses full buffers between gathers (None: a new one each time)

    @property
    def label(self) -> str:
        return f"unit '{self.name or '<root>'}'"

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device

    def to_dtype(self, dtype: torch.dtype) -> None:
        super().to_dtype(dtype)
        self._dtype = dtype

    def partition(self) -> None:
        """Keep only this rank's shard; from now on the full buffer exists only when gathered."""
        lo, hi = self.shard_range
        self._shard = self.data[lo:hi].clone()
        self.memory.hold("params", self.key, self._shard.numel() * self._shard.element_size())
        self._to_rest()  # the build's buffer is not pooled: no gather of this size may follow

    def shard(self) -> torch.Tensor:
        """This rank's shard where it lives (on the host with `offload_param`)."""
        return self._shard if self._shard is not None else super().shard()

    @property
    def home_tier(self):
        """The tier holding the at-rest shard away from the device (offload_param), or None."""
        return self._home

    def move_shard(self, tier) -> None:
        """Keep the at-rest shard on `tier` (offload_param); counted there by the ledger."""
        self._shard = tier.place(self._shard)
        self._home = tier
        self.memory.hold("params", self.key, self._shard.numel() * self._shard.element_size(), tier=tier.name)

    def gather_input(self) -> torch.Tensor:
        """The shard on the device, as the all-gather needs it: the shard itself unless it lives
        in other memory (then an asynchronous copy from pinned host memory on CUDA)."""
        if self._home is None or self._shard is None:
            return self.shard()
        work = self._home.fetch(self._shard, self._device)
        if work.data_ptr() != self._shard.data_ptr():  # a device copy until the gather is bound
            self.memory.hold("comm_buffers", f"{self.key}.fetch", work.numel() * work.element_size())
        return work

    def new_full(self) -> torch.Tensor:
        """An empty full buffer for an all-gather, counted as live parameters."""
        full = empty_from(self.pool, self.layout.padded_numel, self._dtype, self._device)
        self.memory.hold("params", f"{self.key}.full", full.numel() * full.element_size())
        return full

    def bind(self, full: torch.Tensor) -> None:
        for view, param in zip(slot_views(full, self.layout), self.params):
            param.data = view
        self.data = full
        self.memory.release("comm_buffers", f"{self.key}.fetch")

    def keep_secondary(self, full: torch.Tensor, index: int, parts: int) -> None:
        """hpZ: keep slice `index` of `parts` of the gathered `full` buffer (the secondary
        partition, served to the hpZ group's backward gather), counted as parameters."""
        size = self.layout.padded_numel // parts
        self.secondary = full[index * size : (index + 1) * size].clone()
        self.memory.hold("params", f"{self.key}.secondary", self.secondary.numel() * self.secondary.element_size())

    def drop_secondary(self) -> None:
        self.secondary = None
        self.memory.release("params", f"{self.key}.secondary")

    def release(self) -> None:
        """Back to rest: the full buffer goes (to the pool, when there is one, for the next gather)."""
        if self.pool is not None:
            self.pool.give(self.data)
        self._to_rest()

    def _to_rest(self) -> None:
        one = placeholder((), self._dtype, self._device)  # one element shared by the bucket's parameters
        for slot, param in zip(self.layout.slots, self.params):
            param.data = one.expand(slot.shape)
        self.data = None
        self.memory.release("params", f"{self.key}.full")
        self.memory.release("comm_buffers", f"{self.key}.fetch")
