"""Which config `deepspeed.initialize` uses, read into a dict, and what zeroshard refuses up front."""

from __future__ import annotations

import copy
import logging
import math
import os
from typing import Any, Mapping

from zeroshard.config.loader import read_json
from zeroshard.policies import ConfigError

log = logging.getLogger("zeroshard")

__all__ = ["client_config", "resolve_config", "unsupported"]


def resolve_config(args: Any, config: Any, config_params: Any) -> dict[str, Any]:
    """DeepSpeed's rules: `config`, else `config_params`, else `args.deepspeed_config`
    (or the deprecated `args.deepscale_config`); two of them at once is an error."""
    if config is None and config_params is not None:
        config = config_params
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    deepscale = getattr(args, "deepscale_config", None) if args is not None else None
    if deepscale is not None:
        if from_args is not None:
            raise ConfigError("both --deepscale_config and --deepspeed_config were given; keep --deepspeed_config")
        log.warning("--deepscale_config is deprecated, use --deepspeed_config")
        from_args = deepscale
    if from_args is not None:
        if config is not None:
            raise ConfigError("a DeepSpeed config was given both on the command line (--deepspeed_config) and "
                              "to initialize(config=...); pass only one")
        config = from_args
    if config is None:
        raise ConfigError("initialize() needs a DeepSpeed config: pass config= (a dict or a JSON path), or "
                          "args= with --deepspeed_config PATH (see add_config_arguments)")
    if isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config))
    elif isinstance(config, (str, os.PathLike)):
        raw = read_json(config)
    else:
        raise ConfigError(f"config must be a dict or the path of a JSON file, not {type(config).__name__}")
    if "pipeline" in raw:
        raise ConfigError(unsupported("pipeline parallelism (the config's 'pipeline' section)"))
    return raw


def client_config(config: Any) -> dict[str, Any]:
    """A config as DeepSpeed's clients write it (a dict or a JSON path), read into a dict
    zeroshard's loader takes: `steps_per_print: inf` (Accelerate's "never print") is dropped."""
    raw = copy.deepcopy(dict(config)) if isinstance(config, Mapping) else read_json(config)
    every = raw.get("steps_per_print")
    if isinstance(every, float) and math.isinf(every) and every > 0:
        raw.pop("steps_per_print")
    return raw


def unsupported(what: str) -> str:
    return (f"{what} is not supported by zeroshard.deepspeed: zeroshard trains data-parallel ZeRO "
            "(stages 0-3) only; there is no pipeline engine, no mixture-of-experts layer and no model "
            "parallelism (mpu). See docs/deepspeed-migration.md")
