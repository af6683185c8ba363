"""`load_config`: a dict or a DeepSpeed JSON file in, frozen `Settings` out.

Pipeline: read (JSON errors with line and column, duplicate keys refused as
DeepSpeed does) -> normalize (aliases, legacy forms, "auto") -> validate
(pydantic, one ConfigError for every problem) -> cross-field checks (precision,
features not built yet, batch arithmetic) -> policies.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping

from pydantic import ValidationError

from zeroshard.config.batch import resolve_batch
from zeroshard.config.build import (
    build_notes, build_settings, gradient_reduce_policy, precision_policy, runtime_policy,
)
from zeroshard.config.normalize import normalize
from zeroshard.config.schema import RootConfig
from zeroshard.config.support import check_support, ignored_notes
from zeroshard.config.validation import to_config_error
from zeroshard.policies import ConfigError, Settings


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def read_json(path: str | os.PathLike) -> dict[str, Any]:
    """Parse a JSON config file; every failure is a ConfigError naming the file."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {str(file)!r}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {str(file)!r}: {exc}") from None
    try:
        data = json.loads(text, object_pairs_hook=_refuse_duplicates)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{file}: invalid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except ConfigError as exc:
        raise ConfigError(f"{file}: {exc} (each key may appear once per block)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a JSON object {{...}}, not {type(data).__name__}")
    return data


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} = {value!r}: expected an integer >= {minimum}")


def load_config(source: Mapping[str, Any] | str | os.PathLike, world_size: int, *,
                hidden_size: int | None = None) -> Settings:
    """Validate a DeepSpeed-style config (a dict, or the path of a JSON file) into `Settings`.

    `world_size` is the data-parallel size used by the batch arithmetic. `hidden_size`, when
    given, fills `"auto"` bucket sizes the way Hugging Face's integration does.
    Raises ConfigError (NotSupportedYetError for features zeroshard has not built).
    """
    _check_int("world_size", world_size, 1)
    if hidden_size is not None:
        _check_int("hidden_size", hidden_size, 1)
    if isinstance(source, Mapping):
        data, origin = dict(source), "config"
    elif isinstance(source, (str, os.PathLike)):
        data, origin = read_json(source), str(source)
    else:
        raise ConfigError(f"config must be a dict or the path of a JSON file, not {type(source).__name__}")
    renames: dict[tuple, tuple] = {}
    try:
        data, notes = normalize(data, hidden_size, renames)
        config = RootConfig.model_validate(data)
        precision_policy(config)
        notes += check_support(config)
        gradient_reduce_policy(config)
        runtime_policy(config)
        batch, batch_notes = resolve_batch(
            config.train_batch_size, config.train_micro_batch_size_per_gpu,
            config.gradient_accumulation_steps, world_size)
    except ValidationError as exc:
        raise ConfigError(to_config_error(RootConfig, exc, origin, renames)) from None
    except ConfigError as exc:
        raise type(exc)(f"{origin}: {exc}") from None
    notes += batch_notes + build_notes(config) + ignored_notes(config)
    raw = {**config.model_dump(mode="json", exclude_unset=True), "train_batch_size": batch.train_batch_size,
           "train_micro_batch_size_per_gpu": batch.micro_batch_size,
           "gradient_accumulation_steps": batch.gradient_accumulation_steps}
    return build_settings(config, batch, raw, notes)
