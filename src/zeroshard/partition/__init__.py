"""Flat bucket storage and views; layout maths as pure functions; the memory ledger.

Names are imported on first use (PEP 562), so the estimator and the command line can use
`zeroshard.partition.layout` (no torch) without loading the storage modules."""

from __future__ import annotations

import importlib

_HOMES = {
    "FlatBucket": "flat_bucket", "slot_views": "flat_bucket",
    "BucketLayout": "layout", "ParamInfo": "layout", "Slot": "layout", "chunk_ranges": "layout",
    "padded_size": "layout", "plan_buckets": "layout",
    "CATEGORIES": "memory", "MemoryLedger": "memory",
}

__all__ = ["CATEGORIES", "BucketLayout", "FlatBucket", "MemoryLedger", "ParamInfo", "Slot",
           "chunk_ranges", "padded_size", "plan_buckets", "slot_views"]


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'zeroshard.partition' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"zeroshard.partition.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
