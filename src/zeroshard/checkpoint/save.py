"""save_checkpoint: every rank writes its own shards; rank 0 commits the tag.

Crash safety comes from the order of durable steps:

1. rank 0 makes `save_dir/.tmp-<tag>/` (removing leftovers of killed saves);
2. every rank writes and fsyncs its `rank<r>.model.safetensors` and `rank<r>.optim.safetensors`
   there, hashing them as it goes;
3. rank 0 writes `meta.json` (layout, sizes and sha256 of every rank file) and fsyncs it;
4. rank 0 renames the directory to `save_dir/<tag>` and fsyncs `save_dir`;
5. rank 0 replaces `latest` atomically, then prunes old tags (`keep_last`).

A save killed before step 4 leaves only a `.tmp-` directory, which loading never
reads; killed before step 5, the new tag is complete but `latest` still names the
previous one. Either way the previous checkpoint is what `latest` loads.
"""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import torch

from zeroshard.checkpoint import rng
from zeroshard.checkpoint.adapter import PEFT_META_KEY, peft_meta
from zeroshard.checkpoint.exchange import agree, agreed, all_records
from zeroshard.checkpoint.files import fsync_dir, write_rank_files, write_small
from zeroshard.checkpoint.format import (
    FORMAT, LATEST, META, OLD_PREFIX, TMP_PREFIX, VERSION, check_tag, dumps, json_safe, seal_meta, train_state_of,
)
from zeroshard.checkpoint.snapshot import JSON, model_config, name_table_of, rank_file
from zeroshard import faults
from zeroshard.policies import CheckpointError

def save_checkpoint(engine, save_dir: str | os.PathLike, tag: str | None = None,
                    client_state: dict[str, Any] | None = None, keep_last: int | None = None) -> str:
    """Save `engine`'s full training state under `save_dir/<tag>` and point `latest` at it.

    Call on every rank. `tag` defaults to `global_step<N>`; `client_state` (rank 0's) is
    stored as JSON and returned by `load_checkpoint`. `keep_last` keeps only the newest
    `keep_last` tags in `save_dir`. Returns the tag's directory."""
    ts = train_state_of(engine)
    save_dir = os.fspath(save_dir)
    tag = tag if tag is not None else f"global_step{ts.counters.global_steps}"
    tmp = os.path.join(save_dir, TMP_PREFIX + tag)
    made: list[str] = []  # rank 0's `tmp` once the tag is known to be a safe name
    try:
        _save(ts, save_dir, tag, tmp, made, client_state, keep_last)
    finally:
        # Whatever ended the save (an error on any rank, a stop signal raised inside a
        # collective), rank 0 leaves no partial tag behind; after a commit `tmp` is gone.
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
    return os.path.join(save_dir, tag)


def _save(ts, save_dir: str, tag: str, tmp: str, made: list[str], client_state, keep_last) -> None:
    device = ts.device
    with agreed(ts.comm, device, "saving checkpoint"):
        check_tag(tag)
        client = json_safe(client_state or {}, "client_state")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise CheckpointError(f"keep_last must be a positive integer, got {keep_last!r}")
        if ts.rank == 0:
            made.append(tmp)
            prepare_tag(save_dir, tmp)

    table = name_table_of(ts)
    error: BaseException | None = None
    try:
        part = rank_file(ts, table)
        check_space(save_dir, sum(e.nbytes for e in (*part.entries, *part.optim_entries)),
                    ts.comm.topology.local_world_size)
        files = write_rank_files(tmp, ts.rank, part.entries, part.optim_entries, dumps(part.json_states).decode())
        record = {"error": None, "files": files, "shards": part.shards, "state_kinds": part.state_kinds,
                  "rng": rng.capture()}
    except BaseException as exc:
        error, record = exc, {"error": str(exc)}
    records = all_records(ts.comm, record, device)
    try:
        failed = [(r, rec["error"]) for r, rec in enumerate(records) if rec["error"] is not None]
        if error is not None:
            raise error
        if failed:
            raise CheckpointError(f"saving checkpoint failed on rank {failed[0][0]}: {failed[0][1]}")
        if ts.rank == 0:
            meta = _meta(ts, tag, table, part, records, client)
            commit_tag(save_dir, tmp, tag, meta, keep_last)
    except BaseException as exc:
        error = exc
    agree(ts.comm, error, device, "saving checkpoint")


SPACE_SLACK = 1 << 20  # safetensors headers and meta.json


def check_space(save_dir: str, nbytes: int, sharers: int) -> None:
    """CheckpointError unless `save_dir`'s disk can take `nbytes` from each of `sharers` ranks
    (this node's ranks write there together), checked before the first byte is written so a
    full disk never costs the previous checkpoint."""
    free = shutil.disk_usage(save_dir).free
    need = nbytes * max(1, sharers) + SPACE_SLACK
    if need > free:
        raise CheckpointError(
            f"{save_dir}: no space left for this checkpoint: it needs {need / 2**20:,.1f} MiB ({nbytes / 2**20:,.1f} "
            f"MiB x {sharers} local rank(s) + {SPACE_SLACK >> 20} MiB) and the disk has {free / 2**20:,.1f} MiB free; "
            "nothing was written and the previous checkpoint is intact: free space, keep fewer checkpoints "
            "(--keep-last N / keep_last=N), or save elsewhere")


