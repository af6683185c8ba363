"""What a checkpoint holds, as plain data: layout, step, sizes, and checksums verified."""

from __future__ import annotations

import math
import os
from typing import Any

from zeroshard.checkpoint.deepspeed_reader import find_deepspeed_tag, open_checkpoint, open_deepspeed
from zeroshard.checkpoint.deepspeed_reader.files import FORMAT as DEEPSPEED_FORMAT
from zeroshard.policies import CheckpointError


def inspect(ckpt_dir: str | os.PathLike, tag: str | None = None, verify: bool = True) -> dict[str, Any]:
    """A report of the checkpoint; each file's `check` is "ok" or the problem found. A folder
    DeepSpeed wrote gets the same report ("format": "deepspeed"; files checked by CRC-32)."""
    if find_deepspeed_tag(ckpt_dir, tag) is not None:
        return _deepspeed_report(ckpt_dir, tag, verify)
    with open_checkpoint(ckpt_dir, tag) as reader:  # (its error also says it is not a DeepSpeed one)
        buckets = [{"bucket": b.index, "dtype": b.dtype.replace("torch.", ""), "group": b.group,
                    "params": len(b.slots), "numel": sum(s.numel for s in b.slots),
                    "padded_numel": b.padded_numel, "shards": b.shard_count,
                    "fields": list(b.fields)} for b in reader.buckets]
        trainable = sum(b["numel"] for b in buckets if "master" in b["fields"])  # not stage-3 frozen units
        return _summary(reader, buckets, _file_rows(reader, verify), trainable)


def _summary(reader, buckets: list[dict[str, Any]], files: list[dict[str, Any]], trainable: int) -> dict[str, Any]:
    """The report's keys common to both kinds of checkpoint."""
    meta = reader.meta
    return {
        "dir": reader.dir, "tag": meta["tag"], "world_size": meta["world_size"], "stage": meta["stage"],
        "global_steps": meta["global_steps"], "skipped_steps": meta["skipped_steps"],
        "compute_dtype": meta["compute_dtype"].replace("torch.", ""),
        "optimizer": meta["optimizer"]["class"], "optimizer_states": meta["optimizer"]["states"],
        "lr_scheduler": (meta.get("lr_scheduler") or {}).get("class"),
        "parameters": sum(reader.numel(n) for n in reader.tensors), "trainable_parameters": trainable,
        "tied": meta["tied"], "buckets": buckets, "files": files, "bytes": sum(f["bytes"] for f in files),
        "ok": all(f["check"] in ("ok", "not checked") for f in files),
    }


def _file_rows(reader, verify: bool, by_rank: bool = False) -> list[dict[str, Any]]:
    """Each file of the checkpoint with its check: "ok", "not checked", or the problem found."""
    items = sorted(reader.meta["files"].items(), key=(lambda kv: (kv[1]["rank"], kv[0])) if by_rank else None)
    rows = []
    for name, info in items:
        try:
            if verify:
                reader.verify([name])
            check = "ok" if verify else "not checked"
        except CheckpointError as exc:
            check = str(exc)
        rows.append({"file": name, "rank": info["rank"], "bytes": info["bytes"], "sha256": info.get("sha256") or "",
                     "check": check})
    return rows


def _deepspeed_report(path: str | os.PathLike, tag: str | None, verify: bool) -> dict[str, Any]:
    """`zeroshard inspect`'s report of a DeepSpeed checkpoint (the keys of a zeroshard one's,
    plus "format" and "deepspeed_version"); each file's check is its zip records' CRC-32."""
    with open_deepspeed(path, tag) as reader:
        meta = reader.meta
        buckets = []
        for i, g in enumerate(reader.groups):
            numel = sum(math.prod(s) for _, s in g)  # shapes: tuples of int
            padded = reader.world_size * (sum(math.ceil(math.prod(s) / reader.world_size) for _, s in g)
                                          if reader.stage == 3 else reader.partition_sizes[i])
            buckets.append({"bucket": i, "dtype": str(reader.compute_dtype).replace("torch.", ""), "group": i,
                            "params": len(g), "numel": numel, "padded_numel": padded, "shards": reader.world_size,
                            "fields": ["master"] + [f"optim.{k}" for k in meta["optimizer"]["states"]]})
        return {"format": DEEPSPEED_FORMAT, "deepspeed_version": meta["deepspeed_version"],
                **_summary(reader, buckets, _file_rows(reader, verify, by_rank=True),
                           sum(b["numel"] for b in buckets))}
