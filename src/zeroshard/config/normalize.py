"""Rewrite what users write into the one spelling the schema validates, with a note per rewrite.

Runs before validation, on a deep copy of the user's dict:
* keys DeepSpeed 0.19 removed: error (DeepSpeed refuses them too);
* top-level keys DeepSpeed ignores (unknown or dotted): removed, one note each (`foreign.py`);
* legacy forms: `bfloat16`, `"zero_optimization": true` (+ `allgather_size`);
* `stage3_*` aliases and deprecated `zero_optimization` keys;
* `aio` nested inside `zero_optimization`, and `aio.thread_count`;
* `"auto"` values: the Hugging Face heuristics when `hidden_size` is known, otherwise
  the key is dropped so the default applies (DeepSpeed's non-strict behaviour).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

from zeroshard.config.fields import Section, is_free_dict, section_of
from zeroshard.config.foreign import ROOT_FIELDS, triage_top_level
from zeroshard.config.schema import RootConfig
from zeroshard.config.zero_schema import STAGE3_ALIASES
from zeroshard.policies import HIDDEN_SIZE_AUTO, ConfigError, ZeroPolicy

# DeepSpeed 0.19.8 refuses these even when disabled (`runtime/config.py`
# _REMOVED_TOP_LEVEL_CONFIG_KEYS): key -> what DeepSpeed says became of the feature.
REMOVED_TOP_KEYS = {
    "nebula": "Nebula checkpointing was removed",
    "compression_training": "the compression library was removed (the model would train unquantized)",
    "amp": "Apex AMP was removed; use fp16, bf16 or torch_autocast",
    "quantize_training": "MoQ (quantize_training) was removed",
    "sparse_gradients": "sparse compression of dense embedding gradients was removed",
    "eigenvalue": "eigenvalue-based MoQ was removed",
    "sparse_attention": "Sparse Attention was removed",
    "elasticity": "elastic training was removed; set the batch sizes directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "the top-level block was removed; DeepSpeed reads "
                           "data_efficiency.data_sampling.curriculum_learning instead",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}
REMOVED_ZERO_KEYS = ("mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _rename(block: dict, old: str, new: str, where: str, renames: dict) -> None:
    """Move block[old] to block[new]; both given with different values is an error.

    `renames` records (path of the new key) -> (path the user wrote), so that a validation
    error names the key as the user spelt it."""
    value = block.pop(old)
    if new in block and block[new] != value:
        raise ConfigError(
            f"{where}: {old!r} = {value!r} and {new!r} = {block[new]!r} are both given; "
            f"{old!r} is another name for {new!r}, keep one")
    block[new] = value
    prefix = tuple(where.split(".")) if where else ()
    renames[prefix + (new,)] = prefix + (old,)


def _refuse_removed(data: dict) -> None:
    found = [f"{key!r} ({why})" for key, why in REMOVED_TOP_KEYS.items() if key in data]
    zero = data.get("zero_optimization")
    if isinstance(zero, dict):
        found += [repr(f"zero_optimization.{key}") for key in REMOVED_ZERO_KEYS if key in zero]
    if found:
        raise ConfigError(
            "removed key(s) " + ", ".join(found) + ": DeepSpeed removed them too (0.19 rejects them with "
            "DeepSpeedConfigError, even when disabled); delete them from the config")


def _refuse_non_string_keys(node: Any, path: str = "") -> None:
    """Keys must be strings (as in JSON); say which, exactly (pydantic shows `True` as 1)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if not isinstance(key, str):
                where = f"in {path}" if path else "at top level"
                raise ConfigError(f"key {key!r} {where} is not a string; keys must be strings")
            _refuse_non_string_keys(value, f"{path}.{key}" if path else key)
    elif isinstance(node, (list, tuple)):
        for i, value in enumerate(node):
            _refuse_non_string_keys(value, f"{path}[{i}]")


def _legacy_top(data: dict, notes: list[str], renames: dict) -> None:
    if "bfloat16" in data:
        if "bf16" in data:
            raise ConfigError("both 'bf16' and its legacy name 'bfloat16' are given; keep 'bf16'")
        data["bf16"] = data.pop("bfloat16")
        renames[("bf16",)] = ("bfloat16",)
        notes.append("'bfloat16' is the legacy name of 'bf16'; read as bf16")
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        block: dict[str, Any] = {"stage": 1 if zero else 0}
        if zero:
            block["allgather_bucket_size"] = data.pop("allgather_size", ZeroPolicy.allgather_bucket_size)
        data["zero_optimization"] = block
        notes.append(f'legacy "zero_optimization": {str(zero).lower()} read as stage {block["stage"]}')
    elif "allgather_size" in data:
        notes.append("ignored: allgather_size (legacy; read only with \"zero_optimization\": true; "
                     "use zero_optimization.allgather_bucket_size)")


