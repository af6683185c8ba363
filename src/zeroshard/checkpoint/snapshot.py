"""What a live engine saves: the tensors of one rank's file and the model's name table.

Read-only over the engine's `TrainState` (stages/train_state.py: `buckets`,
`frozen_buckets`, `optimizer`, `module`, `rank`), never over the Engine itself.

At stage 3 a released parameter keeps its true shape but its data is one NaN expanded
to that shape: values are never read through the module there. Trainable parameters
are saved from the fp32 masters of `ts.buckets`, and the frozen parameters of units
from each rank's at-rest shard of `ts.frozen_buckets` (field `value`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from zeroshard.checkpoint.files import Entry
from zeroshard.checkpoint.format import BucketRecord, bucket_key, bucket_record, json_safe, module_key
from zeroshard import faults
from zeroshard.policies import CheckpointError

# How an optimizer state of one master is stored and resharded.
ELEMENTWISE = "elementwise"  # one value per element of the master: resharded element by element
SCALAR = "scalar"  # a 0-dim tensor per shard (Adam's step): must agree where shards merge
OTHER = "other"  # any other tensor: loadable only into the identical shard
JSON = "json"  # a plain Python value: kept in the rank file's metadata
# one value per model tensor of an unsharded bucket, in slot order (OneBitLamb's coefficients: the
# optimizer names them in `per_tensor_states`): found again by tensor name in any bucket layout
PER_TENSOR = "per_tensor"


def state_kind(value: Any, master: torch.Tensor, per_tensor: bool = False) -> str:
    if not torch.is_tensor(value):
        return JSON
    if value.dim() == 0:
        return SCALAR
    if per_tensor and value.dim() == 1:
        return PER_TENSOR
    return ELEMENTWISE if value.numel() == master.numel() else OTHER


@dataclass
class NameTable:
    """Every state-dict name of the model, its shape and dtype, and which names are tied."""

    names: list[str]  # state-dict order, aliases included
    tensors: dict[str, dict[str, Any]]  # canonical name -> {"shape", "dtype", "trainable"}
    tied: dict[str, str]  # alias -> canonical name
    module_entries: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # not in buckets

    def to_json(self) -> dict[str, Any]:
        return {"names": self.names, "tensors": self.tensors, "tied": self.tied}


def name_table_of(ts) -> NameTable:
    return name_table(ts.module, ts.buckets, ts.frozen_buckets)


def name_table(module: torch.nn.Module, buckets, frozen=()) -> NameTable:
    """Tied tensors are found by identity in `state_dict(keep_vars=True)`: the first name
    seen is canonical (it is the name the buckets use), later ones are aliases. Parameters
    of `frozen` (stage-3 frozen unit buckets) are neither trainable nor module entries."""
    in_bucket = {id(p) for b in buckets for p in b.params}
    sharded = {id(p) for b in frozen for p in b.params}
    canonical: dict[int, str] = {}
    table = NameTable([], {}, {})
    for name, t in module.state_dict(keep_vars=True).items():
        table.names.append(name)
        if id(t) in canonical:
            table.tied[name] = canonical[id(t)]
            continue
        canonical[id(t)] = name
        trainable = id(t) in in_bucket
        table.tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype), "trainable": trainable}
        if not trainable and id(t) not in sharded:
            table.module_entries.append((name, t))
    return table


def model_config(module: torch.nn.Module) -> dict[str, Any] | None:
    """A transformers model's config as JSON, so an export loads with `from_pretrained`."""
    to_json = getattr(getattr(module, "config", None), "to_json_string", None)
    return None if to_json is None else json.loads(to_json(use_diff=False))


@dataclass
class RankFile:
    """The entries one rank writes (values, optimizer states), the buckets' records, and the
    optimizer state kinds."""

    entries: list[Entry]
    optim_entries: list[Entry]
    buckets: list[BucketRecord]
    shards: list[list[int]]  # [bucket, shard] pairs this rank wrote
    state_kinds: dict[str, str]
    json_states: dict[str, dict[str, Any]]  # bucket key -> {state: value}


