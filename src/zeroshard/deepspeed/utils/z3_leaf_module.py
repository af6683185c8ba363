"""`deepspeed.utils.set_z3_leaf_modules`: modules gathered whole as one stage-3 unit.

DeepSpeed flags each module of the given classes (`_z3_leaf`) so ZeRO-3 gathers its
parameters together. zeroshard flags them the same way; `deepspeed.initialize` then adds
the flagged modules' class names to `zero_optimization.leaf_module.classes`, which makes
every module of those classes one gather unit (zeroshard.stages.units). Call it before
`initialize`, as with DeepSpeed.
"""

from __future__ import annotations

from torch import nn

__all__ = ["flagged_classes", "get_z3_leaf_modules", "set_z3_leaf_modules", "unset_z3_leaf_modules",
           "z3_leaf_module"]


def _matches(module: nn.Module, classes) -> bool:
    return any(type(module).__name__ == c if isinstance(c, str) else isinstance(module, c) for c in classes)


def _flag(model: nn.Module, classes, value: bool, raise_if_not_found: bool) -> list[nn.Module]:
    hits = [m for m in model.modules() if _matches(m, classes)]
    if not hits and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"No modules of type {names} found in model {type(model).__name__}")
    for m in hits:
        m._z3_leaf = value
    return hits


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    return _flag(model, list(leaf_module_classes), True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    return _flag(model, list(leaf_module_classes), False, raise_if_not_found)


def z3_leaf_module(model: nn.Module) -> bool:
    return bool(getattr(model, "_z3_leaf", False))


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def flagged_classes(model: nn.Module) -> list[str]:
    """Class names of the flagged modules, in order of first appearance."""
    return list(dict.fromkeys(type(m).__name__ for m in get_z3_leaf_modules(model)))
