"""UnitBucket: a stage-3 gather unit's storage. At rest only this rank's shard exists.

Between a gather (`gather`, or `start_gather` then `finish_gather`) and `release()` the
parameters are views into the full buffer, which the bucket owns (from its `pool`). At rest each parameter keeps its true
shape but points at a one-element NaN expanded to that shape: shape queries work,
an accidental read gives NaN (visible) instead of stale values, and an in-place write
raises. Nothing is attached to the parameters.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

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
        self._home = None  # the shard's home on a tier (zeroshard.offload.Home), when not the device
        self.secondary: torch.Tensor | None = None  # hpZ: this rank's slice within its hpZ group
        self._gathering: tuple[torch.Tensor, object] | None = None  # (full buffer, pending all-gather)
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
        self.memory.hold("params", self.key, self._shard.nbytes)
        self._to_rest()  # the build's buffer is not pooled: no gather of this size may follow

    def shard(self) -> torch.Tensor:
        """This rank's shard where it lives (on the host with `offload_param`)."""
        return self._shard if self._shard is not None else super().shard()

    @property
    def home_tier(self):
        """The tier holding the at-rest shard away from the device (offload_param), or None."""
        return self._home.tier if self._home is not None else None

    def move_shard(self, tier) -> None:
        """Keep the at-rest shard on `tier` (offload_param); counted there by the ledger."""
        self._home = tier.home(self._shard)
        self._shard = self._home.tensor  # a placeholder on the nvme tier
        self.memory.hold("params", self.key, self._shard.nbytes, tier=tier.name)

    def read_shard(self) -> torch.Tensor:
        return self._home.read() if self._home is not None else self.shard()

    def write_shard(self, value: torch.Tensor, asynchronous: bool = False) -> None:
        if self._home is None:
            super().write_shard(value, asynchronous)
        else:
            self._home.write(value, asynchronous)

    def gather_input(self) -> torch.Tensor:
        """The shard on the device, as the all-gather needs it: the shard itself unless it lives
        in other memory (then an asynchronous copy from pinned host memory on CUDA)."""
        if self._home is None or self._shard is None:
            return self.shard()
        work = self._home.fetch(self._device)
        if work.data_ptr() != self._shard.data_ptr():  # a device copy until the gather is bound
            self.memory.hold("comm_buffers", f"{self.key}.fetch", work.nbytes)
        return work

    def start_gather(self, collective, what: str, source: torch.Tensor | None = None) -> None:
        """Start filling a new full buffer (counted as live parameters) from every rank's shard:
        `collective.all_gather` of `source`, by default this rank's shard on the device (hpZ passes
        its secondary and the hpZ group's comm). `finish_gather` binds the parameters to it."""
        full = empty_from(self.pool, self.layout.padded_numel, self._dtype, self._device)
        self.memory.hold("params", f"{self.key}.full", full.nbytes)
        self._gathering = (full, collective.all_gather(full, self.gather_input() if source is None else source,
                                                        what=what))

    def finish_gather(self) -> torch.Tensor:
        """Wait for the gather `start_gather` began; the parameters become views of the full buffer."""
        full, handle = self._gathering
        self._gathering = None
        handle.wait()
        for view, param in zip(slot_views(full, self.layout), self.params):
            param.data = view
        self.data = full
        self.memory.release("comm_buffers", f"{self.key}.fetch")
        return full

    def gather(self, collective, what: str) -> torch.Tensor:
        """The full buffer now (a collective: every rank gathers the same bucket), bound until `release`."""
        self.start_gather(collective, what)
        return self.finish_gather()

    @contextlib.contextmanager
    def whole(self, collective, what: str) -> Iterator[torch.Tensor]:
        """The full buffer for the block: gathered and released around it, unless its unit is
        gathered already (then it stays so). A collective: every rank enters for the same bucket."""
        if self.data is not None:
            yield self.data
            return
        try:
            yield self.gather(collective, what)
        finally:
            self.release()

    def keep_secondary(self, full: torch.Tensor, index: int, parts: int) -> None:
        """hpZ: keep slice `index` of `parts` of the gathered `full` buffer (the secondary
        partition, served to the hpZ group's backward gather), counted as parameters."""
        size = self.layout.padded_numel // parts
        self.secondary = full[index * size : (index + 1) * size].clone()
        self.memory.hold("params", f"{self.key}.secondary", self.secondary.nbytes)

    def drop_secondary(self) -> None:
        self.secondary = None
        self.memory.release("params", f"{self.key}.secondary")

    def release(self) -> None:
        """Back to rest: the full buffer goes (to the pool, when there is one, for the next gather).
        A gather still in flight (a prefetch nobody used) is finished first: a collective is never
        abandoned half-way."""
        if self._gathering is not None:
            self.finish_gather()
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