def rank_file(ts, table: NameTable) -> RankFile:
    opt = ts.optimizer
    kinds: dict[str, str] = {}
    per_tensor = set(getattr(opt.optimizer, "per_tensor_states", ()))
    for b, master in enumerate(opt.masters):
        for name, value in opt.state.get(master, {}).items():
            kind = state_kind(value, master, name in per_tensor)
            if kinds.setdefault(name, kind) != kind:
                raise CheckpointError(f"optimizer state {name!r} has a different form in different shards "
                                      f"({kinds[name]} and {kind}); it cannot be checkpointed")
    # an optimizer may keep different states in different param groups (Muon: momentum_buffer for
    # matrices, AdamW's for the rest), never within one: each bucket records the states it has
    by_group: dict[int, set[str]] = {}
    for bucket, master in zip(ts.buckets, opt.masters):
        by_group.setdefault(bucket.layout.group, set()).update(opt.state.get(master, {}))
    fields = [("master",) + tuple(f"optim.{n}" for n, k in kinds.items()
                                  if k != JSON and n in by_group[bucket.layout.group]) for bucket in ts.buckets]
    entries: list[Entry] = []
    optim_entries: list[Entry] = []
    shards: list[list[int]] = []
    json_states: dict[str, dict[str, Any]] = {}
    frozen = list(ts.frozen_buckets)  # stage 3 only
    records = [bucket_record(bucket, fields[b], b) for b, bucket in enumerate(ts.buckets)]
    records += [bucket_record(bucket, ("value",), len(ts.buckets) + f) for f, bucket in enumerate(frozen)]
    for b, (bucket, master) in enumerate(zip(ts.buckets, opt.masters)):
        if bucket.shard_index != ts.rank:  # the lowest rank holding a shard writes it
            continue
        shards.append([b, bucket.shard_index])
        # values come through the optimizer: on the nvme tier each is read from its file when
        # the writer reaches it (one shard's tensor in memory at a time)
        entries.append(_lazy_entry(bucket_key(b, "master"), master, lambda b=b: opt.master_value(b)))
        state = opt.state.get(master, {})
        for name, kind in kinds.items():
            if name not in by_group[bucket.layout.group]:
                continue  # a state of another param group's kind
            if name not in state:
                raise CheckpointError(f"optimizer state {name!r} exists for some shards but not for bucket {b}")
            if kind == JSON:
                json_states.setdefault(f"bucket{b}", {})[name] = json_safe(state[name], f"optimizer state {name!r}")
            else:
                optim_entries.append(_lazy_entry(bucket_key(b, f"optim.{name}"), state[name],
                                                 lambda b=b, name=name: opt.state_value(b, name)))
    for f, bucket in enumerate(frozen):  # stage 3: the at-rest shard, in the compute dtype
        if bucket.shard_index != ts.rank:
            continue
        b = len(ts.buckets) + f
        shards.append([b, bucket.shard_index])
        entries.append(_lazy_entry(bucket_key(b, "value"), bucket.shard(),
                                   lambda bucket=bucket: bucket.read_shard()))  # nvme: read when written
    if ts.rank == 0:
        entries += [_entry(module_key(name), t) for name, t in table.module_entries]
    if entries:
        middle = len(entries) // 2
        entries[middle] = _paused(entries[middle])
    return RankFile(entries, optim_entries, records, shards, kinds, json_states)


def _entry(key: str, t: torch.Tensor) -> Entry:
    t = t.detach()
    flat = t.dim() > 0 and key.startswith("bucket")
    shape = (t.numel(),) if flat else tuple(t.shape)
    return Entry(key, shape, t.dtype, (lambda: t.reshape(-1)) if flat else (lambda: t))


def _lazy_entry(key: str, like: torch.Tensor, value: Callable[[], torch.Tensor]) -> Entry:
    """An entry shaped like `like` whose tensor `value()` gives only when it is written."""
    e = _entry(key, like)
    return Entry(e.key, e.shape, e.dtype, lambda: _entry(key, value()).produce())


def _paused(e: Entry) -> Entry:
    def produce():
        faults.pause("rank_file")  # half of this rank's file is on disk
        return e.produce()
    return Entry(e.key, e.shape, e.dtype, produce)
