"""Stage 3: which module subtrees are gather units, and which parameters stay whole.

Pure planning over the module tree (no collectives, no copies), so the choice can be
tested and printed. A unit owns the parameters of its subtree that no nested unit
owns; the root module is always a unit and owns the rest. A parameter owned by one
unit but also held directly by a module outside that unit's subtree (tied weights:
an embedding reused as the LM head) makes that module an *external user* of the unit:
the unit is gathered around that module's forward too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from zeroshard.policies import Stage3Policy


@dataclass
class UnitPlan:
    name: str  # module path; "" is the root
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)  # partitioned, owned here
    external_users: list[nn.Module] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


@dataclass
class Stage3Plan:
    units: list[UnitPlan]
    persistent: list[nn.Parameter]  # kept whole on every rank (small)


def plan_stage3(model: nn.Module, policy: Stage3Policy, min_unit_params: int) -> Stage3Plan:
    """Units deepest-first: a module becomes a unit when it matches `unit_classes` or, with
    none given, when its subtree still holds at least `min_unit_params` unclaimed elements."""
    persistent_ids = _persistent(model, policy)
    owner: dict[int, UnitPlan] = {}
    units: list[UnitPlan] = []
    modules = list(model.named_modules())
    for name, module in reversed(modules):  # children before parents
        if module is model:
            continue
        unclaimed = [p for p in module.parameters() if id(p) not in owner and id(p) not in persistent_ids]
        if not unclaimed:
            continue
        if policy.unit_classes:
            hit = type(module).__name__ in policy.unit_classes
        else:
            hit = sum(p.numel() for p in unclaimed) >= min_unit_params
        if hit:
            unit = UnitPlan(name, module, _dedup(unclaimed))
            units.append(unit)
            for p in unit.params:
                owner[id(p)] = unit
    root = UnitPlan("", model, _dedup([p for p in model.parameters()
                                       if id(p) not in owner and id(p) not in persistent_ids]))
    for p in root.params:
        owner[id(p)] = root
    units.append(root)
    _find_external_users(model, units, owner)
    order = {id(m): i for i, (_, m) in enumerate(modules)}
    units.sort(key=lambda u: order[id(u.module)])  # forward-ish order: parents before children
    persistent = _dedup([p for p in model.parameters() if id(p) in persistent_ids])
    return Stage3Plan([u for u in units if u.params], persistent)


def _persistent(model: nn.Module, policy: Stage3Policy) -> set[int]:
    """Small parameters stay whole (DeepSpeed's param_persistence_threshold), smallest first,
    up to model_persistence_threshold elements in all."""
    small = sorted(_dedup([p for p in model.parameters() if p.numel() <= policy.param_persistence_threshold]),
                   key=lambda p: p.numel())
    kept, total = set(), 0
    for p in small:
        if total + p.numel() > policy.model_persistence_threshold:
            break
        kept.add(id(p))
        total += p.numel()
    return kept


def _find_external_users(model: nn.Module, units: list[UnitPlan], owner: dict[int, UnitPlan]) -> None:
    subtree = {id(u.module): {id(m) for m in u.module.modules()} for u in units}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            unit = owner.get(id(p))
            if unit is not None and id(module) not in subtree[id(unit.module)] and module not in unit.external_users:
                unit.external_users.append(module)


def _dedup(params: list[nn.Parameter]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
