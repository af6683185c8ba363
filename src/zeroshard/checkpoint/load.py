"""load_checkpoint: rebuild this rank's state, in the engine's layout, from any saved layout.

Each rank fills its own fp32 master shards and optimizer states element range by
element range from the recorded layout (`CheckpointReader.read`), whatever the saved
world size, stage and bucket sizes were; the same code runs when nothing changed.
Ranks agree after each phase, so a bad file on one rank fails every rank cleanly.

A folder DeepSpeed wrote is read the same way, through `DeepSpeedCheckpoint`
(checkpoint/deepspeed_reader), which maps DeepSpeed's flat partitions to parameters.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from zeroshard.checkpoint import rng
from zeroshard.checkpoint.format import train_state_of
from zeroshard.checkpoint.exchange import agreed
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.checkpoint.deepspeed_reader import DeepSpeedCheckpoint, open_checkpoint
from zeroshard.checkpoint.deepspeed_reader import resume as deepspeed_resume
from zeroshard.checkpoint.snapshot import ELEMENTWISE, JSON, OTHER, PER_TENSOR, SCALAR, name_table_of
from zeroshard.policies import CheckpointError

log = logging.getLogger("zeroshard")


def load_checkpoint(engine, load_dir: str | os.PathLike, tag: str | None = None,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True) -> dict[str, Any]:
    """Load a checkpoint saved by `save_checkpoint`, or a folder DeepSpeed wrote (any world
    size, stage, bucket sizes), into `engine`; call on every rank. Returns the saved
    `client_state`."""
    ts = train_state_of(engine)
    device = ts.device
    with agreed(ts.comm, device, "loading checkpoint"):
        reader = open_checkpoint(load_dir, tag)
        check_model(reader, ts)
        if load_optimizer_states:
            if isinstance(reader, DeepSpeedCheckpoint):
                deepspeed_resume.check_optimizer(reader, ts)
            else:
                check_optimizer(reader, ts)
        files = sorted(f for f in reader.files if load_optimizer_states or ".optim." not in f)
        reader.verify(files[ts.rank :: ts.world_size])  # each file hashed by one rank
    with agreed(ts.comm, device, "loading checkpoint"):
        try:
            with torch.no_grad():
                load_masters(reader, ts)
                load_frozen_shards(reader, ts)
                load_module_tensors(reader, ts)
                if load_optimizer_states:
                    load_optimizer(reader, ts)
            for counter in ("global_steps", "micro_steps", "skipped_steps"):
                setattr(ts.counters, counter, int(reader.meta[counter]))
            if isinstance(reader, DeepSpeedCheckpoint):
                deepspeed_resume.apply_training_state(reader, ts, load_optimizer_states, load_lr_scheduler_states)
            else:
                _load_training_state(reader, ts, load_optimizer_states, load_lr_scheduler_states)
        finally:
            reader.close()
    ts.refresh_params()
    return reader.meta.get("client_state") or {}


# -- compatibility ----------------------------------------------------------------------------------
def check_model(reader: CheckpointReader, ts) -> None:
    table = name_table_of(ts)
    saved = {n: reader.tensors[reader.canonical(n)]["shape"] for n in reader.meta["names"]}
    model = {n: table.tensors[table.tied.get(n, n)]["shape"] for n in table.names}
    missing = [n for n in model if n not in saved]
    unexpected = [n for n in saved if n not in model]
    shapes = [f"{n} saved {tuple(saved[n])}, model {tuple(model[n])}" for n in model
              if n in saved and list(saved[n]) != list(model[n])]
    problems = []
    for label, items in (("missing from the checkpoint", missing), ("not in the model", unexpected),
                         ("shape differs", shapes)):
        if items:
            more = f" (+{len(items) - 5} more)" if len(items) > 5 else ""
            problems.append(f"{label}: {', '.join(items[:5])}{more}")
    if problems:
        raise CheckpointError(f"{reader.meta_path}: the checkpoint does not match the model ({'; '.join(problems)}). "
                              "It was saved from a different model or model configuration")


def check_optimizer(reader: CheckpointReader, ts) -> None:
    saved = reader.meta["optimizer"]
    current = type(ts.optimizer.optimizer).__name__
    if saved["class"] != current:
        raise CheckpointError(f"{reader.meta_path}: optimizer states are for {saved['class']}, the engine runs "
                              f"{current}; pass load_optimizer_states=False to load only the weights")
    groups = len(ts.optimizer.param_groups)
    if saved["states"] and len(saved["param_groups"]) != groups:
        raise CheckpointError(f"{reader.meta_path}: {len(saved['param_groups'])} optimizer param groups saved, "
                              f"the engine has {groups}; pass load_optimizer_states=False to load only the weights")


# -- tensors ------------------------------------------------------------------------------------------
def _fill(target: torch.Tensor, bucket, reader: CheckpointReader, field: str) -> None:
    """Write `field` of every parameter overlapping this rank's shard of `bucket` into
    `target` (the shard, flat); the gaps (padding) become zeros."""
    lo, hi = bucket.shard_range
    done = lo
    for slot in bucket.slots:
        part = bucket.layout.slot_in_shard(slot, bucket.shard_index)
        if part is None:
            continue
        a, b = part
        target[done - lo : a - lo].zero_()
        target[a - lo : b - lo].copy_(reader.read(slot.name, field, a - slot.offset, b - slot.offset))
        done = b
    target[done - lo :].zero_()


def load_masters(reader: CheckpointReader, ts) -> None:
    for b, (bucket, master) in enumerate(zip(ts.buckets, ts.optimizer.masters)):
        with ts.optimizer.resident(b):  # on the nvme tier: read, filled, written back
            _fill(master, bucket, reader, "value")


def load_frozen_shards(reader: CheckpointReader, ts) -> None:
    """Stage 3: this rank's at-rest shard of each frozen unit bucket, element range by
    element range (from a saved frozen shard, or from a whole tensor saved at stages 0-2)."""
    for bucket in ts.frozen_buckets:
        value = bucket.read_shard()  # a shard kept in a file (offload_param nvme): filled here, written back
        _fill(value, bucket, reader, "value")
        bucket.write_shard(value)  # in memory: the shard itself, nothing to copy


def load_module_tensors(reader: CheckpointReader, ts) -> None:
    """Frozen parameters and buffers kept whole on every rank (all of them at stages 0-2;
    buffers and frozen parameters outside units at stage 3)."""
    for name, t in name_table_of(ts).module_entries:
        t.data.copy_(reader.read(name, "value").view(t.shape))


def load_optimizer(reader: CheckpointReader, ts) -> None:
    kinds: dict[str, str] = reader.meta["optimizer"]["states"]
    if not kinds:
        return
    opt = ts.optimizer
    state: dict[int, dict[str, Any]] = {}
    index = {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
    for b, (bucket, master) in enumerate(zip(ts.buckets, opt.masters)):
        per: dict[str, Any] = {}
        for name, kind in kinds.items():
            field = f"optim.{name}"
            if kind != JSON and not reader.holds(bucket.slots[0].name, field):
                continue  # a state of another param group (Muon's halves keep different ones)
            if kind == ELEMENTWISE:
                t = torch.empty_like(master)
                _fill(t, bucket, reader, field)
                per[name] = t
            elif kind == SCALAR:
                per[name] = _scalar(reader, bucket, field, name)
            elif kind == OTHER:
                per[name] = _same_shard(reader, bucket, field, name)
            elif kind == PER_TENSOR:
                per[name] = _per_tensor(reader, bucket, field, name)
            elif kind == JSON:
                per[name] = _json_state(reader, bucket, name)
        state[index[id(master)]] = opt.spill_states(b, per)  # nvme: to the file now, one bucket in memory
    groups = []
    for group, saved in zip(opt.param_groups, reader.meta["optimizer"]["param_groups"]):
        restored = {k: type(group[k])(v) if isinstance(group.get(k), tuple) else v for k, v in saved.items()}
        groups.append({**{k: v for k, v in group.items() if k != "params"}, **restored,
                       "params": [index[id(p)] for p in group["params"]]})
    opt.load_state_dict({"state": state, "param_groups": groups})


def _scalar(reader: CheckpointReader, bucket, field: str, name: str) -> torch.Tensor:
    values = []
    for slot in bucket.slots:
        if bucket.layout.slot_in_shard(slot, bucket.shard_index) is not None:
            values += reader.scalars(slot.name, field)
    if not values:  # a shard of pure padding
        any_value = reader.any_scalar(bucket.layout.group, field)
        if any_value is None:
            raise CheckpointError(f"{reader.meta_path}: no saved {name!r} state to start bucket "
                                  f"{bucket.layout.index} from")
        return any_value.clone()
    first = values[0]
    if any(not torch.equal(v, first) for v in values[1:]):
        raise CheckpointError(f"{reader.meta_path}: optimizer state {name!r} differs between the saved shards "
                              f"merged into bucket {bucket.layout.index} ({sorted({v.item() for v in values})}); "
                              "this layout change cannot merge them: load with the saved bucket layout, or with "
                              "load_optimizer_states=False")
    return first.clone()


def _saved_same_shard(reader: CheckpointReader, bucket) -> tuple[int, int] | None:
    """(saved bucket, shard) identical to this rank's shard of `bucket`, if there is one."""
    lay = bucket.layout
    mine = [(s.name, tuple(s.shape), s.offset) for s in lay.slots]
    for saved in reader.buckets:
        if ([(s.name, tuple(s.shape), s.offset) for s in saved.slots] == mine
                and saved.padded_numel == lay.padded_numel and saved.shard_count == lay.shard_count):
            return saved.index, bucket.shard_index
    return None


