"""Defaults chosen for the model at hand where the user's config is silent.

DeepSpeed's bucket defaults (`reduce_bucket_size` and `allgather_bucket_size` 5e8 elements)
are tuned for very large GPU models: a 48M-parameter model becomes one bucket, so no
reduction overlaps backward and the whole gradient buffer is alive at once (stage 2 then
holds as much gradient memory as plain DP at its peak). Where the user wrote no value,
zeroshard uses DDP's bucket rule instead (25 MiB of the dtype that is reduced) and at most a
quarter of the model, so backward always has buckets to overlap; a key the user wrote (a
number, or "auto") is honoured as written. Pure: settings in, settings and notes out.
"""

from __future__ import annotations

import dataclasses

from zeroshard.policies import Settings

BUCKET_BYTES = 25 * 2**20  # torch DDP's bucket_cap_mb default
MIN_BUCKET = 2**18  # below this, per-collective latency dominates


def bucket_elements(trainable: int, itemsize: int) -> int:
    return max(1, min(BUCKET_BYTES // itemsize, max(MIN_BUCKET, trainable // 4)))


def choose_for_model(settings: Settings, trainable: int) -> Settings:
    """`settings` with the bucket sizes the user left out chosen for `trainable` elements."""
    zero = settings.raw.get("zero_optimization")
    written = set(zero) if isinstance(zero, dict) else set()
    itemsize = settings.precision.reduce.dtype.itemsize
    size = bucket_elements(trainable, itemsize)
    changes = {key: size for key in ("reduce_bucket_size", "allgather_bucket_size")
               if key not in written and getattr(settings.zero, key) != size}
    if not changes:
        return settings
    dtype = str(settings.precision.reduce.dtype).replace("torch.", "")
    if size == BUCKET_BYTES // itemsize:
        rule = f"25 MiB of {dtype}, DDP's bucket cap, for {trainable:,} trainable parameters"
    elif size == MIN_BUCKET:
        rule = (f"the floor of {MIN_BUCKET:,} elements below which a collective's latency dominates; the "
                f"{trainable:,} trainable parameters fit in {max(1, -(-trainable // size))} bucket(s)")
    else:
        rule = f"a quarter of the {trainable:,} trainable parameters, under DDP's 25 MiB cap"
    note = (f"{' and '.join(changes)} not set: {size:,} elements ({rule}) so reduction overlaps backward; "
            "DeepSpeed's default 5e8 would make this model one bucket. Write the key to choose yourself")
    return dataclasses.replace(settings, zero=dataclasses.replace(settings.zero, **changes),
                               notes=(*settings.notes, note))
