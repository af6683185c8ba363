"""FlatBucket: the one owner of a bucket's parameter storage.

Parameters become views into one contiguous buffer, so a collective over the
buffer reads and writes every parameter in place, with no copy in or out.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from zeroshard.partition.layout import BucketLayout, Slot
from zeroshard.partition.memory import MemoryLedger


def slot_views(buffer: torch.Tensor, layout: BucketLayout) -> list[torch.Tensor]:
    """One view of `buffer` per slot, shaped like its parameter."""
    return [buffer[s.offset : s.end].view(s.shape) for s in layout.slots]


def placeholder(shape, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A stand-in for a tensor whose values live elsewhere (a released stage-3 parameter, a
    shard in a file): its true shape over one element of storage, NaN for floats so that an
    accidental read shows, and an in-place write raises."""
    one = torch.full((), float("nan") if dtype.is_floating_point else 0, dtype=dtype, device=device)
    return one.expand(tuple(shape)) if len(shape) else one


class FlatBucket:
    def __init__(self, layout: BucketLayout, params: list[nn.Parameter], shard_index: int, memory: MemoryLedger,
                 key: str | None = None) -> None:
        if len(params) != len(layout.slots):
            raise ValueError("one parameter per slot expected")
        self.layout = layout
        self.params = params
        self.shard_index = shard_index
        self.key = key or f"bucket{layout.index}"  # names its bytes in the memory ledger
        first = params[0]
        self.data = torch.zeros(layout.padded_numel, dtype=first.dtype, device=first.device)
        for view, param in zip(slot_views(self.data, layout), params):
            view.copy_(param.detach())
            param.data = view
        self.memory = memory
        memory.hold("params", self.key, self.data.nbytes)

    def to_dtype(self, dtype: torch.dtype) -> None:
        """Re-home the parameters in a buffer of `dtype` (e.g. bf16 compute after fp32 init)."""
        if dtype == self.data.dtype:
            return
        data = self.data.to(dtype)
        for view, param in zip(slot_views(data, self.layout), self.params):
            param.data = view
        self.data = data
        self.memory.hold("params", self.key, data.nbytes)

    @property
    def label(self) -> str:
        """How messages name this bucket."""
        return f"bucket {self.layout.index}"

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def slots(self) -> tuple[Slot, ...]:
        return self.layout.slots

    @property
    def shard_range(self) -> tuple[int, int]:
        return self.layout.shard_range(self.shard_index)

    def shard(self) -> torch.Tensor:
        """This rank's slice of the parameter buffer (a view)."""
        lo, hi = self.shard_range
        return self.data[lo:hi]

    def read_shard(self) -> torch.Tensor:
        """This rank's shard's values (a tensor in memory; `UnitBucket` may read them from a file)."""
        return self.shard()

    def write_shard(self, value: torch.Tensor, asynchronous: bool = False) -> None:
        """New values for this rank's shard; `asynchronous`: a copy between pinned host memory and
        the device may run on the stream."""
        shard = self.shard()
        if value.data_ptr() == shard.data_ptr():
            return
        shard.copy_(value, non_blocking=asynchronous and (shard.is_pinned() or value.is_pinned()))

    @contextlib.contextmanager
    def whole(self, collective, what: str) -> Iterator[torch.Tensor]:
        """The full buffer: whole on every rank already (stages 0-2, and stage 3's persistent
        buckets, republished after each step); `UnitBucket` gathers it."""
        yield self.data

    def zeros_like_data(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed buffer of the bucket's full (padded) size."""
        return torch.zeros(self.layout.padded_numel, dtype=dtype or self.dtype, device=self.device)
