"""Flat bucket storage and views; layout maths as pure functions; the memory ledger.

Names are imported on first use (PEP 562), so the estimator and the command line can use
`zeroshard.partition.layout` (no torch) without loading the storage modules."""

from __future__ import annotations

from zeroshard.lazy_exports import lazy_exports

_HOMES = {
    **dict.fromkeys(("FlatBucket", "slot_views"), "zeroshard.partition.flat_bucket"),
    **dict.fromkeys(("BucketLayout", "ParamInfo", "Slot", "chunk_ranges", "padded_size", "plan_buckets"),
                    "zeroshard.partition.layout"),
    **dict.fromkeys(("CATEGORIES", "MemoryLedger"), "zeroshard.partition.memory"),
}

__all__ = ["CATEGORIES", "BucketLayout", "FlatBucket", "MemoryLedger", "ParamInfo", "Slot",
           "chunk_ranges", "padded_size", "plan_buckets", "slot_views"]


__getattr__, __dir__ = lazy_exports(__name__, globals(), _HOMES)
