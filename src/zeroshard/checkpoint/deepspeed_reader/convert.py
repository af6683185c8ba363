"""`zeroshard convert DS_DIR OUT`: a DeepSpeed checkpoint written once as a zeroshard one.

The layout is kept, so the conversion is a copy, not a reshard: a stage 1/2 flat group
becomes one zeroshard bucket (its parameters back to back, padded to the same partition
size, shard r = DeepSpeed rank r's partition), and at stage 3 every parameter becomes a
bucket of its own (DeepSpeed partitions each parameter separately). Buffers (and frozen
parameters) are whole tensors in rank 0's file. The result loads on any world size and
stage like any zeroshard checkpoint, with sha256-checked files and no pickles.

Memory: one rank file is written at a time, one tensor at a time, from one DeepSpeed
rank file at a time (memory-mapped): about one DeepSpeed partition at most.
"""

from __future__ import annotations

import math
import os
import shutil
import time
import warnings
from typing import Any

import torch

from zeroshard.checkpoint.deepspeed_reader.entry import open_deepspeed
from zeroshard.checkpoint.deepspeed_reader.reader import DeepSpeedCheckpoint
from zeroshard.checkpoint.files import Entry, write_rank_files
from zeroshard.checkpoint.format import (
    FORMAT, TMP_PREFIX, VERSION, BucketRecord, SlotRecord, bucket_key, check_tag, json_safe, module_key,
)
from zeroshard.checkpoint.save import commit_tag, prepare_tag
from zeroshard.policies import CheckpointError, SchedulerSpec, ZeroShardError


def _buckets(r: DeepSpeedCheckpoint, fields: tuple[str, ...]) -> list[tuple[BucketRecord, list]]:
    """(record, DeepSpeed runs per slot) of every bucket, in DeepSpeed's flat order."""
    world = r.world_size
    out = []
    if r.stage == 3:
        for g in r.groups:
            for name, shape in g:
                n = math.prod(shape)
                rec = BucketRecord(len(out), str(r.compute_dtype), r.param_group_of(name) or 0,
                                   (SlotRecord(name, shape, 0),), math.ceil(n / world) * world, world,
                                   tuple(range(world)), fields)
                out.append((rec, [r.where[name]]))
        return out
    for i, g in enumerate(r.groups):
        slots, offset = [], 0
        for name, shape in g:
            slots.append(SlotRecord(name, shape, offset))
            offset += math.prod(shape)
        rec = BucketRecord(len(out), str(r.compute_dtype), i, tuple(slots), r.partition_sizes[i] * world, world,
                           tuple(range(world)), fields)
        out.append((rec, [r.where[s.name] for s in slots]))
    return out


def _shard(r: DeepSpeedCheckpoint, rec: BucketRecord, shard: int, field: str) -> torch.Tensor:
    """Shard `shard` of bucket `rec`'s `field` (fp32, padding zero), read parameter range by range."""
    size = rec.shard_numel
    lo, hi = shard * size, (shard + 1) * size
    out = torch.zeros(size, dtype=torch.float32)
    for slot in rec.slots:
        a, b = max(lo, slot.offset), min(hi, slot.end)
        if a < b:
            out[a - lo : b - lo] = r.read(slot.name, field, a - slot.offset, b - slot.offset)
    return out


def _scheduler_state(r: DeepSpeedCheckpoint) -> dict[str, Any] | None:
    """DeepSpeed's WarmupLR-family state as the state dict of zeroshard's scheduler of the same
    name, built from the saved config over the saved hyperparameters."""
    saved = r.meta.get("lr_scheduler")
    spec = r.config.get("scheduler") if isinstance(r.config.get("scheduler"), dict) else None
    if saved is None or spec is None:
        return None
    from zeroshard.optim.schedulers import build_scheduler

    groups = r.meta["optimizer"]["param_groups"] or [{}]
    base = float(((r.config.get("optimizer") or {}).get("params") or {}).get("lr", 1e-3))
    dummy = torch.optim.SGD([{"params": [torch.zeros(1)], "lr": float(g.get("initial_lr", base))} for g in groups])
    try:
        sched = build_scheduler(SchedulerSpec(str(spec.get("type")), dict(spec.get("params") or {})), dummy)
    except ZeroShardError as exc:
        raise CheckpointError(f"{r.dir}: the DeepSpeed scheduler cannot be converted ({exc})") from None
    state = saved.get("state") or {}
    if set(state) != {"last_batch_iteration"}:
        raise CheckpointError(f"{r.dir}: the DeepSpeed scheduler state {sorted(state)} is not one zeroshard converts")
    sched.last_epoch = int(state["last_batch_iteration"]) + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sched._last_lr = list(sched.get_lr())
    return {"class": type(sched).__name__, "state": json_safe(sched.state_dict(), "lr_scheduler state")}


def _scaler_state(r: DeepSpeedCheckpoint) -> dict[str, Any]:
    ds = r.meta.get("loss_scaler") or {}
    state: dict[str, Any] = {"scale": float(ds.get("cur_scale", 1.0)), "skipped_steps": r.meta["skipped_steps"],
                             "consecutive_skips": 0}
    if ds.get("class") == "DynamicLossScaler":
        state.update(iteration=int(ds.get("cur_iter", 0)), last_overflow_iteration=int(ds.get("last_overflow_iter", -1)),
                     hysteresis_left=int(ds.get("cur_hysteresis", 1)))
    return state