def _same_shard(reader: CheckpointReader, bucket, field: str, name: str) -> torch.Tensor:
    where = _saved_same_shard(reader, bucket)
    if where is None:
        raise CheckpointError(f"{reader.meta_path}: optimizer state {name!r} is neither per element nor a "
                              "scalar, so it loads only into the saved bucket layout (same world size, stage "
                              "and bucket sizes); or pass load_optimizer_states=False")
    return reader.shard(*where, field).clone()


def _per_tensor(reader: CheckpointReader, bucket, field: str, name: str) -> torch.Tensor:
    """One value per model tensor of an unsharded bucket, each taken by its tensor's name from
    whichever saved bucket held it (its place in that bucket's slots), so it reshards."""
    where = {slot.name: (saved, k) for saved in reader.buckets for k, slot in enumerate(saved.slots)}
    if bucket.layout.shard_count > 1 or any(saved.shard_count > 1 for saved, _ in where.values()):
        return _same_shard(reader, bucket, field, name)
    saved_vectors: dict[int, torch.Tensor] = {}
    values = []
    for slot in bucket.slots:
        if slot.name not in where:
            raise CheckpointError(f"{reader.meta_path}: optimizer state {name!r} has no saved value for {slot.name}")
        saved, k = where[slot.name]
        if saved.index not in saved_vectors:
            saved_vectors[saved.index] = reader.shard(saved.index, 0, field)
        values.append(saved_vectors[saved.index][k])
    return torch.stack(values).clone()