def prepare_tag(save_dir: str, tmp: str) -> None:
    """Step 1 (module doc): `save_dir` made, leftovers of killed saves removed, `tmp` made."""
    try:
        os.makedirs(save_dir, exist_ok=True)
        remove_partial_tags(save_dir)
        os.makedirs(tmp)
    except OSError as exc:
        raise CheckpointError(f"{save_dir}: cannot create the checkpoint directory ({exc.strerror or exc})") from None
    faults.pause("prepared")  # a no-op unless a test arms it


def remove_partial_tags(save_dir: str) -> None:
    """Remove the `.tmp-` tags of saves that never finished (killed, or stopped); never loadable.
    OSError if `save_dir` cannot be listed."""
    for leftover in os.listdir(save_dir):
        if leftover.startswith(TMP_PREFIX):
            shutil.rmtree(os.path.join(save_dir, leftover), ignore_errors=True)


def _meta(ts, tag: str, table, part, records: list[dict[str, Any]], client) -> dict[str, Any]:
    kinds = part.state_kinds
    for r, rec in enumerate(records):
        if rec["state_kinds"] != kinds:
            raise CheckpointError(f"optimizer states differ between rank 0 ({kinds}) and rank {r} "
                                  f"({rec['state_kinds']}); cannot checkpoint")
    written = sorted(tuple(s) for rec in records for s in rec["shards"])
    expected = sorted((b.index, s) for b in part.buckets for s in range(b.shard_count))
    if written != expected:
        raise CheckpointError(f"bucket shards written {written} differ from the layout's {expected}: "
                              "a shard would be missing from the checkpoint")
    opt = ts.optimizer.optimizer
    unsaved = ("params", "param_names", *getattr(opt, "unsaved_group_keys", ()))  # 1-bit's exp_avg_mask
    groups = [json_safe({k: v for k, v in g.items() if k not in unsaved}, "optimizer param_groups")
              for g in opt.param_groups]
    sched = ts.lr_scheduler
    return {
        "format": FORMAT, "version": VERSION, "tag": tag, "created": time.time(),
        "torch_version": torch.__version__,
        "world_size": ts.world_size, "stage": int(ts.settings.zero.stage),
        "compute_dtype": str(ts.compute_dtype),
        "global_steps": ts.counters.global_steps, "micro_steps": ts.counters.micro_steps,
        "skipped_steps": ts.counters.skipped_steps,
        **table.to_json(),
        "buckets": [b.to_json() for b in part.buckets],
        "optimizer": {"class": type(opt).__name__, "states": kinds, "param_groups": groups,
                      "json_states_in": "rank file metadata" if JSON in kinds.values() else None},
        "lr_scheduler": None if sched is None else {
            "class": type(sched).__name__, "state": json_safe(sched.state_dict(), "lr_scheduler state")},
        "loss_scaler": json_safe(ts.loss_scaler.state_dict(), "loss scaler state"),
        "config": json_safe(dict(ts.settings.raw), "config"),
        "model_class": type(ts.module).__name__,
        "model_config": model_config(ts.module),
        PEFT_META_KEY: peft_meta(ts.module),  # lora_alpha and targets, for `export --adapter-only`
        "client_state": client,
        "files": {name: info for rec in records for name, info in rec["files"].items()},
        "rng": [rec["rng"] for rec in records],
    }


def commit_tag(save_dir: str, tmp: str, tag: str, meta: dict[str, Any], keep_last: int | None) -> None:
    """Steps 3-5 (module doc): `meta` sealed into `tmp`, `tmp` renamed to `tag`, `latest` names it."""
    write_small(os.path.join(tmp, META), dumps(seal_meta(meta)))
    fsync_dir(tmp)
    faults.pause("written")
    final, old = os.path.join(save_dir, tag), os.path.join(save_dir, OLD_PREFIX + tag)
    try:
        if os.path.exists(final):  # same tag saved again: keep the old one until the new is in place
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(save_dir)
    except OSError as exc:
        raise CheckpointError(f"{final}: cannot move the new checkpoint into place ({exc.strerror or exc})") from None
    faults.pause("renamed")
    write_small(os.path.join(save_dir, LATEST), tag.encode())
    shutil.rmtree(old, ignore_errors=True)
    faults.pause("latest")
    if keep_last is not None:
        prune(save_dir, keep_last, keep=tag)


def prune(save_dir: str, keep_last: int, keep: str) -> None:
    """Remove all but the newest `keep_last` tags (never `keep`)."""
    metas = [(os.path.join(save_dir, name, META), name) for name in os.listdir(save_dir) if not name.startswith(".")]
    tags = sorted((os.path.getmtime(meta), name) for meta, name in metas if os.path.isfile(meta))
    for _, name in tags[: max(0, len(tags) - keep_last)]:
        if name != keep:
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