def _client_scheduler(r: DeepSpeedCheckpoint, scheduler_class: str | None) -> tuple[dict | None, str | None]:
    """(meta entry, why not) for a client LR scheduler DeepSpeed saved as its state_dict(). The
    state is inert data (numbers and lists; a LambdaLR's functions are saved as None), but
    DeepSpeed does not record the scheduler's class, which zeroshard's loader checks: it is
    carried when the caller names the class (`--lr-scheduler-class`)."""
    state = (r.meta.get("lr_scheduler") or {}).get("state")
    if scheduler_class is None:
        return None, ("lr_scheduler (a client scheduler DeepSpeed saved as its state dict, without its class: pass "
                      "--lr-scheduler-class NAME, e.g. StepLR, to carry it, or load the DeepSpeed folder itself)")
    try:
        return {"class": scheduler_class, "state": json_safe(state, "lr_scheduler state")}, None
    except CheckpointError as exc:
        return None, f"lr_scheduler ({exc})"


def convert(src: str | os.PathLike, out: str | os.PathLike, tag: str | None = None,
            scheduler_class: str | None = None) -> tuple[str, list[str]]:
    """Write the DeepSpeed checkpoint at `src` (tag `tag`, default its `latest`) as a zeroshard
    checkpoint under `out` (same tag name; `out/latest` names it). Returns (the new tag
    directory, what was left out: client_state keys that are not JSON, a client scheduler
    whose class `scheduler_class` does not name)."""
    out = os.fspath(out)
    with open_deepspeed(src, tag) as r:
        r.verify()
        new_tag = check_tag(r.meta["tag"])
        kinds = r.meta["optimizer"]["states"]
        fields = ("master",) + tuple(f"optim.{k}" for k in kinds)
        buckets = _buckets(r, fields)
        client, dropped = {}, []
        for k, v in (r.meta.get("client_state") or {}).items():
            try:
                client[k] = json_safe(v, "client_state")
            except CheckpointError:
                dropped.append(f"client_state[{k!r}] (not JSON)")
        meta_extra = {"lr_scheduler": _scheduler_state(r), "loss_scaler": _scaler_state(r)}
        if r.meta.get("lr_scheduler") is not None and meta_extra["lr_scheduler"] is None:
            meta_extra["lr_scheduler"], why = _client_scheduler(r, scheduler_class)
            if why:
                dropped.append(why)
        tmp = os.path.join(out, TMP_PREFIX + new_tag)
        final = os.path.join(out, new_tag)
        if os.path.exists(final):
            raise CheckpointError(f"{final}: already exists; convert into another directory or remove it first")
        prepare_tag(out, tmp)
        try:
            files = {}
            for rank in range(r.world_size):
                values, states = [], []
                for rec, runs in buckets:
                    values.append(Entry(bucket_key(rec.index, "master"), (rec.shard_numel,), torch.float32,
                                        lambda rec=rec, rank=rank: _shard(r, rec, rank, "value")))
                    for k, kind in kinds.items():
                        if kind == "elementwise":
                            states.append(Entry(bucket_key(rec.index, f"optim.{k}"), (rec.shard_numel,), torch.float32,
                                                lambda rec=rec, rank=rank, k=k: _shard(r, rec, rank, f"optim.{k}")))
                        else:
                            flat = next((run.flat for rs in runs for run in rs), 0)  # the one holding this bucket
                            one = r._scalar(rank, flat, k).reshape(())  # its scalar state (`step`) on DeepSpeed rank
                            states.append(Entry(bucket_key(rec.index, f"optim.{k}"), (), one.dtype, lambda one=one: one))
                if rank == 0:  # buffers and frozen parameters, whole, read when written (one at a time)
                    for name, info in r.tensors.items():
                        if not info["trainable"]:
                            dtype = getattr(torch, info["dtype"].replace("torch.", ""))
                            values.append(Entry(module_key(name), tuple(info["shape"]), dtype,
                                                lambda name=name, s=tuple(info["shape"]), d=dtype:
                                                r.read(name).to(d).view(s)))
                files.update(write_rank_files(tmp, rank, values, states, "{}"))
            meta = {
                "format": FORMAT, "version": VERSION, "tag": new_tag, "created": time.time(),
                "torch_version": torch.__version__, "world_size": r.world_size,
                "stage": r.stage, "compute_dtype": r.meta["compute_dtype"],
                "global_steps": r.meta["global_steps"], "micro_steps": r.meta["micro_steps"],
                "skipped_steps": r.meta["skipped_steps"],
                "names": r.meta["names"], "tensors": r.tensors, "tied": r.tied,
                "buckets": [rec.to_json() for rec, _ in buckets],
                "optimizer": {"class": r.meta["optimizer"]["class"], "states": kinds,
                              "param_groups": json_safe(r.meta["optimizer"]["param_groups"], "optimizer param_groups"),
                              "json_states_in": None},
                **meta_extra,
                "config": json_safe(r.config, "config"), "model_class": None, "model_config": None,
                "client_state": client, "files": files, "rng": [],
                "converted_from": {"format": "deepspeed", "deepspeed_version": r.meta["deepspeed_version"],
                                   "dir": os.path.abspath(r.dir)},
            }
            commit_tag(out, tmp, new_tag, meta, keep_last=None)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final, dropped
