"""Consolidated Hugging Face style export: `model.safetensors`, or shards and an index.

`export` streams from a checkpoint one tensor at a time: each tensor is assembled
from the rank files' element ranges, cast, written, and dropped, so peak memory is
about the largest tensor whatever the model size. `save_16bit_model` writes the same
files online, from the engine's compute-dtype parameters (at stage 3, gathered one
bucket at a time while rank 0 writes, and only when the config allows the gather).

Tied parameters are written under every name the model's state dict has (the same
values twice): the files load with a strict `load_state_dict` into the original model,
and `transformers`' `from_pretrained` accepts them too (it re-ties the weights).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from typing import Any, Callable

import torch

from zeroshard.checkpoint.format import train_state_of
from zeroshard.checkpoint.exchange import agree, agreed
from zeroshard.checkpoint.files import Entry, WriteError, write_safetensors, write_small
from zeroshard.checkpoint.deepspeed_reader import open_checkpoint
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.checkpoint.snapshot import model_config
from zeroshard.policies import CheckpointError, Stage

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def target_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_size(size: int | str) -> int:
    """Bytes from 5000000, "5GB" (10^9) or "4GiB" (2^30), as Hugging Face reads them."""
    if isinstance(size, int):
        n = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if not m or m.group(2).upper() not in _UNITS:
            raise CheckpointError(f"max shard size {size!r}: use a number of bytes or e.g. 5GB, 500MB, 2GiB")
        n = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if n <= 0:
        raise CheckpointError(f"max shard size must be positive, got {size!r}")
    return n


def plan_files(entries: list[Entry], max_bytes: int) -> list[list[Entry]]:
    """Consecutive entries per file, each file at most `max_bytes` (a larger tensor stands alone)."""
    files: list[list[Entry]] = [[]]
    used = 0
    for e in entries:
        if files[-1] and used + e.nbytes > max_bytes:
            files.append([])
            used = 0
        files[-1].append(e)
        used += e.nbytes
    return files


def write_model(out_dir: str, entries: list[Entry], max_shard_size: int | str,
                model_config: dict[str, Any] | None) -> list[str]:
    """Write `entries` as HF-style safetensors (and config.json); returns the files written."""
    groups = plan_files(entries, parse_size(max_shard_size))
    staging = _staging_dir(out_dir)
    try:
        names = [SINGLE] if len(groups) == 1 else [
            f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
        for name, group in zip(names, groups):
            write_safetensors(os.path.join(staging, name), group, {"format": "pt"})
        written = list(names)
        if len(groups) > 1:
            index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                     "weight_map": {e.key: name for name, group in zip(names, groups) for e in group}}
            write_small(os.path.join(staging, INDEX), json.dumps(index, indent=2).encode())
            written.append(INDEX)
        if model_config is not None:
            write_small(os.path.join(staging, "config.json"), json.dumps(model_config, indent=2).encode())
            written.append("config.json")
        for name in written:  # every file complete: only now do they enter OUT
            os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
    except (OSError, WriteError) as exc:
        reason = exc.reason if isinstance(exc, WriteError) else (exc.strerror or str(exc))
        raise CheckpointError(f"{out_dir}: cannot write the export ({reason}); nothing was left there") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return written


def _staging_dir(out_dir: str) -> str:
    """A fresh folder inside `out_dir` (made if needed) where the files are written before they
    are moved into place, or one CheckpointError naming what is wrong with `out_dir`."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"{out_dir}: is a file, not a directory; give a directory for the export")
    try:
        os.makedirs(out_dir, exist_ok=True)
        return tempfile.mkdtemp(prefix=".zeroshard-export-", dir=out_dir)
    except OSError as exc:
        raise CheckpointError(f"{out_dir}: cannot create the export directory ({exc.strerror or exc}); choose a "
                              "writable directory") from None


def _config_for(config: dict[str, Any] | None, dtype: torch.dtype, architecture: str | None) -> dict | None:
    if config is None:
        return None
    config = dict(config)
    key = "torch_dtype" if "torch_dtype" in config and "dtype" not in config else "dtype"
    config[key] = str(dtype).replace("torch.", "")
    if architecture and not config.get("architectures"):
        config["architectures"] = [architecture]
    return config


def export(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32",
           max_shard_size: int | str = "5GB", tag: str | None = None, exclude_frozen: bool = False) -> list[str]:
    """Consolidate a checkpoint into `out_dir`; returns the names of the files written.

    `exclude_frozen` (DeepSpeed's `exclude_frozen_parameters`): only the trainable tensors,
    under their state-dict names, and no config.json (the files are not a loadable model)."""
    target = target_dtype(dtype)
    with open_checkpoint(ckpt_dir, tag) as reader:  # zeroshard's own, or a folder DeepSpeed wrote
        reader.verify([f for f in reader.files if ".optim." not in f])  # values only: a third of Adam's bytes
        names = reader.meta["names"]
        if exclude_frozen:
            names = [n for n in names if reader.tensors[reader.canonical(n)].get("trainable")]
            if not names:
                raise CheckpointError(f"{reader.dir}: --exclude-frozen: the checkpoint has no trainable tensor")
        entries = []
        for name in names:
            info = reader.tensors[reader.canonical(name)]
            shape = tuple(info["shape"])
            saved = getattr(torch, info["dtype"].replace("torch.", ""))
            out = target if saved.is_floating_point else saved
            entries.append(Entry(name, shape, out, lambda name=name, shape=shape, out=out:
                                 reader.read(name).to(out).view(shape)))
        config = None if exclude_frozen else \
            _config_for(reader.meta.get("model_config"), target, reader.meta.get("model_class"))
        return write_model(os.fspath(out_dir), entries, max_shard_size, config)


