"""`zeroshard train --config`: the embedded default config and the command-line overrides.

The default is ZeRO stage 3 with the transformer layers as gather units, AdamW with
linear warmup then cosine decay, and gradient clipping at 1.0. Parameters are released
right after each unit's use (reuse distance 0, nothing kept whole), so the ledgers show
stage 3 as the ZeRO paper describes it: Phi x (2 + 2 + 12) / N bytes at rest, 3 Phi sent.
"""

from __future__ import annotations

import argparse
from typing import Any

from zeroshard.config.loader import read_json
from zeroshard.policies import ConfigError

__all__ = ["DEFAULT_STEPS_PER_PRINT", "build_config", "default_config"]

DEFAULT_STEPS_PER_PRINT = 50


def default_config(steps: int, micro_batch: int, unit_classes: list[str]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": DEFAULT_STEPS_PER_PRINT,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": steps, "warmup_num_steps": max(2, steps // 10)}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 200_000,
            "allgather_bucket_size": 200_000,
            "stage3_max_reuse_distance": 0,
            "stage3_param_persistence_threshold": 0,
        },
        "zeroshard": {"stage3_unit_classes": list(unit_classes)},
    }


def wrote_optimizer(args: argparse.Namespace) -> bool:
    """True when the optimizer section is the user's (a --config with `optimizer`), False when it
    is the embedded config's."""
    return bool(args.config) and "optimizer" in read_json(args.config)


def filled_from_default(args: argparse.Namespace) -> list[str]:
    """What build_config took from the embedded config because --config was silent, as lines."""
    if not args.config or wrote_optimizer(args):
        return []
    user = read_json(args.config)
    default = default_config(args.steps, 8, [])
    opt = default["optimizer"]["params"]
    took = (f"optimizer AdamW (lr {opt['lr']:g}, betas {tuple(opt['betas'])}, weight decay {opt['weight_decay']:g})")
    if "scheduler" not in user:
        sched = default["scheduler"]["params"]
        took += f" with WarmupCosineLR ({sched['warmup_num_steps']} warm-up steps of {sched['total_num_steps']})"
    return [f"{args.config} has no 'optimizer'; using the embedded config's {took} (add an 'optimizer' "
            "section to choose another)"]


def build_config(args: argparse.Namespace, unit_classes: list[str]) -> dict[str, Any]:
    """The config the engine gets: --config (or the default) with --stage, --micro-batch and
    --bf16 applied. A --config without `optimizer` takes the embedded optimizer and, when it
    has no `scheduler` either, the embedded scheduler (`filled_from_default` says so).

    At stage 3 with no gather units named (`zeroshard.stage3_unit_classes`, or
    `stage3_min_unit_params` to pick by size), the model's transformer layers are named."""
    if args.config:
        cfg = read_json(args.config)
        if "optimizer" not in cfg:  # the run needs one: the embedded recipe's, said at launch
            default = default_config(args.steps, 8, unit_classes)
            cfg["optimizer"] = default["optimizer"]
            cfg.setdefault("scheduler", default["scheduler"])
    else:
        cfg = default_config(args.steps, args.micro_batch or 8, unit_classes)
    zero = cfg.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization must be an object, got {zero!r}")
    if args.stage is not None:
        zero["stage"] = args.stage
        if args.stage != 3 and not args.config:  # the embedded stage-3 keys mean nothing at other stages
            for key in [k for k in zero if k.startswith("stage3_")]:
                del zero[key]
            cfg.pop("zeroshard", None)
    if args.micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
        cfg.pop("train_batch_size", None)  # derived again from micro x accumulation x ranks
    if args.bf16:
        cfg["bf16"] = {**(cfg.get("bf16") or {}), "enabled": True}
    device = getattr(args, "offload", "none")
    if device in ("cpu", "nvme"):
        stage = zero.get("stage", 0)
        if stage == 0:
            raise ConfigError(f"--offload {device} needs ZeRO stage 1, 2 or 3 (the optimizer states are sharded "
                              "first); add --stage 2")
        where = {"device": device, **({"nvme_path": args.nvme_path} if device == "nvme" else {})}
        zero["offload_optimizer"] = {**(zero.get("offload_optimizer") or {}), **where}
        if stage == 3:
            zero["offload_param"] = {**(zero.get("offload_param") or {}), **where}
    for section, path in (("tensorboard", getattr(args, "tensorboard", None)), ("csv_monitor", getattr(args, "csv", None))):
        if path:  # --tensorboard DIR / --csv DIR: DeepSpeed's monitor sections, job "zeroshard_train"
            cfg[section] = {**(cfg.get(section) or {}), "enabled": True, "output_path": path,
                            "job_name": (cfg.get(section) or {}).get("job_name", "zeroshard_train")}
    if getattr(args, "wandb", None):
        cfg["wandb"] = {**(cfg.get("wandb") or {}), "enabled": True, "project": args.wandb}
    own = cfg.get("zeroshard") or {}
    if (zero.get("stage") == 3 and unit_classes and "stage3_unit_classes" not in own
            and "stage3_min_unit_params" not in own):
        cfg["zeroshard"] = {**own, "stage3_unit_classes": list(unit_classes)}
    return cfg
