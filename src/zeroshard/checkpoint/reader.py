"""Reading a checkpoint: find the tag, check meta.json and the files, read element ranges.

`CheckpointReader.read(name, field, lo, hi)` returns elements [lo, hi) of one
parameter's flattened value (or optimizer state), assembled from whichever rank
files hold them, reading only those ranges (`safe_open(...).get_slice`). Every load
and export goes through it, whatever the old and new layouts are.

Only JSON and safetensors are ever parsed: nothing is unpickled.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import torch
from safetensors import safe_open

from zeroshard.checkpoint.files import sha256_of
from zeroshard.checkpoint.format import (
    FORMAT, LATEST, META, META_SHA256, OLD_PREFIX, VERSION, BucketRecord, SlotRecord, bucket_key, meta_checksum,
    module_key, rank_file,
)
from zeroshard.policies import CheckpointError


def resolve(path: str | os.PathLike, tag: str | None = None) -> str:
    """The tag directory to load: `path/tag`, `path` itself if it is a tag, or `path/<latest>`."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if tag is None:
        if os.path.isfile(os.path.join(path, META)):
            return path
        latest = os.path.join(path, LATEST)
        if not os.path.isfile(latest):
            raise CheckpointError(f"{path}: not a zeroshard checkpoint directory (it has neither {META} "
                                  f"nor a {LATEST!r} file; pass the directory given to save_checkpoint "
                                  "or one of its tag directories)")
        with open(latest, encoding="utf-8", errors="replace") as f:
            tag = f.read().strip()
        if not tag:
            raise CheckpointError(f"{latest}: empty; it should name the newest tag")
    tag_dir = os.path.join(path, tag)
    if not os.path.isdir(tag_dir):
        old = os.path.join(path, OLD_PREFIX + tag)
        if os.path.isfile(os.path.join(old, META)):  # a save of the same tag was killed mid-swap
            return old
        raise CheckpointError(f"{tag_dir}: no such checkpoint tag in {path}")
    if not os.path.isfile(os.path.join(tag_dir, META)):
        raise CheckpointError(f"{tag_dir}: not a zeroshard checkpoint (no {META}); "
                              "an interrupted save never gets this far, so this directory is something else")
    return tag_dir


def read_meta(tag_dir: str) -> dict[str, Any]:
    path = os.path.join(tag_dir, META)
    try:
        with open(path, "rb") as f:
            meta = json.loads(f.read())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); the file is damaged or was replaced") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a zeroshard checkpoint description (no \"format\": \"{FORMAT}\")")
    if int(meta.get("version", 0)) > VERSION:
        raise CheckpointError(f"{path}: format version {meta['version']} is newer than this zeroshard "
                              f"reads ({VERSION}); upgrade zeroshard")
    recorded = meta.get(META_SHA256)  # checkpoints written before the checksum have none
    if recorded is not None and recorded != meta_checksum(meta):
        raise CheckpointError(f"{path}: its checksum does not match its contents: the file was edited or damaged "
                              "after the save; restore it from a copy, or use another checkpoint")
    return meta


