"""Turn pydantic's ValidationError into one ConfigError a user can act on.

Each problem becomes one line naming the full key path, the bad value and
what was expected; unknown keys get the closest valid key of their block, or
the block where the key belongs when it was put in the wrong one.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from zeroshard.config.fields import Section, section_at, section_of, shown
from zeroshard.config.suggest import closest

# Keys users put in the wrong block, and what to say (pain point: fp16 keys in bf16).
_MISPLACED_HINTS = {("bf16", key): "bf16 needs no loss scaling; fp16 loss-scale keys belong in fp16"
                    for key in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                                "min_loss_scale")}


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc)


def key_homes(root: type[Section], key: str) -> list[str]:
    """Dotted paths of the blocks (below the top level too) that have a key named `key`."""
    found: list[str] = []
    stack: list[tuple[type[Section], tuple[str, ...]]] = [(root, ())]
    while stack:
        model, path = stack.pop()
        if key in model.keys():
            found.append(_dotted(path) or "the top level")
        for name in model.model_fields:
            sub = section_of(model, name)
            if sub is not None and len(path) < 3:
                stack.append((sub, path + (name,)))
    return found


def _unknown_key(root: type[Section], loc: tuple[Any, ...]) -> str:
    key, parent = str(loc[-1]), loc[:-1]
    where = f"in {_dotted(parent)}" if parent else "at top level"
    text = f"unknown key {key!r} {where}"
    hint = _MISPLACED_HINTS.get((_dotted(parent), key))
    if hint:
        return f"{text}; {hint}"
    model = section_at(root, parent)
    homes = [h for h in key_homes(root, key) if h != (_dotted(parent) or "the top level")]
    if 0 < len(homes) <= 3:
        return f"{text}; {key!r} belongs in {' or '.join(homes)}"
    match = closest(key, model.keys()) if model is not None else None
    if match is not None:
        return f"{text}; did you mean {match!r}?"
    if model is not None and len(model.model_fields) <= 12:
        return f"{text}; valid keys here: {', '.join(sorted(model.model_fields))}"
    return text


_EXPECTED = {**dict.fromkeys(("model_type", "model_attributes_type", "dict_type", "dict_attributes_type"),
                             "expected an object ({...})"),
             "list_type": "expected a list", "string_type": "expected a string", "str_type": "expected a string"}
_BOUNDS = {"greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le")}


def _expected(error: dict[str, Any]) -> str:
    kind, msg = error["type"], error["msg"]
    if kind.startswith("zs_"):
        return msg
    if kind in _EXPECTED:
        return _EXPECTED[kind]
    if kind in _BOUNDS:
        sign, key = _BOUNDS[kind]
        return f"expected a value {sign} {error['ctx'][key]}"
    if msg.startswith("Input should be "):
        return "expected " + msg.removeprefix("Input should be ")
    return msg.removeprefix("Value error, ")


def _as_written(loc: tuple[Any, ...], renames: dict[tuple, tuple] | None) -> tuple[Any, ...]:
    """`loc` with its longest renamed prefix put back the way the user spelt it."""
    for n in range(len(loc), 0, -1):
        if renames and loc[:n] in renames:
            return tuple(renames[loc[:n]]) + loc[n:]
    return loc


def describe(root: type[Section], error: dict[str, Any], renames: dict[tuple, tuple] | None = None) -> str:
    """One line for one pydantic error (key paths as the user wrote them, given `renames`)."""
    schema_loc = tuple(error["loc"])
    loc = _as_written(schema_loc, renames)
    kind = error["type"]
    if kind == "extra_forbidden":
        text = _unknown_key(root, schema_loc)
        if loc != schema_loc and schema_loc[:-1]:
            text = text.replace(f"in {_dotted(schema_loc[:-1])}", f"in {_dotted(loc[:-1])}", 1)
        return text
    if kind == "missing":
        return f"{_dotted(loc[:-1]) or 'top level'}: missing required key {str(loc[-1])!r}"
    path = _dotted(loc) or "config"
    if kind == "zs_rule":
        return f"{path}: {error['msg']}"
    return f"{path} = {shown(error.get('input'), 80)}: {_expected(error)}"


def to_config_error(root: type[Section], exc: ValidationError, origin: str,
                    renames: dict[tuple, tuple] | None = None) -> str:
    """The message of the single ConfigError replacing `exc`."""
    lines = list(dict.fromkeys(describe(root, e, renames) for e in exc.errors(include_url=False)))
    if len(lines) == 1:
        return f"{origin}: {lines[0]}"
    return f"{origin}: {len(lines)} problems:\n" + "\n".join(f"  - {line}" for line in lines)
