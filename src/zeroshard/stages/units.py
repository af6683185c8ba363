"""Stage 3: which module subtrees are gather units, and which parameters stay whole.

Pure planning over the module tree (no collectives, no copies), so the choice can be
tested and printed. A unit owns the parameters of its subtree that no nested unit
owns; the root module is always a unit and owns the rest. A parameter owned by one
unit but also held directly by a module outside that unit's subtree (tied weights:
an embedding reused as the LM head) makes that module an *external user* of the unit:
the unit is gathered around that module's forward too.
"""

from __future__ import annotations

import itertools
from collections import Counter
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
    rule: str = ""  # how the units were chosen, for the start-up lines


def plan_stage3(model: nn.Module, policy: Stage3Policy, min_unit_params: int) -> Stage3Plan:
    """Units follow the model's structure (see `unit_modules`); a unit owns the parameters
    of its subtree that no nested unit owns, the root owns the rest."""
    persistent_ids = _persistent(model, policy)
    owner: dict[int, UnitPlan] = {}
    units: list[UnitPlan] = []
    modules = list(model.named_modules())
    chosen, rule = unit_modules(model, policy, min_unit_params, persistent_ids)
    for name, module in reversed(modules):  # children before parents
        if id(module) not in chosen:
            continue
        unclaimed = [p for p in module.parameters() if id(p) not in owner and id(p) not in persistent_ids]
        if unclaimed:
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
    return Stage3Plan([u for u in units if u.params], persistent, rule)


def unit_modules(model: nn.Module, policy: Stage3Policy, min_unit_params: int,
                 persistent_ids: set[int] = frozenset()) -> tuple[set[int], str]:
    """The ids of the modules that become units, and the rule that chose them:

    1. `unit_classes` (zeroshard.stage3_unit_classes / leaf_module.classes): those classes;
    2. else the layers transformers declares unsplittable (`_no_split_modules`);
    3. else the repeated children of a ModuleList / Sequential (block granularity, as FSDP's
       transformer wrap policy), the outermost such repetition;
    then, outside the blocks of 2 and 3, any module whose subtree still holds at least
    `min_unit_params` elements no deeper unit took, or half the smallest block if that is
    less (an embedding about as large as a layer is worth its own gather: left in the root
    it would stay gathered for the whole pass). A container without a forward of its
    own (ModuleList, ModuleDict, ParameterList/Dict) is never a unit: no hook of its fires,
    so its parameters would be gathered by whoever reads them, for the whole pass."""
    modules = list(model.named_modules())
    if policy.unit_classes:
        hits = {id(m) for _, m in modules if m is not model and type(m).__name__ in policy.unit_classes}
        return hits, f"the classes named by stage3_unit_classes ({', '.join(policy.unit_classes)})"
    blocks, rule = _declared_blocks(model)
    if not blocks:
        blocks, rule = _repeated_children(model), "repeated children of ModuleList/Sequential"
    inside = {id(d) for b in blocks.values() for d in b.modules() if d is not b}
    chosen = set(blocks)
    claimed: set[int] = {id(p) for b in blocks.values() for p in b.parameters()} | set(persistent_ids)
    sizes = [sum(p.numel() for p in b.parameters() if id(p) not in persistent_ids) for b in blocks.values()]
    threshold = min([min_unit_params, *(max(1, n // 2) for n in sizes if n > 0)])
    for _, module in reversed(modules):  # what is left, by size, children before parents
        if module is model or id(module) in chosen or id(module) in inside or not _has_forward(module):
            continue
        unclaimed = {id(p): p.numel() for p in module.parameters() if id(p) not in claimed}
        if sum(unclaimed.values()) >= threshold:
            chosen.add(id(module))
            claimed |= set(unclaimed)
    if not blocks:
        rule = f"subtrees of at least stage3_min_unit_params ({min_unit_params:,}) elements"
    elif len(chosen) > len(blocks):
        rule += f", then other subtrees of at least {threshold:,} elements"
    return chosen, rule


def _has_forward(module: nn.Module) -> bool:
    return type(module).forward is not nn.Module.forward


def _declared_blocks(model: nn.Module) -> tuple[dict[int, nn.Module], str]:
    names: set[str] = set()
    for m in model.modules():
        names.update(getattr(m, "_no_split_modules", None) or ())
    hits = {id(m): m for m in model.modules()
            if m is not model and type(m).__name__ in names and any(True for _ in m.parameters())}
    outermost = {i: m for i, m in hits.items()
                 if not any(m is not o and m in set(o.modules()) for o in hits.values())}
    return outermost, f"the model's _no_split_modules ({', '.join(sorted(names))})"


def _repeated_children(model: nn.Module) -> dict[int, nn.Module]:
    """Top-down: at a ModuleList/Sequential, children of a class that occurs at least twice
    (and holds parameters) are blocks; nothing below a block is searched."""
    blocks: dict[int, nn.Module] = {}

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(c) for c in module.children() if any(True for _ in c.parameters()))
            blocks.update((id(c), c) for c in module.children() if counts[type(c)] >= 2)
            rest = [c for c in module.children() if id(c) not in blocks]
        else:
            rest = list(module.children())
        for child in rest:
            visit(child)

    visit(model)
    return blocks


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks (what `engine.compile()` compiles below stage 3)."""
    return list(_repeated_children(model).values())


def _persistent(model: nn.Module, policy: Stage3Policy) -> set[int]:
    """Small parameters stay whole (DeepSpeed's param_persistence_threshold), smallest first,
    up to model_persistence_threshold elements in all."""
    small = sorted(_dedup([p for p in model.parameters() if p.numel() <= policy.param_persistence_threshold]),
                   key=lambda p: p.numel())
    running = itertools.accumulate(p.numel() for p in small)  # sizes ascending: it passes the limit once
    return {id(p) for p, total in zip(small, running) if total <= policy.model_persistence_threshold}


def _find_external_users(model: nn.Module, units: list[UnitPlan], owner: dict[int, UnitPlan]) -> None:
    subtree = {id(u.module): {id(m) for m in u.module.modules()} for u in units}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            unit = owner.get(id(p))
            if unit is not None and id(module) not in subtree[id(unit.module)] and module not in unit.external_users:
                unit.external_users.append(module)


def _dedup(params: list[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())  # first occurrence, in order


def describe_units(units, rule: str, persistent_numel: int, policy: Stage3Policy) -> list[str]:
    """Start-up lines: how many units, their sizes, what the root keeps, and whether the
    config keeps everything gathered anyway (DeepSpeed's defaults do for a small model)."""
    sized = [(u.name, u.numel) for u in units]
    blocks = [n for name, n in sized if name]
    root = sum(n for name, n in sized if not name)
    total = sum(n for _, n in sized)
    lines = [f"stage 3 units: {len(blocks)} + root, chosen by {rule}; "
             + (f"smallest {min(blocks):,} / largest {max(blocks):,} elements; " if blocks else "")
             + f"the root keeps {root:,}; {persistent_numel:,} elements kept whole "
             f"(stage3_param_persistence_threshold {policy.param_persistence_threshold:,})"]
    if len(sized) > 1 and total <= policy.max_live_parameters and total <= policy.max_reuse_distance:
        lines.append(f"all units stay gathered from their forward until their backward: the model ({total:,} "
                     f"elements) is smaller than stage3_max_live_parameters ({policy.max_live_parameters:,}) "
                     f"and stage3_max_reuse_distance ({policy.max_reuse_distance:,}); lower them to shard the "
                     "working set")
    return lines
