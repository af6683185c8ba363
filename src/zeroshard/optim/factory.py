"""Build a `torch.optim` optimizer from a DeepSpeed `optimizer` section.

zeroshard never writes its own optimizer kernels: the sharded optimizer steps a
stock torch optimizer over fp32 shards (DESIGN.md section 4). This module turns
DeepSpeed's names and defaults into that torch optimizer, and picks the fastest
kernel torch has for the device (fused, else foreach, else the for-loop).

DeepSpeed semantics kept on purpose, because configs are copied between systems:
- "adam" means AdamW (decoupled weight decay) unless `adam_w_mode` is false;
  DeepSpeed's FusedAdam defaults to `adam_w_mode=True`.
- "adamw" is always decoupled; DeepSpeed ignores `adam_w_mode` there, so do we.
- Adam/AdamW `weight_decay` defaults to 0.0 (FusedAdam's default), not torch
  AdamW's 0.01: the same JSON must mean the same training.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from zeroshard.optim.lamb import Lamb
from zeroshard.optim.lion import Lion
from zeroshard.optim.muon import Muon
from zeroshard.optim.muon_groups import MUON_KEYS, build_muon
from zeroshard.optim.onebit import OneBitAdam
from zeroshard.optim.onebit_lamb import OneBitLamb
from zeroshard.optim.zeroone import ZeroOneAdam
from zeroshard.optim.uncorrected_adam import UncorrectedAdam
from zeroshard.policies import ConfigError, NotSupportedYetError, OptimizerSpec
from zeroshard.policies.onebit import (
    ONEBIT_ADAM_KEYS, ONEBIT_KINDS, ONEBIT_LAMB_KEYS, ZERO_ONE_ADAM_KEYS, onebit_kwargs,
)

__all__ = ["build_optimizer", "optimizer_kernel", "optimizer_state_bytes_per_param"]

# Accepted in a DeepSpeed Adam config, consumed here, never passed to torch.
_DEEPSPEED_ONLY = frozenset({"bias_correction", "adam_w_mode", "torch_adam"})
_ADAM_KEYS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"}) | _DEEPSPEED_ONLY

_VALID_KEYS: dict[str, frozenset[str]] = {
    "adam": _ADAM_KEYS,
    "adamw": _ADAM_KEYS,
    "sgd": frozenset({"lr", "momentum", "dampening", "weight_decay", "nesterov"}),
    "adagrad": frozenset({"lr", "lr_decay", "weight_decay", "initial_accumulator_value", "eps"}),
    "lion": frozenset({"lr", "betas", "weight_decay"}),
    "lamb": frozenset({"lr", "bias_correction", "betas", "eps", "eps_inside_sqrt", "weight_decay", "max_coeff",
                       "min_coeff", "amsgrad"}),
    "muon": MUON_KEYS,
    "onebitadam": ONEBIT_ADAM_KEYS,
    "zerooneadam": ZERO_ONE_ADAM_KEYS,
    "onebitlamb": ONEBIT_LAMB_KEYS,
}

# DeepSpeed optimizers with no torch equivalent yet: a clear "not yet", not "unknown".
_DEEPSPEED_NOT_YET = frozenset({"muadam", "muadamw", "musgd"})


def _classify(spec: OptimizerSpec) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """The torch class and its keyword arguments, after validating the DeepSpeed params."""
    kind = spec.type.lower()
    if kind in _DEEPSPEED_NOT_YET:
        raise NotSupportedYetError(f"optimizer type {spec.type!r} is a DeepSpeed optimizer zeroshard does not "
                                   f"build yet; use one of {sorted(_VALID_KEYS)}")
    if kind not in _VALID_KEYS:
        raise ConfigError(f"unknown optimizer type {spec.type!r}; valid types: {sorted(_VALID_KEYS)}")
    params = dict(spec.params)
    if "max_grad_norm" in params and kind not in ONEBIT_KINDS:
        raise ConfigError(f"optimizer {spec.type!r}: 'max_grad_norm' is not an optimizer parameter; "
                          "set the top-level 'gradient_clipping' instead")
    unknown = sorted(set(params) - _VALID_KEYS[kind])
    if unknown:
        raise ConfigError(f"optimizer {spec.type!r}: unknown parameter(s) {unknown}; "
                          f"valid keys: {sorted(_VALID_KEYS[kind])}")
    if kind == "muon":  # param groups split by use_muon: optim/muon_groups.py
        return Muon, params
    if kind == "sgd":
        return torch.optim.SGD, params
    if kind == "adagrad":
        return torch.optim.Adagrad, params
    if "betas" in params:
        betas = params["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"optimizer {spec.type!r}: betas must be two numbers, got {betas!r}")
        params["betas"] = (float(betas[0]), float(betas[1]))
    if kind == "lion":
        return Lion, params
    if kind in ONEBIT_KINDS:
        return {"onebitadam": OneBitAdam, "zerooneadam": ZeroOneAdam, "onebitlamb": OneBitLamb}[kind], \
            onebit_kwargs(params)
    if kind == "lamb":
        return Lamb, params

    corrected = params.pop("bias_correction", True)
    params.pop("torch_adam", None)
    adam_w_mode = params.pop("adam_w_mode", True)
    decoupled = kind == "adamw" or bool(adam_w_mode)
    params.setdefault("weight_decay", 0.0)
    if not corrected:  # DeepSpeed's kernels with both corrections 1; torch's Adam has no such switch
        if params.pop("amsgrad", False):
            raise ConfigError(f"optimizer {spec.type!r}: amsgrad with bias_correction=false is not built")
        return UncorrectedAdam, {**params, "adam_w_mode": decoupled}
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), params


def _probe(cls: type[torch.optim.Optimizer], kwargs: Mapping[str, Any], device_type: str) -> bool:
    """True if `cls(**kwargs)` builds and steps on a one-element fp32 tensor of `device_type`:
    torch's support tables say which devices *should* have fused/foreach kernels; only a real
    step proves the combination of kernel, options and build works."""
    p = torch.zeros(1, device=device_type, requires_grad=True)
    p.grad = torch.ones_like(p)
    try:
        cls([p], **kwargs).step()
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False
    return True


def build_optimizer(spec: OptimizerSpec, params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
                    device_type: str = "cpu") -> torch.optim.Optimizer:
    """A torch optimizer over `params` (tensors or param-group dicts) as `spec` describes;
    ConfigError naming the optimizer and the key for anything invalid."""
    cls, kwargs = _classify(spec)
    if cls is Muon:
        return build_muon(params, kwargs)
    try:
        torch.zeros(1, device=device_type)
    except (RuntimeError, AssertionError) as e:
        raise ConfigError(f"optimizer device type {device_type!r} is not available: {e}") from e
    loop = {"foreach": False} if "foreach" in inspect.signature(cls).parameters else {}  # always available
    kernel = next((k for k in ({"fused": True}, {"foreach": True}) if _probe(cls, {**kwargs, **k}, device_type)),
                  loop)
    try:
        return cls(list(params), **kwargs, **kernel)
    except ValueError as e:
        raise ConfigError(f"optimizer {spec.type!r}: {e}") from e


def optimizer_kernel(opt: torch.optim.Optimizer) -> str:
    """Which implementation `opt` steps with: "fused", "foreach" or "for-loop"."""
    if opt.defaults.get("fused"):
        return "fused"
    if opt.defaults.get("foreach"):
        return "foreach"
    return "for-loop"


def optimizer_state_bytes_per_param(spec: OptimizerSpec) -> int:
    """fp32 optimizer-state bytes per parameter, for estimates and docs: Adam/AdamW keep exp_avg
    and exp_avg_sq (8; amsgrad adds max_exp_avg_sq, 12), SGD a momentum buffer only when
    momentum != 0 (4 or 0), Adagrad the sum of squares (4), Lion its momentum (4), Lamb its two moments (8). torch's scalar `step` is not counted."""
    cls, kwargs = _classify(spec)
    if cls in (ZeroOneAdam, OneBitLamb):  # m, v and u / v_fresh; the 1-bit errors come on top
        return 12
    if cls in (Lamb, OneBitAdam, UncorrectedAdam):  # the 1-bit errors come on top after freeze_step (error_bytes)
        return 8
    if cls is Muon:  # 4 (momentum) for matrices, 8 (AdamW) for the rest; the upper bound
        return 8
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        return 12 if kwargs.get("amsgrad") else 8
    if cls is torch.optim.SGD:
        return 4 if kwargs.get("momentum", 0) else 0
    return 4
