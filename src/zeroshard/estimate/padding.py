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

This module restates the rule from the engine's documented behaviour (it does not
import the engine), so `tests/test_estimate_validation.py` can check both against each
other. Assumes one dtype and one optimizer param group (the engine never mixes them in
a bucket; with several groups, plan each group's parameters separately and add).
Without a parameter list, `estimate_memory` / `estimate_comm` treat the model as
Φ elements split evenly (`ceil(Φ / N)` per rank): the padding they then ignore is
below `buckets x N x alignment` elements, a few KB for any real model.
"""

from __future__ import annotations

from zeroshard.partition.layout import offload_split  # noqa: F401  (re-exported for the estimator)

from dataclasses import dataclass
from typing import Sequence

from zeroshard.policies import ConfigError, Precision, Stage

__all__ = [
    "ALIGN_BYTES", "BucketPlan", "alignment_for", "bucket_numels", "padded_size", "plan_layout",
    "shard_count_for_stage", "sub_group_sums", "gather_chunks", "offload_split", "plan_stage3_layout",
]

ALIGN_BYTES = 16  # each shard starts on a 16-byte boundary (vectorised kernels, NCCL)
_ITEMSIZE = {Precision.FP32: 4, Precision.BF16: 2, Precision.FP16: 2}


def alignment_for(precision: Precision | str) -> int:
    """Elements per alignment unit: 4 for fp32, 8 for bf16 / fp16."""
    return max(1, ALIGN_BYTES // _ITEMSIZE[Precision(precision)])


def shard_count_for_stage(stage: Stage | int, n: int) -> int:
    """Ways each bucket is split: stage 0 keeps everything whole on every rank."""
    return 1 if Stage(stage) == Stage.DATA_PARALLEL else n


def padded_size(numel: int, shard_count: int, alignment: int) -> int:
    """Smallest size >= numel (and >= one unit) that is a multiple of shard_count x alignment."""
    unit = shard_count * alignment
    return max(unit, -(-numel // unit) * unit)


def bucket_numels(param_numels: Sequence[int], bucket_elements: int) -> list[int]:
    """Elements of each bucket, in bucket order: parameters taken last first, a bucket
    closed when the next parameter would overflow it; a parameter larger than the cap
    sits alone."""
    if bucket_elements <= 0:
        raise ConfigError(f"reduce_bucket_size must be positive, got {bucket_elements}")
    out: list[int] = []
    used, open_ = 0, False
    for numel in reversed(list(param_numels)):
        if numel < 0:
            raise ConfigError(f"parameter sizes must not be negative, got {numel}")
        if open_ and used + numel > bucket_elements:
            out.append(used)
            used = 0
        used, open_ = used + numel, True
    if open_:
        out.append(used)
    return out


def sub_group_sums(sizes: Sequence[int], cap: int) -> list[int]:
    """The optimizer steps consecutive shards in sub-groups of at most `cap` elements
    (a larger one alone): the sum of each sub-group."""
    out: list[int] = []
    for size in sizes:
        if not out or out[-1] + size > cap:
            out.append(0)
        out[-1] += size
    return out


def gather_chunks(shard_numel: int, padded_numel: int, cap: int, n: int) -> int:
    """All-gather calls to publish one bucket: one when its padded size fits
    `allgather_bucket_size`, else one per chunk of `cap // n` elements of each shard (each
    gathered straight into place: no staging buffer)."""
    if padded_numel <= cap:
        return 1
    return -(-shard_numel // max(1, cap // n))


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
    count = shard_count_for_stage(stage, n)
    align = alignment_for(precision)
    numels = bucket_numels(param_numels, reduce_bucket_size)
    return BucketPlan(tuple(numels), tuple(padded_size(b, count, align) for b in numels), count)


def plan_stage3_layout(unit_numels: Sequence[int], precision: Precision | str, n: int) -> BucketPlan:
    """Stage 3: each gather unit's trainable parameters are one bucket (in unit order), padded
    like any bucket to a multiple of N x alignment."""
    if n < 1:
        raise ConfigError(f"data-parallel size must be >= 1, got {n}")
    align = alignment_for(precision)
    return BucketPlan(tuple(unit_numels), tuple(padded_size(u, n, align) for u in unit_numels), n)