def _json_state(reader: CheckpointReader, bucket, name: str) -> Any:
    where = _saved_same_shard(reader, bucket)
    candidates = [where] if where else [(b.index, 0) for b in reader.buckets]
    for b, s in candidates:
        states = reader.json_states(b, s)
        if name in states:
            return states[name]
    raise CheckpointError(f"{reader.meta_path}: optimizer state {name!r} not found in the rank files")


# -- scheduler, scaler, RNG (load_checkpoint sets the counters) ----------------------------------------
def _load_training_state(reader: CheckpointReader, ts, optimizer_states: bool, scheduler_states: bool) -> None:
    meta = reader.meta
    if optimizer_states:
        ts.loss_scaler.load_state_dict(meta["loss_scaler"])
    sched, saved = ts.lr_scheduler, meta.get("lr_scheduler")
    if scheduler_states and sched is not None and saved is not None:
        if saved["class"] != type(sched).__name__:
            raise CheckpointError(f"{reader.meta_path}: the LR scheduler state is for {saved['class']}, the engine "
                                  f"runs {type(sched).__name__}; pass load_lr_scheduler_states=False")
        sched.load_state_dict(saved["state"])
        for group, lr in zip(ts.optimizer.param_groups, sched.get_last_lr()):
            group["lr"] = lr
    states = meta.get("rng") or []
    if ts.rank < len(states):
        rng.restore(states[ts.rank])
    elif states:
        log.warning("checkpoint saved by %d ranks: rank %d keeps its own random state", len(states), ts.rank)
