"""`zeroshard train --save DIR`: continue from DIR's latest checkpoint instead of starting over.

A run whose `--save DIR` already holds a checkpoint (a `latest` file) resumes from it: after
`--resume`, after torchrun restarted the workers (`--max-restarts`, an elastic restart must
not start from scratch and overwrite the checkpoints it could continue from), and after a
plain re-run of the same command (a requeued job). Rank 0 prints the tag and why. Every
rank takes the same decision (a rank that does not see `latest` on a shared folder makes the
load fail on every rank with the checkpoint layer's clear error, instead of a rank that
trains while another loads). What is restored is the checkpoint layer's exact resume (masters,
optimizer states, scheduler, scaler, step counters, every rank's RNG); the data order follows
from the step (`rank_batch` indexes batches by micro-step), so the resumed run sees the batches
the uninterrupted run would have.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from zeroshard.checkpoint.format import LATEST
from zeroshard.checkpoint.reader import resolve
from zeroshard.policies import ConfigError

__all__ = ["Resumed", "restart_count", "resume"]


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


def client_state(step: int, losses: list[float], args: argparse.Namespace) -> dict[str, Any]:
    """What each checkpoint of `zeroshard train` carries for the next resume."""
    return {"step": step, "losses": losses, "model": args.model, "lora": args.lora or 0}
