"""A DeepSpeed `"optimizer": {"type": "Muon", "params": {...}}` section as Muon param groups.

DeepSpeed 0.19.8 (`deepspeed.set_optimizer_flags`, engine `_muon_param_groups`):
- `deepspeed.initialize` tags every parameter of the model: `use_muon` is True for one whose
  layer shape has at least 2 dimensions and whose name contains neither "embed" nor
  "lm_head", else False (it overwrites tags set before). zeroshard's drop-in does the same;
  `zeroshard.initialize` tags only parameters that have no `use_muon` yet, so a native user's
  own tags decide.
- Each incoming param group (or the loose parameters) is split into a Muon half and an Adam
  half (an empty half is left out): the config's `lr` / `weight_decay` apply to both, `muon_lr`
  / `adam_lr` override the lr of one half, `momentum` / `ns_method` reach only the Muon half,
  `betas` / `eps` only the Adam half, and a group's own keys win. A model with no tagged matrix
  is all Adam half: AdamW with Muon's Adam defaults (lr 3e-4, betas (0.9, 0.95), eps 1e-10).
- A parameter with no `use_muon` at all (in `model_parameters` but not in the model) is
  DeepSpeed's ValueError, here a ConfigError (a ValueError) with DeepSpeed's words.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from zeroshard.optim.muon import Muon
from zeroshard.policies import ConfigError, NotSupportedYetError

__all__ = ["MUON_KEYS", "build_muon", "muon_param_groups", "tag_for_muon"]

_MUON_HALF = ("lr", "momentum", "weight_decay", "ns_method")
_ADAM_HALF = ("lr", "betas", "eps", "weight_decay")
# torch_adam picks torch's AdamW as DeepSpeed's auxiliary Adam: the same update, so no effect here
MUON_KEYS = frozenset(_MUON_HALF + _ADAM_HALF + ("muon_lr", "adam_lr", "adam_w_mode", "per_head_muon", "torch_adam"))

UNTAGGED = ("The Muon optimizer needs every parameter tagged with use_muon, and {n} are not. deepspeed.initialize "
            "tags them from the model it is given, so this means model_parameters holds parameters that model does "
            "not. Set `param.use_muon = True / False` on them, or pass them as part of the model.")


def tag_for_muon(module: nn.Module, overwrite: bool = True) -> None:
    """DeepSpeed's rule: matrices outside embeddings and the head use Muon (see the docstring)."""
    for name, p in module.named_parameters():
        if not overwrite and hasattr(p, "use_muon"):
            continue
        shape = getattr(p, "ds_shape", None) or p.shape  # a stage-3 placeholder keeps its layer shape
        p.use_muon = len(shape) >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def muon_param_groups(params: Iterable[Any], settings: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The Muon and Adam halves of each group in `params` (tensors or param-group dicts)."""
    groups, loose = [], []
    for item in params:
        (groups if isinstance(item, dict) else loose).append(item)
    if loose or not groups:
        groups.append({"params": loose})
    missing = [p for group in groups for p in group["params"] if not hasattr(p, "use_muon")]
    if missing:
        raise ConfigError(UNTAGGED.format(n=len(missing)))
    halves = ((True, "muon", _MUON_HALF, _half_defaults(settings, _MUON_HALF, "muon_lr")),
              (False, "adam", _ADAM_HALF, _half_defaults(settings, _ADAM_HALF, "adam_lr")))
    out = []
    for index, group in enumerate(groups):
        own = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            prefix = own.get("name") or (f"group{index}" if len(groups) > 1 else None)
            options = {**defaults, **{k: v for k, v in own.items() if k in keys}}
            out.append(dict(params=half, use_muon=use_muon, name=f"{prefix}-{label}-params" if prefix
                            else f"{label}-params", **options))
    return out


def _half_defaults(settings: Mapping[str, Any], keys: tuple[str, ...], lr_key: str) -> dict[str, Any]:
    out = {k: settings[k] for k in keys if k in settings}
    if lr_key in settings:
        out["lr"] = settings[lr_key]
    if "betas" in out:
        betas = out["betas"]
        if not isinstance(betas, (list, tuple)) or len(betas) != 2:
            raise ConfigError(f"optimizer 'Muon': betas must be two numbers, got {betas!r}")
        out["betas"] = (float(betas[0]), float(betas[1]))
    return out


def build_muon(params: Iterable[torch.Tensor] | Iterable[dict[str, Any]], settings: Mapping[str, Any]) -> Muon:
    """Muon over `params` from the section's `params` (keys already checked against MUON_KEYS)."""
    if settings.get("per_head_muon"):
        raise NotSupportedYetError("optimizer Muon: per_head_muon = true (per-attention-head Newton-Schulz) is not "
                                   "built by zeroshard yet; remove it or set it to false (whole matrices)")
    groups = muon_param_groups(params, settings)
    try:
        return Muon(groups, adam_w_mode=bool(settings.get("adam_w_mode", True)))
    except ValueError as e:
        raise ConfigError(f"optimizer 'Muon': {e}") from e
