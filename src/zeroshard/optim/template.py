"""Turn what the user gave (config section, callable, or optimizer instance) into a builder
of the same optimizer over master shards, keeping the user's param groups.

A callable or instance is first seen over the model's own parameters, so its class,
defaults and per-group options (e.g. no weight decay for biases) are known; the same
class is then rebuilt over the fp32 master shards, one bucket set per group.
"""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from zeroshard.optim.factory import build_optimizer
from zeroshard.policies import ConfigError, OptimizerSpec

OptimizerArg = torch.optim.Optimizer | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None


INFERENCE_ONLY = "none (inference only: no gradients, no fp32 masters, no optimizer states)"


class NoOptimizer(torch.optim.Optimizer):
    """What an engine built without an optimizer holds: no parameters, nothing to step."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        super().__init__(groups, {})

    def step(self, closure=None) -> None:
        raise ConfigError(NO_OPTIMIZER)


NO_OPTIMIZER = ("no optimizer: this engine was built without one (inference only, e.g. a reference or reward "
                "model: its parameters are frozen and hold no gradients); to train it add an 'optimizer' "
                'section to the config (e.g. {"type": "AdamW", "params": {"lr": 1e-4}}) or pass optimizer= to '
                "initialize().")


@dataclass
class OptimizerPlan:
    group_of: dict[int, int]  # id(param) -> param group index
    group_options: list[dict[str, Any]]  # per-group options other than "params"
    build: Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
    description: str


def _constructor_kwargs(cls: type, defaults: dict[str, Any]) -> dict[str, Any]:
    """The defaults the constructor accepts by name (some classes record derived keys, e.g.
    AdamW's `decoupled_weight_decay`; those still reach the optimizer through each group)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(defaults)
    return {k: v for k, v in defaults.items() if k in params}


def _prefer_fused(cls: type, defaults: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Ask for the fused kernel when the user left the choice open and torch has one here."""
    if "fused" not in defaults or defaults.get("fused") is not None or defaults.get("foreach"):
        return defaults
    if defaults.get("differentiable") or defaults.get("capturable"):
        return defaults
    try:
        probe = torch.zeros(2, device=device, requires_grad=True)
        cls([probe], **{**defaults, "fused": True})
    except (RuntimeError, ValueError, TypeError):
        return defaults
    return {**defaults, "fused": True}


def plan_optimizer(arg: OptimizerArg, spec: OptimizerSpec | None, params: list[nn.Parameter],
                   device: torch.device) -> OptimizerPlan:
    if arg is not None and spec is not None:
        raise ConfigError("an optimizer was given both in the config ('optimizer' section) and to initialize(); "
                          "remove one of them.")
    if arg is None:
        if spec is None and not params:  # an inference-only engine (a reference or reward model)
            return OptimizerPlan({}, [{}], NoOptimizer, INFERENCE_ONLY)
        if spec is None:
            raise ConfigError("no optimizer: add an 'optimizer' section to the config (e.g. "
                              '{"type": "AdamW", "params": {"lr": 1e-4}}) or pass optimizer= to initialize().')
        if spec.type.lower() == "muon":  # its groups come from the parameters' use_muon tags
            muon = plan_optimizer(build_optimizer(spec, params, device.type), None, params, device)
            return dataclasses.replace(muon, description=f"config {spec.type}")
        return OptimizerPlan({id(p): 0 for p in params}, [{}],
                             lambda groups: build_optimizer(spec, groups, device.type), f"config {spec.type}")
    template = arg if isinstance(arg, torch.optim.Optimizer) else arg(params)
    if not isinstance(template, torch.optim.Optimizer):
        raise ConfigError(f"optimizer callable returned {type(template).__name__}, not a torch.optim.Optimizer")
    group_of: dict[int, int] = {}
    options = []
    for g, group in enumerate(template.param_groups):
        options.append({k: v for k, v in group.items() if k != "params"})
        for p in group["params"]:
            group_of[id(p)] = g
    orphans = [i for i, p in enumerate(params) if id(p) not in group_of]
    if orphans:
        raise ConfigError(f"{len(orphans)} trainable parameters are in no param group of the optimizer given to "
                          "initialize(); add them to it, or set requires_grad=False on them.")
    cls = type(template)
    kwargs = _prefer_fused(cls, _constructor_kwargs(cls, template.defaults), device)

    def build(groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        try:
            return cls(groups, **kwargs)
        except TypeError as exc:
            raise ConfigError(f"cannot rebuild {cls.__name__} over the parameter shards from its defaults ({exc}); "
                              "pass a callable params -> optimizer whose class accepts its own `defaults` as "
                              "keyword arguments, or use the config's 'optimizer' section.") from None

    return OptimizerPlan(group_of, options, build, f"{cls.__name__} (given to initialize)")