class TensorIndex:
    """What every checkpoint reader answers from its `tensors` and `tied` tables, and its use
    in a `with` block (closed at the end)."""

    tensors: dict[str, dict[str, Any]]
    tied: dict[str, str]

    def canonical(self, name: str) -> str:
        return self.tied.get(name, name)

    def numel(self, name: str) -> int:
        return math.prod(int(d) for d in self.tensors[self.canonical(name)]["shape"])

    def holds(self, name: str, field: str) -> bool:
        """Whether `field` ("optim.<state>") was saved for trainable parameter `name`; a reader
        whose format keeps every state for every parameter says yes, and `read` names a gap."""
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class CheckpointReader(TensorIndex):
    def __init__(self, path: str | os.PathLike, tag: str | None = None) -> None:
        self.dir = resolve(path, tag)
        self.meta = read_meta(self.dir)
        self.meta_path = os.path.join(self.dir, META)
        try:
            self.buckets = [BucketRecord.from_json(b) for b in self.meta["buckets"]]
            self.tensors: dict[str, dict[str, Any]] = self.meta["tensors"]
            self.tied: dict[str, str] = self.meta["tied"]
            self.files: dict[str, dict[str, Any]] = self.meta["files"]
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{self.meta_path}: incomplete layout record ({type(exc).__name__}: {exc})") from None
        self.where: dict[str, tuple[BucketRecord, SlotRecord]] = {
            s.name: (b, s) for b in self.buckets for s in b.slots}
        self._open: dict[str, Any] = {}

    # -- checks ---------------------------------------------------------------------------------
    def verify(self, names: list[str] | None = None) -> None:
        """Check size and sha256 of the rank files (all, or `names`) against meta.json."""
        for name in self.files if names is None else names:
            self._check_file(name, hash_it=True)

    def _check_file(self, name: str, hash_it: bool) -> str:
        info = self.files.get(name)
        path = os.path.join(self.dir, name)
        if info is None:
            raise CheckpointError(f"{path}: not listed in {self.meta_path}")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing rank file (written by rank {info['rank']} of "
                                  f"{self.meta['world_size']}); the checkpoint is incomplete")
        size = os.path.getsize(path)
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes, but {META} records {info['bytes']}: the file is "
                                  f"{'truncated' if size < info['bytes'] else 'longer than written'}")
        if hash_it and sha256_of(path) != info["sha256"]:
            raise CheckpointError(f"{path}: sha256 differs from the one recorded in {META}: the file was "
                                  "altered or damaged after it was written")
        return path

    # -- reading --------------------------------------------------------------------------------
    def holds(self, name: str, field: str) -> bool:
        """Per bucket: an optimizer may keep different states in different param groups (Muon)."""
        saved = self.where.get(self.canonical(name))
        return saved is None or field in saved[0].fields

    def read(self, name: str, field: str = "value", lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Elements [lo, hi) of `name`'s flattened `field`: "value" (the fp32 master of a
        trainable parameter, else the saved tensor) or "optim.<state>"."""
        name = self.canonical(name)
        hi = self.numel(name) if hi is None else hi
        if name in self.where:
            bucket, slot = self.where[name]
            if field == "value":
                field = "master" if "master" in bucket.fields else "value"
            if field not in bucket.fields:
                raise CheckpointError(f"{self.meta_path}: {name!r} has no saved {field!r} "
                                      f"(saved: {', '.join(bucket.fields)})")
            return self._read_bucket(bucket, slot.offset + lo, slot.offset + hi, field)
        if name in self.tensors and field == "value":
            return self._get(rank_file(0, "value"), module_key(name)).reshape(-1)[lo:hi]
        raise CheckpointError(f"{self.meta_path}: {name!r} has no saved {field!r} (it is not a trainable "
                              "parameter in the checkpoint)" if name in self.tensors else
                              f"{self.meta_path}: no tensor named {name!r}")

    def scalars(self, name: str, field: str) -> list[torch.Tensor]:
        """The per-shard scalar `field` of every shard holding part of `name`."""
        bucket, slot = self.where[self.canonical(name)]
        runs = list(bucket.pieces(slot.offset, slot.end)) or [(slot.offset // bucket.shard_numel, 0, 0)]
        return [self._get(rank_file(bucket.holders[s], field), bucket_key(bucket.index, field)) for s, _, _ in runs]

    def any_scalar(self, group: int, field: str) -> torch.Tensor | None:
        """A scalar `field` from some shard of param group `group` (for a shard of pure padding)."""
        for b in sorted(self.buckets, key=lambda b: b.group != group):
            if field in b.fields:
                return self._get(rank_file(b.holders[0], field), bucket_key(b.index, field))
        return None

    def shard(self, bucket: int, shard: int, field: str) -> torch.Tensor:
        b = self.buckets[bucket]
        return self._get(rank_file(b.holders[shard], field), bucket_key(b.index, field))

    def json_states(self, bucket: int, shard: int) -> dict[str, Any]:
        f = self._file(rank_file(self.buckets[bucket].holders[shard], "optim"))
        return json.loads((f.metadata() or {}).get("json_states", "{}")).get(f"bucket{bucket}", {})

    def _read_bucket(self, bucket: BucketRecord, lo: int, hi: int, field: str) -> torch.Tensor:
        key = bucket_key(bucket.index, field)
        parts = [self._slice(rank_file(bucket.holders[s], field), key, a - s * bucket.shard_numel,
                             b - s * bucket.shard_numel) for s, a, b in bucket.pieces(lo, hi)]
        if len(parts) == 1:  # the common case: no copy beyond the read itself
            return parts[0]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)

    def _slice(self, file: str, key: str, lo: int, hi: int) -> torch.Tensor:
        f = self._file(file)
        try:
            return f.get_slice(key)[lo:hi]
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{os.path.join(self.dir, file)}: cannot read {key}[{lo}:{hi}] ({exc})") from None

    def _get(self, file: str, key: str) -> torch.Tensor:
        f = self._file(file)
        try:
            return f.get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{os.path.join(self.dir, file)}: cannot read {key} ({exc})") from None

    def _file(self, name: str):
        if name not in self._open:
            path = self._check_file(name, hash_it=False)
            try:
                self._open[name] = safe_open(path, framework="pt", device="cpu")
            except Exception as exc:
                raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); zeroshard reads only "
                                      "safetensors and JSON and never unpickles") from None
        return self._open[name]

    def close(self) -> None:
        self._open.clear()
