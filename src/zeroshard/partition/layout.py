"""Bucket layout as pure data: which parameter sits where, padding, and who owns what.

No tensors here, so every rule is testable without processes. A bucket holds whole
parameters of one dtype and one optimizer param group, packed back to back, padded
at the end so it splits into `shard_count` equal, aligned shards; shard r is rank r's.

Each rule is written here once and read by both the engine and the estimator
(`zeroshard.estimate.padding`): packing, padding, alignment, the shard count of a stage,
the optimizer's sub-groups, publishing in chunks and the offload split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Sequence

from zeroshard.policies import Stage

ALIGN_BYTES = 16  # each shard starts on a 16-byte boundary (vectorised kernels, NCCL)


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


def alignment_for(itemsize: int) -> int:
    """Elements per alignment unit for a dtype of `itemsize` bytes: 4 for fp32, 8 for bf16 / fp16."""
    return max(1, ALIGN_BYTES // itemsize)


def shard_count_for(stage: Stage | int, world_size: int) -> int:
    """How many ways each bucket (and so the optimizer state) is split: stage 0 keeps it
    whole on every rank."""
    return 1 if Stage(stage) == Stage.DATA_PARALLEL else world_size


def padded_size(numel: int, shard_count: int, alignment: int) -> int:
    """Smallest size >= numel (and >= one unit) that splits into `shard_count` shards of a
    multiple of `alignment`."""
    unit = shard_count * alignment
    return max(unit, -(-numel // unit) * unit)


def pack(numels: Sequence[int], cap: int, keys: Sequence[Hashable] | None = None) -> list[list[int]]:
    """The indices of each bucket, in bucket order: items taken last first, each added to the
    open bucket of its key (`keys[i]`; one key when None) unless it would take that bucket
    over `cap` elements, which then closes. An item larger than `cap` sits alone. Closed
    buckets come first, in closing order, then the open ones by key, first seen first."""
    open_: dict[Hashable, tuple[list[int], int]] = {}
    done: list[list[int]] = []
    for index in reversed(range(len(numels))):
        key = keys[index] if keys is not None else None
        members, used = open_.get(key, ([], 0))
        if members and used + numels[index] > cap:
            done.append(members)
            members, used = [], 0
        members.append(index)
        open_[key] = (members, used + numels[index])
    done.extend(members for members, _ in open_.values())
    return done


def plan_buckets(params: Sequence[ParamInfo], bucket_numel: int, shard_count: int,
                 alignment: int = 1) -> tuple[BucketLayout, ...]:
    """Pack `params` into buckets of at most `bucket_numel` elements (`pack`).

    Parameters are taken in reverse order, because backward produces gradients
    roughly last-layer-first: the first bucket fills first and its reduction can
    start while backward still runs. A parameter larger than `bucket_numel` gets a
    bucket of its own (parameters are never split, so each stays one view).
    Buckets never mix dtypes or param groups.
    """
    if bucket_numel <= 0 or shard_count <= 0 or alignment <= 0:
        raise ValueError("bucket_numel, shard_count and alignment must be positive")
    layouts = []
    for i, members in enumerate(pack([p.numel for p in params], bucket_numel, [(p.dtype, p.group) for p in params])):
        slots, used = [], 0
        for index in members:
            p = params[index]
            slots.append(Slot(index, p.name, tuple(p.shape), used, p.numel))
            used += p.numel
        first = params[members[0]]
        layouts.append(BucketLayout(i, first.dtype, first.group, tuple(slots), used,
                                    padded_size(used, shard_count, alignment), shard_count))
    return tuple(layouts)


def sub_groups(sizes: Sequence[int], cap: int) -> list[list[int]]:
    """The optimizer steps consecutive shards in sub-groups of at most `cap` elements (a
    larger one alone): the indices of each sub-group."""
    out: list[list[int]] = []
    used = 0
    for i, size in enumerate(sizes):
        if not out or used + size > cap:
            out.append([])
            used = 0
        out[-1].append(i)
        used += size
    return out


def chunk_ranges(total: int, chunk: int) -> list[tuple[int, int]]:
    """[0, total) cut into consecutive ranges of at most `chunk` elements."""
    chunk = max(1, chunk)
    return [(s, min(s + chunk, total)) for s in range(0, total, chunk)]


def gather_ranges(shard_numel: int, padded_numel: int, cap: int, n: int) -> list[tuple[int, int]]:
    """Publishing a bucket (after the step): the range of each rank's shard that each all-gather
    call moves. One call for the whole bucket, [(0, shard_numel)], when its padded size fits
    `cap` (`allgather_bucket_size`); else one per chunk of `cap // n` elements of each shard,
    each gathered straight into place (no staging buffer)."""
    if padded_numel <= cap:
        return [(0, shard_numel)]
    return chunk_ranges(shard_numel, max(1, cap // n))


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
