"""What a checkpoint holds, as plain data: layout, step, sizes, and checksums verified."""

from __future__ import annotations

import os
from typing import Any

from zeroshard.checkpoint.deepspeed_reader import find_deepspeed_tag, open_checkpoint, summary as deepspeed_summary
from zeroshard.policies import CheckpointError


def inspect(ckpt_dir: str | os.PathLike, tag: str | None = None, verify: bool = True) -> dict[str, Any]:
    """A report of the checkpoint; each file's `check` is "ok" or the problem found. A folder
    DeepSpeed wrote gets the same report ("format": "deepspeed"; files checked by CRC-32)."""
    if find_deepspeed_tag(ckpt_dir, tag) is not None:
        return deepspeed_summary(ckpt_dir, tag, verify)
    with open_checkpoint(ckpt_dir, tag) as reader:  # (its error also says it is not a DeepSpeed one)
        meta = reader.meta
        files = []
        for name, info in sorted(meta["files"].items()):
            try:
                if verify:
                    reader.verify([name])
                check = "ok" if verify else "not checked"
            except CheckpointError as exc:
                check = str(exc)
            files.append({"file": name, "rank": info["rank"], "bytes": info["bytes"],
                          "sha256": info["sha256"], "check": check})
        buckets = [{"bucket": b.index, "dtype": b.dtype.replace("torch.", ""), "group": b.group,
                    "params": len(b.slots), "numel": sum(s.numel for s in b.slots),
                    "padded_numel": b.padded_numel, "shards": b.shard_count,
                    "fields": [f for f in b.fields]} for b in reader.buckets]
        trainable = sum(b["numel"] for b in buckets if "master" in b["fields"])  # not stage-3 frozen units
        total = sum(reader.numel(n) for n in reader.tensors)
        return {
            "dir": reader.dir, "tag": meta["tag"], "world_size": meta["world_size"], "stage": meta["stage"],
            "global_steps": meta["global_steps"], "skipped_steps": meta["skipped_steps"],
            "compute_dtype": meta["compute_dtype"].replace("torch.", ""),
            "optimizer": meta["optimizer"]["class"], "optimizer_states": meta["optimizer"]["states"],
            "lr_scheduler": (meta.get("lr_scheduler") or {}).get("class"),
            "parameters": total, "trainable_parameters": trainable, "tied": meta["tied"],
            "buckets": buckets, "files": files, "bytes": sum(f["bytes"] for f in files),
            "ok": all(f["check"] in ("ok", "not checked") for f in files),
        }
