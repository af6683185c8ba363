"""The two ways in: `open_checkpoint` (zeroshard's own reader or DeepSpeed's, whichever the
folder is) and `summary` (what `zeroshard inspect` prints of a DeepSpeed folder)."""

from __future__ import annotations

import math
import os
from typing import Any

from zeroshard.checkpoint.deepspeed_reader.files import FORMAT, find_deepspeed_tag
from zeroshard.checkpoint.deepspeed_reader.reader import DeepSpeedCheckpoint
from zeroshard.policies import CheckpointError


def open_checkpoint(path: str | os.PathLike, tag: str | None = None):
    """A reader of the checkpoint at `path`: zeroshard's own (`CheckpointReader`), or one
    DeepSpeed wrote (`DeepSpeedCheckpoint`)."""
    if find_deepspeed_tag(path, tag) is not None:
        return DeepSpeedCheckpoint(path, tag)
    from zeroshard.checkpoint.reader import CheckpointReader

    try:
        return CheckpointReader(path, tag)
    except CheckpointError as exc:
        if "not a zeroshard checkpoint" not in str(exc):
            raise
        raise CheckpointError(f"{exc}; nor is it a checkpoint DeepSpeed wrote (no *_model_states.pt or "
                              "*_optim_states.pt files there or in the tag 'latest' names)") from None


def summary(path: str | os.PathLike, tag: str | None = None, verify: bool = True) -> dict[str, Any]:
    """`zeroshard inspect`'s report of a DeepSpeed checkpoint (the keys of a zeroshard one's,
    plus "format" and "deepspeed_version"); each file's check is its zip records' CRC-32."""
    with DeepSpeedCheckpoint(path, tag) as reader:
        meta = reader.meta
        files = []
        for name, info in sorted(meta["files"].items(), key=lambda kv: (kv[1]["rank"], kv[0])):
            try:
                if verify:
                    reader.verify([name])
                check = "ok" if verify else "not checked"
            except CheckpointError as exc:
                check = str(exc)
            files.append({"file": name, "rank": info["rank"], "bytes": info["bytes"], "sha256": "", "check": check})
        buckets = []
        for i, g in enumerate(reader.groups):
            numel = sum(math.prod(int(d) for d in s) for _, s in g)
            if reader.stage == 3:
                padded = sum(math.ceil(math.prod(int(d) for d in s) / reader.world_size) for _, s in g) * reader.world_size
            else:
                padded = reader.partition_sizes[i] * reader.world_size
            buckets.append({"bucket": i, "dtype": str(reader.compute_dtype).replace("torch.", ""), "group": i,
                            "params": len(g), "numel": numel, "padded_numel": padded, "shards": reader.world_size,
                            "fields": ["master"] + [f"optim.{k}" for k in meta["optimizer"]["states"]]})
        total = sum(reader.numel(n) for n in reader.tensors)
        return {
            "format": FORMAT, "deepspeed_version": meta["deepspeed_version"],
            "dir": reader.dir, "tag": meta["tag"], "world_size": meta["world_size"], "stage": meta["stage"],
            "global_steps": meta["global_steps"], "skipped_steps": meta["skipped_steps"],
            "compute_dtype": meta["compute_dtype"].replace("torch.", ""),
            "optimizer": meta["optimizer"]["class"], "optimizer_states": meta["optimizer"]["states"],
            "lr_scheduler": (meta.get("lr_scheduler") or {}).get("class"),
            "parameters": total, "trainable_parameters": sum(b["numel"] for b in buckets), "tied": meta["tied"],
            "buckets": buckets, "files": files, "bytes": sum(f["bytes"] for f in files),
            "ok": all(f["check"] in ("ok", "not checked") for f in files),
        }
