"""`zeroshard launch` reads the DeepSpeed config a script will be handed before it starts any
rank, so a bad one is one line in about a second, not the same line from every rank after
20-30 s of start-up (issue 45). The config is found where DeepSpeed's launcher and the
scripts it runs take it: `--deepspeed_config PATH` / `--deepspeed_config_file PATH` (also
`=PATH`), and Trainer's `--deepspeed PATH.json`. Only problems the script could not still
fix are reported: a file that cannot be read or parsed, and keys or values the config refuses;
batch sizes are left to the ranks (scripts often set them in code before `initialize`)."""

from __future__ import annotations

import json
import os

_FLAGS = ("--deepspeed_config", "--deepspeed_config_file", "--deepspeed")
_BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def config_path(script_args: list[str]) -> str | None:
    """The config file the script's arguments name, if any."""
    for i, arg in enumerate(script_args):
        flag, eq, value = arg.partition("=")
        if flag not in _FLAGS:
            continue
        if not eq:
            value = script_args[i + 1] if i + 1 < len(script_args) else ""
        if flag != "--deepspeed" or value.endswith(".json"):  # bare --deepspeed is DeepSpeed's on/off flag
            return value or None
    return None


def config_problem(script_args: list[str], world_size: int) -> str | None:
    """One line naming what is wrong with the script's config, or None (also when it names none)."""
    path = config_path(script_args)
    if path is None:
        return None
    if not os.path.isfile(path):
        return f"{path}: no such config file (given to the script as its DeepSpeed config)"
    from zeroshard.config import load_config
    from zeroshard.policies import ZeroShardError

    try:
        load_config(path, world_size)
        return None
    except ZeroShardError as exc:
        first = str(exc)
    try:  # the same config with its batch keys left to the script: still refused?
        with open(path) as f:
            raw = json.load(f)
        load_config({k: v for k, v in raw.items() if k not in _BATCH} | {"train_micro_batch_size_per_gpu": 1},
                    world_size)
    except (ZeroShardError, ValueError, AttributeError):
        return first.splitlines()[0] if first else "the config is refused"
    return None