def _offload_flag(zero: dict, old: str, new: str, notes: list[str]) -> None:
    flag = zero.pop(old)
    if flag not in (True, False, None):
        raise ConfigError(f"zero_optimization.{old} = {flag!r}: expected true or false")
    notes.append(f"zero_optimization.{old} is deprecated; read as zero_optimization.{new}"
                 + (".device = \"cpu\"" if flag else " unchanged (it was false)"))
    if not flag:
        return
    block = zero.get(new)
    if isinstance(block, dict) and block.get("device", "none") not in ("cpu", "none"):
        raise ConfigError(f"zero_optimization.{old} = true conflicts with zero_optimization.{new}.device = "
                          f"{block['device']!r}; remove {old!r}")
    if isinstance(block, dict):
        block["device"] = "cpu"
    else:
        zero[new] = {"device": "cpu"}


def _zero_rewrites(data: dict, zero: dict, notes: list[str], renames: dict) -> None:
    for alias, canonical in STAGE3_ALIASES.items():
        if alias in zero:
            _rename(zero, alias, canonical, "zero_optimization", renames)
    old16 = "stage3_gather_fp16_weights_on_model_save"
    if old16 in zero:
        _rename(zero, old16, "gather_16bit_weights_on_model_save", "zero_optimization", renames)
        notes.append(f"zero_optimization.{old16} is deprecated; read as "
                     "zero_optimization.stage3_gather_16bit_weights_on_model_save")
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if old in zero:
            _offload_flag(zero, old, new, notes)
    if "cpu_offload_use_pin_memory" in zero:
        zero.pop("cpu_offload_use_pin_memory")
        notes.append("ignored: zero_optimization.cpu_offload_use_pin_memory (deprecated, DeepSpeed ignores it "
                     "too); use offload_optimizer.pin_memory / offload_param.pin_memory")
    if "aio" in zero:
        nested = zero.pop("aio")
        top = data.get("aio")
        if isinstance(top, dict) and isinstance(nested, dict):
            for key, value in nested.items():
                if key in top and top[key] != value:
                    raise ConfigError(f"aio.{key} is given both at top level ({top[key]!r}) and inside "
                                      f"zero_optimization ({value!r}); keep the top-level aio block")
                top[key] = value
        else:
            data["aio"] = nested
        notes.append("zero_optimization.aio moved to the top-level aio block (where DeepSpeed reads it)")


def _drop_auto(block: dict, model: type[Section], path: str, dropped: list[str]) -> None:
    """Remove "auto" values of known keys (unknown keys stay, for validation to report)."""
    for key in list(block):
        if key not in model.model_fields:
            continue
        value = block[key]
        if _is_auto(value):
            del block[key]
            dropped.append(path + key)
            continue
        sub = section_of(model, key)
        if sub is not None and isinstance(value, dict):
            _drop_auto(value, sub, f"{path}{key}.", dropped)
        elif is_free_dict(model, key) and isinstance(value, dict) and not (path == "" and key in ROOT_FIELDS):
            for inner in [k for k, v in value.items() if _is_auto(v)]:
                del value[inner]
                dropped.append(f"{path}{key}.{inner}")


def _resolve_auto(data: dict, hidden_size: int | None, notes: list[str]) -> None:
    zero = data.get("zero_optimization")
    if isinstance(zero, dict) and hidden_size is not None:
        filled = []
        for key, formula in HIDDEN_SIZE_AUTO.items():
            if _is_auto(zero.get(key)):
                zero[key] = formula(hidden_size)
                filled.append(f"zero_optimization.{key} = {zero[key]}")
        if filled:
            notes.append(f'"auto" filled from hidden_size {hidden_size}: ' + ", ".join(filled))
    if _is_auto(data.get("gradient_clipping")):
        data["gradient_clipping"] = 0.0
        notes.append('gradient_clipping "auto" read as 0 (no clipping); set a number to clip')
    dropped: list[str] = []
    _drop_auto(data, RootConfig, "", dropped)
    if dropped:
        hint = ("; pass hidden_size to fill bucket sizes as Hugging Face does"
                if any(k.split(".")[-1] in HIDDEN_SIZE_AUTO for k in dropped) else "")
        notes.append('"auto" left to the default for: ' + ", ".join(dropped) + hint)


def normalize(config: Mapping[str, Any], hidden_size: int | None,
              renames: dict[tuple, tuple] | None = None) -> tuple[dict[str, Any], list[str]]:
    """A rewritten deep copy of `config` and the notes describing each rewrite.

    When `renames` is given it is filled with (path after the rewrite) -> (path as written)
    for every renamed key, for error messages."""
    data = copy.deepcopy(dict(config))
    notes: list[str] = []
    renames = {} if renames is None else renames
    _refuse_non_string_keys(data)
    _refuse_removed(data)
    _legacy_top(data, notes, renames)
    triage_top_level(data, RootConfig.keys(), RootConfig, notes)
    zero = data.get("zero_optimization")
    if isinstance(zero, dict):
        _zero_rewrites(data, zero, notes, renames)
    aio = data.get("aio")
    if isinstance(aio, dict) and "thread_count" in aio:
        _rename(aio, "thread_count", "intra_op_parallelism", "aio", renames)
        notes.append("aio.thread_count is the old name of aio.intra_op_parallelism; read as "
                     f"intra_op_parallelism = {aio['intra_op_parallelism']} (DeepSpeed 0.19 silently ignores it)")
    _resolve_auto(data, hidden_size, notes)
    return data, notes
