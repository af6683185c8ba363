"""Bucket layout as pure data: which parameter sits where, padding, and who owns what.

No tensors here, so every rule is testable without processes. A bucket holds whole
parameters of one dtype and one optimizer param group, packed back to back, padded
at the end so it splits into `shard_count` equal, aligned shards; shard r is rank r's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class ParamInfo:
    """What the layout needs to know about a parameter."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # e.g. "torch.bfloat16"; only compared for equality
    group: int = 0  # optimizer param group

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Slot:
    """Parameter `index` (into the planned list) occupies [offset, offset + numel) of its bucket."""

    index: int
    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketLayout:
    index: int
    dtype: str
    group: int
    slots: tuple[Slot, ...]
    numel: int  # elements of parameters
    padded_numel: int  # numel + padding; a multiple of shard_count * alignment
    shard_count: int

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.shard_count

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel

    def shard_range(self, shard: int) -> tuple[int, int]:
        start = shard * self.shard_numel
        return start, start + self.shard_numel

    def slot_in_shard(self, slot: Slot, shard: int) -> tuple[int, int] | None:
        """The part of `slot` inside shard `shard`, as bucket offsets, or None."""
        lo, hi = self.shard_range(shard)
        start, end = max(slot.offset, lo), min(slot.end, hi)
        return (start, end) if start < end else None


def padded_size(numel: int, shard_count: int, alignment: int) -> int:
    """Smallest size >= numel that splits into `shard_count` shards of a multiple of `alignment`."""
    unit = shard_count * alignment
    return max(unit, -(-numel // unit) * unit)


def plan_buckets(
    params: Sequence[ParamInfo],
    bucket_numel: int,
    shard_count: int,
    alignment: int = 1,
) -> tuple[BucketLayout, ...]:
    """Pack `params` into buckets of at most `bucket_numel` elements.

    Parameters are taken in reverse order, because backward produces gradients
    roughly last-layer-first: the first bucket fills first and its reduction can
    start while backward still runs. A parameter larger than `bucket_numel` gets a
    bucket of its own (parameters are never split, so each stays one view).
    Buckets never mix dtypes or param groups.
    """
    if bucket_numel <= 0 or shard_count <= 0 or alignment <= 0:
        raise ValueError("bucket_numel, shard_count and alignment must be positive")
    open_slots: dict[tuple[str, int], list[Slot]] = {}
    open_numel: dict[tuple[str, int], int] = {}
    done: list[tuple[str, int, list[Slot], int]] = []
    for index in reversed(range(len(params))):
        p = params[index]
        key = (p.dtype, p.group)
        slots, used = open_slots.setdefault(key, []), open_numel.get(key, 0)
        if slots and used + p.numel > bucket_numel:
            done.append((*key, slots, used))
            slots, used = [], 0
            open_slots[key] = slots
        slots.append(Slot(index, p.name, tuple(p.shape), used, p.numel))
        open_numel[key] = used + p.numel
    done.extend((*key, slots, open_numel[key]) for key, slots in open_slots.items() if slots)
    return tuple(
        BucketLayout(i, dtype, group, tuple(slots), numel,
                     padded_size(numel, shard_count, alignment), shard_count)
        for i, (dtype, group, slots, numel) in enumerate(done)
    )


def chunk_ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    """[0, total) cut into consecutive ranges of at most `chunk` elements."""
    chunk = max(1, chunk)
    return [(s, min(s + chunk, total)) for s in range(0, total, chunk)]


def offload_split(sizes: Sequence[int], ratio: float) -> list[bool]:
    """Which items (bucket shards, in order) `offload_optimizer.ratio` sends to the offload
    tier: the first ones, whole items only, each taken while the offloaded elements up to its
    middle stay within `ratio` of the total. The engine and the estimator both use this."""
    total, taken, out = sum(sizes), 0, []
    for size in sizes:
        goes = ratio >= 1.0 or (total > 0 and taken + size / 2 <= ratio * total)
        out.append(goes)
        taken += size if goes else 0
    return out
