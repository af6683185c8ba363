"""The on-disk format: names of files and tensors, and the layout record in `meta.json`.

A checkpoint directory holds tags; each tag is a directory:

    save_dir/
      latest                      the tag to load by default (written last, atomically)
      global_step40/
        meta.json                 layout, step, config, scheduler, scaler, RNG, sha256 of files
        rank00000.model.safetensors   rank 0's parameter values (fp32 masters, frozen, buffers)
        rank00000.optim.safetensors   rank 0's optimizer states
        rank00001.model.safetensors   ...

Rank files hold flat 1-D tensors named `bucket{b}.{field}`: this rank's shard of
bucket b, where field is `master` (fp32 parameter values), `value` (a shard of
parameters without optimizer state: the frozen parameters of stage-3 units, in the
compute dtype) or `optim.{state}`
(an optimizer state shaped like the master; 0-dim ones are per-shard scalars such as
Adam's `step`), the last in the rank's `.optim` file. Whole tensors kept on every rank (frozen parameters and buffers at
stages 0-2; buffers and frozen parameters outside units at stage 3) are `module.{name}`
in rank 0's file, in their own shape and dtype. A stage-3 checkpoint numbers its buckets:
trainable ones first (unit buckets, then persistent whole-parameter buckets), then the
frozen unit buckets.

Everything needed to find an element of any parameter is in `meta.json`: for every
bucket its slots (name, shape, offset), padded size, shard count and which rank file
holds each shard. That is what lets any saved layout load into any other.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from zeroshard.policies import CheckpointError

FORMAT = "zeroshard-checkpoint"
VERSION = 1
META = "meta.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"  # a tag being written; never loaded, removed by the next save
OLD_PREFIX = ".old-"  # a tag being replaced by a save under the same name

_TAG_OK = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def rank_file(rank: int, field: str = "value") -> str:
    """The file of `rank` holding `field`: optimizer states apart from values, so exports and
    weights-only loads read (and verify) a third of the bytes of an Adam checkpoint."""
    return f"rank{rank:05d}.{'optim' if field.startswith('optim') else 'model'}.safetensors"


def bucket_key(bucket: int, field: str) -> str:
    return f"bucket{bucket}.{field}"


def module_key(name: str) -> str:
    return f"module.{name}"


def dtype_code(dtype: torch.dtype) -> str:
    """safetensors' dtype code ("F32", "BF16", ...)."""
    try:
        return _DTYPES[dtype]
    except KeyError:
        raise CheckpointError(f"cannot store tensors of dtype {dtype} (supported: "
                              f"{', '.join(str(d) for d in _DTYPES)})") from None


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not _TAG_OK.match(tag) or tag == LATEST:
        raise CheckpointError(f"tag {tag!r} is not a valid checkpoint tag: use letters, digits, '_', '.', '-' "
                              f"(not starting with '.' or '-', and not {LATEST!r})")
    return tag


# -- the layout record --------------------------------------------------------------------------
@dataclass(frozen=True)
class SlotRecord:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class BucketRecord:
    """One bucket as saved: enough to find any parameter element among the rank files."""

    index: int
    dtype: str  # compute dtype of the parameters, e.g. "torch.bfloat16"
    group: int  # optimizer param group
    slots: tuple[SlotRecord, ...]
    padded_numel: int
    shard_count: int
    holders: tuple[int, ...]  # holders[s]: the rank whose file has shard s
    fields: tuple[str, ...]  # "master" or "value", then "optim.<state>" ...

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.shard_count

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """Bucket elements [lo, hi) as (shard, start, end) runs, each inside one shard."""
        size = self.shard_numel
        while lo < hi:
            end = min(hi, (lo // size + 1) * size)
            yield lo // size, lo, end
            lo = end

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "dtype": self.dtype, "group": self.group,
                "padded_numel": self.padded_numel, "shard_count": self.shard_count,
                "holders": list(self.holders), "fields": list(self.fields),
                "slots": [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in self.slots]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "BucketRecord":
        slots = tuple(SlotRecord(s["name"], tuple(s["shape"]), int(s["offset"])) for s in d["slots"])
        return cls(int(d["index"]), d["dtype"], int(d["group"]), slots, int(d["padded_numel"]),
                   int(d["shard_count"]), tuple(int(r) for r in d["holders"]), tuple(d["fields"]))


def bucket_record(bucket, fields: tuple[str, ...], index: int) -> BucketRecord:
    """The record of a live FlatBucket or stage-3 UnitBucket, as bucket `index` of the
    checkpoint (shard s is written by rank s, or rank 0 when unsharded). The index is the
    bucket's position in the checkpoint, not `layout.index`: stage-3 units number their
    buckets from 0 each."""
    lay = bucket.layout
    slots = tuple(SlotRecord(s.name, tuple(s.shape), s.offset) for s in lay.slots)
    return BucketRecord(index, str(bucket.dtype), lay.group, slots, lay.padded_numel,
                        lay.shard_count, tuple(range(lay.shard_count)), fields)


# -- JSON that refuses to guess ------------------------------------------------------------------
def json_safe(value: Any, what: str) -> Any:
    """`value` as plain JSON types, or a CheckpointError naming the first offending entry.

    Tuples become lists; tensors of one element become numbers; nothing is pickled."""
    def walk(v: Any, path: str) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, dict):
            out = {}
            for k, item in v.items():
                if not isinstance(k, str):
                    raise CheckpointError(f"{what} is not JSON-serialisable: key {k!r} at {path or 'top level'} "
                                          "is not a string")
                out[k] = walk(item, f"{path}.{k}" if path else k)
            return out
        if isinstance(v, (list, tuple)):
            return [walk(item, f"{path}[{i}]") for i, item in enumerate(v)]
        if torch.is_tensor(v) and v.numel() == 1 and what != "client_state":
            return v.item()
        raise CheckpointError(f"{what} is not JSON-serialisable: {path or 'the value'} is a {type(v).__name__}. "
                              "Checkpoints store it as JSON and never pickle; convert it to numbers, "
                              "strings, lists and dicts (tensors belong in the model or optimizer)")
    return walk(value, "")


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, indent=1, sort_keys=False, allow_nan=True).encode()


META_SHA256 = "meta_sha256"


def meta_checksum(meta: dict[str, Any]) -> str:
    """sha256 of `meta` as written, without its own checksum key. JSON written by `dumps`
    reads back to the same bytes, so the sum can be checked on every read."""
    return hashlib.sha256(dumps({k: v for k, v in meta.items() if k != META_SHA256})).hexdigest()


def seal_meta(meta: dict[str, Any]) -> dict[str, Any]:
    """`meta` with its checksum (the last key): an edit by hand is then seen on every read."""
    sealed = {k: v for k, v in meta.items() if k != META_SHA256}
    sealed[META_SHA256] = meta_checksum(sealed)
    return sealed


def train_state_of(obj):
    """The `TrainState` checkpoints read: an Engine's, or one given directly."""
    return getattr(obj, "train_state", obj)
