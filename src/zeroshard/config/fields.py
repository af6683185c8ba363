"""Field types and the base model every config section derives from.

DeepSpeed validates with lax pydantic, so `5e8` (a JSON float) is a valid
bucket size. These types accept that, but reject what lax pydantic lets slip
through silently: `true` for an integer, `2.5` for an integer, `"two"` for
anything numeric. Every message starts with "expected", so the error layer can
print `path = value: expected ...`.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Annotated, Any, ClassVar, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


def _integral(value: Any) -> int:
    if isinstance(value, bool):
        raise PydanticCustomError("zs_type", "expected an integer, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise PydanticCustomError("zs_type", "expected an integer") from None
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise PydanticCustomError("zs_type", f"expected an integer, got {value}")
        raise PydanticCustomError("zs_type", "expected an integer, got a number with a fractional part")
    raise PydanticCustomError("zs_type", "expected an integer")


def _real(value: Any) -> float:
    if isinstance(value, bool):
        raise PydanticCustomError("zs_type", "expected a number, got a boolean")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise PydanticCustomError("zs_type", "expected a number")


def _boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise PydanticCustomError("zs_type", "expected true or false")


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    raise PydanticCustomError("zs_type", "expected a string")


Int = Annotated[int, BeforeValidator(_integral)]
NonNegInt = Annotated[int, BeforeValidator(_integral), Field(ge=0)]
PosInt = Annotated[int, BeforeValidator(_integral), Field(gt=0)]
Real = Annotated[float, BeforeValidator(_real)]
NonNegReal = Annotated[float, BeforeValidator(_real), Field(ge=0)]
PosReal = Annotated[float, BeforeValidator(_real), Field(gt=0)]
Bool = Annotated[bool, BeforeValidator(_boolean)]
Text = Annotated[str, BeforeValidator(_text)]


class Section(BaseModel):
    """A block of the config. Unknown keys are errors, as in DeepSpeed's pydantic models."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Other spellings the loader rewrites before validation (aliases, legacy names):
    # offered by did-you-mean, never seen by pydantic.
    spellings: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(cls.model_fields) + cls.spellings


def _field_type(model: type[Section], key: Any) -> Any:
    """The type of field `key` of `model`, `X | None` read as X; None when there is no such field."""
    info = model.model_fields.get(key) if isinstance(key, str) else None
    if info is None:
        return None
    args = [a for a in typing.get_args(info.annotation) if a is not type(None)]
    optional = typing.get_origin(info.annotation) in (Union, types.UnionType) and len(args) == 1
    return args[0] if optional else info.annotation


def section_of(model: type[Section], key: Any) -> type[Section] | None:
    """The Section class of field `key` of `model`, or None when it is a plain value."""
    inner = _field_type(model, key)
    return inner if isinstance(inner, type) and issubclass(inner, Section) else None


def is_free_dict(model: type[Section], key: str) -> bool:
    """True for fields holding an unchecked mapping (optimizer/scheduler `params`)."""
    inner = _field_type(model, key)
    return inner is dict or typing.get_origin(inner) is dict


def section_at(root: type[Section], loc: tuple[Any, ...]) -> type[Section] | None:
    """Walk `loc` (a pydantic error location) from `root`; None when it leaves the schema."""
    model: type[Section] | None = root
    for key in loc:
        if model is None:
            return None
        model = section_of(model, key)
    return model


def _finite(value: Any) -> float:
    number = _real(value)
    if number != number or number in (float("inf"), float("-inf")):
        raise PydanticCustomError("zs_type", "expected a finite number")
    return number


def _param_value(kind: str, value: Any) -> Any:
    if kind == "number":
        return _finite(value)
    if kind == "numbers":  # one value, or one per parameter group
        if isinstance(value, (list, tuple)):
            if not value:
                raise PydanticCustomError("zs_type", "expected a number or a non-empty list of numbers")
            return [_finite(v) for v in value]
        return _finite(value)
    if kind == "pair":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise PydanticCustomError("zs_type", "expected a list of two numbers")
        try:
            return [_finite(v) for v in value]
        except PydanticCustomError:
            raise PydanticCustomError("zs_type", "expected a list of two finite numbers") from None
    if kind == "bool":
        return _boolean(value)
    if kind == "int":
        return _integral(value)
    if kind == "posint":
        number = _integral(value)
        if number <= 0:
            raise PydanticCustomError("zs_type", "expected an integer > 0")
        return number
    return _text(value)


def check_free_params(params: dict[str, Any], kinds: dict[str, str]) -> dict[str, Any]:
    """`params` (optimizer / scheduler) with each known key's value checked and coerced to its
    kind; one error naming every bad key. Unknown keys pass through for the builders to judge."""
    out: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in params.items():
        kind = kinds.get(key) if isinstance(key, str) else None
        if kind is None:
            out[key] = value
            continue
        try:
            out[key] = _param_value(kind, value)
        except PydanticCustomError as exc:
            problems.append(f"{key} = {shown(value, 60)}: {exc.message()}")
    if problems:
        raise PydanticCustomError("zs_rule", "{problems}", {"problems": "; ".join(problems)})
    return out


def shown(value: Any, width: int | None = None) -> str:
    """`value` as JSON (its repr where JSON cannot say it), cut to `width` characters."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if width is None or len(text) <= width else text[: width - 3] + "..."
