"""`zeroshard train --save DIR`: continue from DIR's latest checkpoint instead of starting over.

A run whose `--save DIR` already holds a checkpoint (a `latest` file) resumes from it: after
`--resume`, after torchrun restarted the workers (`--max-restarts`, an elastic restart must
not start from scratch and overwrite the checkpoints it could continue from), and after a
plain re-run of the same command (a requeued job). Rank 0 prints the tag and why. Every
rank takes the same decision (a rank that does not see `latest` on a shared folder makes the
load fail on every rank with the checkpoint layer's clear error, instead of a rank that
trains while another loads). What is restored is the checkpoint layer's exact resume (masters,
optimizer states, scheduler, scaler, step counters, every rank's RNG); the data order follows
from the step (`rank_batch` indexes batches by optimizer step), so the resumed run sees the batches
the uninterrupted run would have.

An elastic restart (`--nnodes MIN:MAX`) may resume at another world size. The checkpoint says
how many samples each optimizer step took (`global_batch`); `keep_global_batch` changes the
gradient accumulation so the new world takes as many (world 4 x 1 micro-step becomes world 2 x
2 on the same rows), or stops with one line when no whole number of micro-steps can.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from zeroshard.checkpoint.format import LATEST
from zeroshard.checkpoint.reader import read_meta, resolve
from zeroshard.policies import ConfigError, ZeroShardError

__all__ = ["Resumed", "keep_global_batch", "restart_count", "resume"]


class Resumed(dict):
    """The checkpoint's client_state, with where it came from (`tag_dir`) and why (`reason`)."""

    tag_dir: str = ""
    reason: str = ""


def restart_count() -> int:
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    except ValueError:
        return 0


def _reason(args: argparse.Namespace) -> str:
    if args.resume:
        return "--resume"
    n = restart_count()
    if n:
        return f"torchrun restart {n}: the workers were restarted, training continues from the last checkpoint"
    return f"--save {args.save} already holds a checkpoint; use another folder to start over"


def _any_rank(engine, flag: bool) -> bool:
    """True on every rank when `flag` is true on any rank (one tiny all-reduce)."""
    ts = engine.train_state
    t = torch.tensor([int(flag)], dtype=torch.int64, device=ts.device)
    ts.comm.all_reduce(t, op="max", what="zeroshard train: is there a checkpoint to resume").wait()
    return bool(t.item())


def resume(engine, args: argparse.Namespace) -> Resumed | None:
    """Load `args.save`'s latest checkpoint into `engine` when there is one (on every rank);
    None for a fresh start. Raises ConfigError for --resume without a checkpoint."""
    if not args.save:
        return None
    here = os.path.isfile(os.path.join(args.save, LATEST))
    if not _any_rank(engine, here):
        if args.resume:
            raise ConfigError(f"--resume: no checkpoint in {args.save} (no '{LATEST}' file)")
        return None
    client = engine.load_checkpoint(args.save)  # another model's checkpoint: its clear names/shapes error
    out = Resumed(client)
    out.tag_dir = resolve(args.save)
    out.reason = _reason(args)
    return out


def describe(resumed: Resumed, steps: int) -> str:
    done = int(resumed.get("step", 0))
    line = f"resumed at step {done} from {resumed.tag_dir} ({resumed.reason})"
    if done >= steps:
        line += f"; nothing left to train (--steps {steps})"
    return line


def client_state(step: int, losses: list[float], args: argparse.Namespace, global_batch: int = 0,
                 world: int = 0) -> dict[str, Any]:
    """What each checkpoint of `zeroshard train` carries for the next resume: `global_batch` is
    the samples of one optimizer step (micro x accumulation x world), `world` the world size."""
    return {"step": step, "losses": losses, "model": args.model, "lora": args.lora or 0,
            "global_batch": global_batch, "world": world}


def _saved_batch(save: str | None) -> tuple[int, int] | None:
    """(global batch, world size) of `save`'s latest checkpoint, when it has them."""
    if not save or not os.path.isfile(os.path.join(save, LATEST)):
        return None
    try:
        client = read_meta(resolve(save)).get("client_state") or {}
    except (OSError, ValueError, ZeroShardError):
        return None  # resume() reports the checkpoint's problem with the checkpoint layer's error
    batch, world = int(client.get("global_batch") or 0), int(client.get("world") or 0)
    return (batch, world) if batch and world else None


def keep_global_batch(cfg: dict[str, Any], save: str | None, world: int) -> str | None:
    """Resuming `save`'s checkpoint at a world size other than the one it was saved at (an elastic
    restart): set `cfg`'s gradient accumulation so each optimizer step takes the checkpoint's global
    batch again, and say so; None when nothing changes. ConfigError when no whole number of
    micro-steps gives that batch at this world size."""
    saved = _saved_batch(save)
    if saved is None or saved[1] == world:
        return None
    batch, was = saved
    micro = int(cfg.get("train_micro_batch_size_per_gpu") or 1)
    if batch % (micro * world):
        raise ConfigError(f"the checkpoint in {save} trained {batch} samples per step on {was} ranks; on {world} "
                          f"ranks with micro-batch {micro} no gradient accumulation gives {batch} ({batch} is not a "
                          f"multiple of {micro} x {world}): restart with a world size (or --micro-batch) that "
                          "divides it")
    gas = batch // (micro * world)
    cfg.pop("train_batch_size", None)
    cfg["gradient_accumulation_steps"] = gas
    return (f"world size {world} (the checkpoint was saved at {was}): gradient_accumulation_steps {gas} keeps "
            f"the global batch at {batch} samples per step")
