"""DeepSpeed without ZeRO (zero_optimization.stage 0): everything is in the model-states file.

Read from DeepSpeed 0.18/0.19's runtime/engine.py and runtime/fp16/unfused_optimizer.py:

- `_save_checkpoint` writes `optimizer=self.optimizer.state_dict()` into
  `mp_rank_00_model_states.pt` (with `param_shapes=None`) when ZeRO is off, and no
  `*_optim_states.pt` file is written (`save_zero_checkpoint` is set only for an optimizer
  with a `dp_process_group`, which the stage-0 wrappers lack). Every rank holds the same
  state; rank 0 writes it.
- fp32: the optimizer is the torch optimizer itself (its state dict: `state` keyed by the
  parameter's index over `param_groups`, whole-shaped Adam states), and the module's
  parameters are the fp32 masters.
- bf16 (and fp16 with Adam from torch): `_do_optimizer_sanity_check` picks DDP_BFLOAT16 (FP16
  for fp16), i.e. `FP16_UnfusedOptimizer`, whose state dict is `{cur_scale, cur_iter,
  dynamic_loss_scale, [last_overflow_iter, scale_factor, scale_window],
  optimizer_state_dict, fp32_groups}`: `fp32_groups[i][j]` is the fp32 master of the j-th
  parameter of group i, and the inner torch optimizer's state is keyed by its index.
  (BF16_Optimizer, with its bf16_zero_pp_rank_* files, is used at stage 0 only under pipeline
  parallelism, which zeroshard does not read; a bf16 run with grad_accum_dtype fp32 and no
  ZeRO is refused by DeepSpeed itself.) The fused FP16_Optimizer (FusedAdam, a GPU) keeps
  one flat `fp32_groups_flat` per group instead: refused here, named.

The parameters are mapped in the optimizer's order: the module's entries that are not
buffers, in order (DeepSpeed's `model_parameters`), each checked against its saved shape.
Which parameters were frozen is not recorded at stage 0, so a checkpoint whose optimizer holds
fewer parameters than the module is refused.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch

from zeroshard.policies import CheckpointError

VALUES = "stage0_fp32_values"  # the key of the masters in the optimizer dict this module builds


def optimizer_dict(sd: dict[str, Any], path: str, names: list[str]) -> dict[str, Any]:
    """DeepSpeed's stage-0 optimizer state in the form the reader reads stage 3's: one flat
    tensor per parameter (`VALUES`, fp32, in the optimizer's order) and `optimizer_state_dict`
    (torch's, whose state index j is that flat tensor), plus the loss scaler's fields."""
    opt = sd.get("optimizer")
    if not isinstance(opt, dict):
        raise CheckpointError(f"{path}: a DeepSpeed checkpoint without ZeRO (stage 0) and without optimizer state "
                              f"('optimizer' is {type(opt).__name__}): there is nothing to resume from; load its "
                              "'module' weights into the model with torch instead")
    if "fp32_groups_flat" in opt:
        raise CheckpointError(f"{path}: a stage-0 checkpoint of DeepSpeed's fused FP16_Optimizer (fp32_groups_flat, "
                              "written with FusedAdam on a GPU) is not read yet; only torch optimizers (fp32) and "
                              "FP16_UnfusedOptimizer (bf16/fp16 with torch's Adam) are")
    inner = opt.get("optimizer_state_dict") if "fp32_groups" in opt else opt
    if not isinstance(inner, dict) or not isinstance(inner.get("param_groups"), list):
        raise CheckpointError(f"{path}: 'optimizer' is not a torch optimizer state dict (no param_groups)")
    order = [int(i) for g in inner["param_groups"] for i in g.get("params", [])]
    if "fp32_groups" in opt:
        values = [t for g in opt["fp32_groups"] for t in g]
        if len(values) != len(order):
            raise CheckpointError(f"{path}: {len(values)} fp32 masters but {len(order)} parameters in the optimizer")
    else:
        module = sd["module"]
        values = [module[n] for n in names]
    if order != list(range(len(order))):
        raise CheckpointError(f"{path}: optimizer parameter indices {order[:8]} are not 0..{len(order) - 1} in order")
    out = {VALUES: [v.reshape(-1) for v in values], "optimizer_state_dict": inner}
    if "cur_scale" in opt:
        out["loss_scaler"] = {k: opt[k] for k in ("cur_scale", "cur_iter", "dynamic_loss_scale", "last_overflow_iter",
                                                   "scale_factor", "scale_window") if k in opt}
    return out


def parameter_groups(sd: dict[str, Any], path: str) -> list[list[tuple[str, tuple[int, ...]]]]:
    """[(name, shape)] of each optimizer param group: the module's non-buffer entries in order."""
    opt = sd.get("optimizer")
    inner = opt.get("optimizer_state_dict") if isinstance(opt, dict) and "fp32_groups" in opt else opt
    groups = inner.get("param_groups") if isinstance(inner, dict) else None
    if not isinstance(groups, list):
        optimizer_dict(sd, path, [])  # raises the reason
        raise CheckpointError(f"{path}: no optimizer param groups")
    buffers = set(sd.get("buffer_names") or [])
    params = [(n, tuple(t.shape)) for n, t in sd["module"].items() if n not in buffers and torch.is_tensor(t)]
    counts = [len(g.get("params", [])) for g in groups]
    if sum(counts) != len(params):
        raise CheckpointError(f"{path}: the stage-0 optimizer holds {sum(counts)} parameters, the module "
                              f"{len(params)}: DeepSpeed does not record which were frozen at stage 0 (no "
                              "param_shapes), so they cannot be matched; load its 'module' weights into the model with torch instead")
    state = inner.get("state") or {}
    flat_masters = [t for g in opt["fp32_groups"] for t in g] if opt.get("fp32_groups") else None
    for j, (name, shape) in enumerate(params):
        saved = flat_masters[j] if flat_masters is not None else (state.get(j) or {}).get("exp_avg")
        if torch.is_tensor(saved) and saved.numel() != math.prod(shape):
            raise CheckpointError(f"{path}: parameter {j} of the optimizer has {saved.numel()} elements, the module's "
                                  f"{name} {shape}: the order of the optimizer's parameters is not the module's")
    starts = list(itertools.accumulate(counts, initial=0))
    return [params[a:b] for a, b in zip(starts, starts[1:])]