def save_16bit_model(engine, save_dir: str | os.PathLike, max_shard_size: int | str = "5GB") -> list[str]:
    """Write the model's weights in the compute dtype (fp32 training writes fp32) as
    HF-style safetensors in `save_dir`, from rank 0; call on every rank.

    At stage 3 this needs `stage3_gather_16bit_weights_on_model_save`: the weights are
    gathered one bucket at a time (peak: about one unit) while rank 0 writes them.
    Without the flag it raises and writes nothing, never placeholder tensors."""
    ts = train_state_of(engine)
    stage3 = ts.settings.zero.stage == Stage.PARAMETERS
    with agreed(ts.comm, ts.device, "save_16bit_model"):
        if stage3 and not ts.settings.zero.stage3.gather_16bit_weights_on_model_save:
            raise CheckpointError(
                "save_16bit_model at ZeRO stage 3 gathers the sharded weights, which this config does not allow: "
                "set zero_optimization.stage3_gather_16bit_weights_on_model_save to true, or call "
                "engine.save_checkpoint(dir) and run `zeroshard export dir OUT --dtype bf16`, which consolidates "
                "the shards without gathering the model on any rank. Nothing was written")
    entries, finish = stream_entries(ts, ts.module.state_dict(keep_vars=True).items(),
                                     list(ts.buckets) + list(ts.frozen_buckets), gather=stage3)

    def write() -> list[str]:
        config = _config_for(model_config(ts.module), ts.compute_dtype, type(ts.module).__name__)
        return write_model(os.fspath(save_dir), entries, max_shard_size, config)
    return write_streamed(ts, write, finish, "save_16bit_model")


class _BucketStream:
    """The full compute-dtype buffer of one bucket at a time (`bucket.whole`: a unit bucket
    all-gathered from its at-rest shards, the source of truth at stage 3; a persistent bucket as
    it is), dropped when the next bucket is asked for. Every rank makes the same requests in
    the same order, so the gathers pair up."""

    def __init__(self, ts) -> None:
        self.ts = ts
        self.bucket = None
        self._held = contextlib.ExitStack()
        self.full: torch.Tensor | None = None

    def get(self, bucket) -> torch.Tensor:
        if bucket is not self.bucket:
            self.drop()
            self.full = self._held.enter_context(bucket.whole(self.ts.comm, f"save_16bit_model, {bucket.label}"))
            self.bucket = bucket
        return self.full

    def drop(self) -> None:
        self._held.close()
        self.bucket = self.full = None


def stream_entries(ts, items, buckets, gather: bool, key: Callable[[str], str] = lambda name: name):
    """Entries for the (name, tensor) `items`: a tensor of `buckets` is read from its bucket's
    full buffer (all-gathered one bucket at a time when `gather`), any other as it is; and
    `finish()`, which makes the gathers the writer did not (the other ranks, or rank 0 after a
    failed write: every rank gathers the same buckets in the same order) and drops the last."""
    where = {id(p): (bucket, slot) for bucket in buckets for slot, p in zip(bucket.slots, bucket.params)}
    stream = _BucketStream(ts) if gather else None
    produced = 0

    def producer(i: int, t: torch.Tensor):
        def produce() -> torch.Tensor:
            nonlocal produced
            produced = i + 1
            if stream is None or id(t) not in where:  # buffers, frozen parameters outside units
                return t.detach()
            bucket, slot = where[id(t)]
            return stream.get(bucket)[slot.offset : slot.end].view(slot.shape)
        return produce

    entries = []
    for i, (name, t) in enumerate(items):
        dtype = where[id(t)][0].dtype if id(t) in where else t.dtype  # released parameters: true shape
        entries.append(Entry(key(name), tuple(t.shape), dtype, producer(i, t)))

    def finish() -> None:
        if stream is None:
            return
        try:
            for e in entries[produced:]:
                e.produce()
        finally:
            stream.drop()
    return entries, finish


def write_streamed(ts, write: Callable[[], list[str]], finish: Callable[[], None], doing: str) -> list[str]:
    """`write()` on rank 0, `finish()` (of `stream_entries`) on every rank, then `agree` on the write."""
    written: list[str] = []
    error: BaseException | None = None
    try:
        if ts.rank == 0:
            written = write()
    except BaseException as exc:
        error = exc
    finish()
    agree(ts.comm, error, ts.device, doing)
    return written
