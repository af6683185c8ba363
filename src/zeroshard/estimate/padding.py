"""The engine's bucket and padding rule, as arithmetic on a list of parameter sizes.

zeroshard's engine (stages 0-2) packs the trainable parameters, last first, into
buckets of at most `reduce_bucket_size` elements (a larger parameter gets a bucket of
its own; parameters are never split) and pads each bucket at its end to a multiple of
`shard_count x alignment`, where

    shard_count = 1 at stage 0 (nothing is sharded), N at stages 1, 2 (and 3)
    alignment   = 16 bytes / itemsize of the compute dtype (4 elements fp32, 8 bf16/fp16)

and never below one such unit. Every rank owns `padded / shard_count` elements of each
bucket. Collectives move whole padded buckets, so the exact element counts of
`comm_stats()` are sums of padded sizes, and the sharded states are sums of shards.

The rules are `zeroshard.partition.layout`'s, the functions the engine packs and pads its
buckets with; this module applies them to parameter sizes alone (no tensors, no engine),
and `tests/test_estimate_validation.py` checks the figures against a real engine. Assumes one dtype and one optimizer param group (the engine never mixes them in
a bucket; with several groups, plan each group's parameters separately and add).
Without a parameter list, `estimate_memory` / `estimate_comm` treat the model as
Φ elements split evenly (`ceil(Φ / N)` per rank): the padding they then ignore is
below `buckets x N x alignment` elements, a few KB for any real model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from zeroshard.partition import layout
from zeroshard.partition.layout import ALIGN_BYTES, offload_split, padded_size  # noqa: F401  (re-exported)
from zeroshard.policies import ConfigError, Precision, Stage

from zeroshard.estimate.byte_units import bytes_of

__all__ = [
    "ALIGN_BYTES", "BucketPlan", "bucket_numels", "padded_size", "plan_layout", "sub_group_sums", "offload_split",
    "plan_stage3_layout",
]


def bucket_numels(param_numels: Sequence[int], bucket_elements: int) -> list[int]:
    """Elements of each bucket, in bucket order (`partition.layout.pack`): parameters taken
    last first, a bucket closed when the next parameter would overflow it; a parameter
    larger than the cap sits alone."""
    if bucket_elements <= 0:
        raise ConfigError(f"reduce_bucket_size must be positive, got {bucket_elements}")
    numels = list(param_numels)
    for numel in reversed(numels):
        if numel < 0:
            raise ConfigError(f"parameter sizes must not be negative, got {numel}")
    return [sum(numels[i] for i in members) for members in layout.pack(numels, bucket_elements)]


def sub_group_sums(sizes: Sequence[int], cap: int) -> list[int]:
    """The sum of each of the optimizer's sub-groups (`partition.layout.sub_groups`)."""
    return [sum(sizes[i] for i in group) for group in layout.sub_groups(sizes, cap)]


@dataclass(frozen=True)
class BucketPlan:
    """Per bucket: parameter elements, padded elements; and how many ways it is split."""

    numels: tuple[int, ...]
    padded: tuple[int, ...]
    shard_count: int

    @property
    def buckets(self) -> int:
        return len(self.numels)

    @property
    def numel(self) -> int:
        return sum(self.numels)

    @property
    def padded_total(self) -> int:
        return sum(self.padded)

    @property
    def padding(self) -> int:
        return self.padded_total - self.numel

    @property
    def shards(self) -> tuple[int, ...]:
        return tuple(p // self.shard_count for p in self.padded)

    @property
    def shard_total(self) -> int:
        return sum(self.shards)

    @property
    def largest_padded(self) -> int:
        return max(self.padded, default=0)


def plan_layout(param_numels: Sequence[int], stage: Stage | int, precision: Precision | str, n: int,
                reduce_bucket_size: int) -> BucketPlan:
    """The engine's buckets for these trainable parameter sizes (module order, tied
    parameters once, frozen ones left out)."""
    if n < 1:
        raise ConfigError(f"data-parallel size must be >= 1, got {n}")
    count = layout.shard_count_for(stage, n)
    align = layout.alignment_for(bytes_of(precision))
    numels = bucket_numels(param_numels, reduce_bucket_size)
    return BucketPlan(tuple(numels), tuple(padded_size(b, count, align) for b in numels), count)


def plan_stage3_layout(unit_numels: Sequence[int], precision: Precision | str, n: int) -> BucketPlan:
    """Stage 3: each gather unit's trainable parameters are one bucket (in unit order), padded
    like any bucket to a multiple of N x alignment."""
    if n < 1:
        raise ConfigError(f"data-parallel size must be >= 1, got {n}")
    align = layout.alignment_for(bytes_of(precision))
    return BucketPlan(tuple(unit_numels), tuple(padded_size(u, n, align) for u in unit_numels), n)
