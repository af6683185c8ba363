"""Flat bucket storage and views; layout maths as pure functions; the memory ledger."""

from zeroshard.partition.flat_bucket import FlatBucket, slot_views
from zeroshard.partition.layout import (
    BucketLayout,
    ParamInfo,
    Slot,
    chunk_ranges,
    padded_size,
    plan_buckets,
)
from zeroshard.partition.memory import CATEGORIES, MemoryLedger

__all__ = ["CATEGORIES", "BucketLayout", "FlatBucket", "MemoryLedger", "ParamInfo", "Slot",
           "chunk_ranges", "padded_size", "plan_buckets", "slot_views"]
