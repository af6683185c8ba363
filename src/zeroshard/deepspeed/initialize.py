"""`deepspeed.initialize` over `zeroshard.initialize`: the same 4-tuple, DeepSpeed's meaning.

    engine, optimizer, trainloader, lr_scheduler = deepspeed.initialize(
        args=args, model=net, model_parameters=net.parameters(), training_data=trainset)

- the config: `config` (dict or JSON path), else `config_params`, else `args.deepspeed_config`;
- the optimizer: the config's `optimizer` section built over `model_parameters` (parameters
  or param-group dicts; default: the model's trainable parameters), or `optimizer` (an
  optimizer instance, or a callable called with `model_parameters`); rebuilt by zeroshard
  over its fp32 shards with the same class, options and groups;
- the scheduler: the config's `scheduler` section, or `lr_scheduler` (instance or callable);
- the data loader: `training_data` with a DistributedSampler, micro-batch per rank
  (see dataloader.py), or None.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

import zeroshard
from zeroshard.comm import world_size_hint
from zeroshard.config import load_config
from zeroshard.deepspeed.config import client_config, resolve_config, unsupported
from zeroshard.deepspeed.dataloader import build_dataloader
from zeroshard.deepspeed.engine import DeepSpeedEngine
from zeroshard.deepspeed.utils.z3_leaf_module import flagged_classes
from zeroshard.deepspeed.zero import forget_ds_attributes
from zeroshard.optim.factory import build_optimizer
from zeroshard.optim.muon_groups import tag_for_muon
from zeroshard.policies import ConfigError

log = logging.getLogger("zeroshard")

__all__ = ["initialize"]


def initialize(args=None, model: nn.Module | None = None, optimizer=None, model_parameters=None,
               training_data=None, lr_scheduler=None, distributed_port: int = 29500, mpu=None,
               dist_init_required: bool | None = None, collate_fn=None, config=None, mesh_param=None,
               config_params=None):
    """Returns `(engine, optimizer, training_dataloader, lr_scheduler)` as DeepSpeed does;
    `engine` is a `DeepSpeedEngine` over a `zeroshard.Engine` (its `.zeroshard`)."""
    if model is None:
        raise ConfigError("initialize() needs a model (model=...)")
    if mpu is not None:
        raise ConfigError(unsupported("model parallelism (initialize(mpu=...))"))
    if mesh_param is not None:
        raise ConfigError(unsupported("tensor / sequence parallelism (initialize(mesh_param=...))"))
    if type(model).__name__ == "PipelineModule":
        raise ConfigError(unsupported("pipeline parallelism (a PipelineModule model)"))
    raw = resolve_config(args, config, config_params)
    as_given = copy.deepcopy(raw)  # engine.config: what the caller passed (Trainer reads it back)
    drop_last = bool(raw.pop("dataloader_drop_last", False))  # the shim builds the loader, so it acts on it
    raw = client_config(raw)  # steps_per_print: inf (Accelerate) means never print
    _add_z3_leaf_classes(raw, model)

    if str((raw.get("optimizer") or {}).get("type", "")).lower() == "muon":
        tag_for_muon(model)  # deepspeed.set_optimizer_flags: every parameter of the model, overwriting
    opt_arg = optimizer
    params = _as_list(model_parameters)
    if optimizer is None and "optimizer" in raw and params is not None and not _is_all_trainable(params, model):
        hidden = getattr(getattr(model, "config", None), "hidden_size", None)
        spec = load_config(raw, world_size_hint(), hidden_size=hidden).optimizer
        opt_arg = build_optimizer(spec, params, "cuda" if torch.cuda.is_available() else "cpu")
        raw = {k: v for k, v in raw.items() if k != "optimizer"}
    elif optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer) and params is not None:
        opt_arg = optimizer(params)  # DeepSpeed calls a client optimizer callable with model_parameters
    if isinstance(opt_arg, torch.optim.Optimizer):
        _freeze_unoptimized(model, opt_arg)

    engine = zeroshard.initialize(model, raw, opt_arg, lr_scheduler)
    forget_ds_attributes(model)
    if isinstance(opt_arg, torch.optim.Optimizer):
        # DeepSpeed steps the client's optimizer object itself, so a scheduler built over it
        # (Accelerate's AcceleratedScheduler, a script's LambdaLR) sets the lr that is used;
        # zeroshard steps a rebuild over its shards: the client's groups become the rebuild's
        if len(opt_arg.param_groups) == len(engine.optimizer.param_groups):
            opt_arg.param_groups = engine.optimizer.param_groups
        else:
            log.warning("initialize: the optimizer's %d param group(s) became %d over zeroshard's shards; a "
                        "scheduler built over the optimizer you passed will not reach them (pass it to "
                        "initialize(lr_scheduler=...) instead)", len(opt_arg.param_groups),
                        len(engine.optimizer.param_groups))
    loader = None
    if training_data is not None:
        loader = build_dataloader(training_data, engine.train_micro_batch_size_per_gpu(), engine.world_size,
                                  engine.rank, collate_fn, drop_last)
    return DeepSpeedEngine(engine, loader, as_given), engine.optimizer, loader, engine.lr_scheduler


def _add_z3_leaf_classes(raw: dict[str, Any], model: nn.Module) -> None:
    """Modules flagged by `deepspeed.utils.set_z3_leaf_modules` are gather units: their
    classes join zeroshard's `zero_optimization.leaf_module.classes`."""
    leaves = flagged_classes(model)
    if leaves:
        zero = raw.setdefault("zero_optimization", {})
        leaf = zero.setdefault("leaf_module", {})
        classes = list(leaf.get("classes") or [])
        leaf["classes"] = classes + [c for c in leaves if c not in classes]


def _as_list(model_parameters) -> list[Any] | None:
    if model_parameters is None:
        return None
    if torch.is_tensor(model_parameters) or isinstance(model_parameters, dict):
        return [model_parameters]
    return list(model_parameters)  # generators (model.parameters(), filter(...)) are read once


def _is_all_trainable(params: list[Any], model: nn.Module) -> bool:
    """One plain list of exactly the model's trainable parameters: the config path as is."""
    return (all(torch.is_tensor(p) for p in params)
            and {id(p) for p in params} == {id(p) for p in model.parameters() if p.requires_grad})


def _freeze_unoptimized(model: nn.Module, template: torch.optim.Optimizer) -> None:
    """Trainable parameters outside the optimizer's groups never change under DeepSpeed;
    zeroshard trains only what the optimizer holds, so they are frozen, with a note."""
    held = {id(p) for group in template.param_groups for p in group["params"]}
    left = [name for name, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if not left:
        return
    for name, p in model.named_parameters():
        if name in left:
            p.requires_grad_(False)
    more = f" (+{len(left) - 5} more)" if len(left) > 5 else ""
    log.warning("initialize: %d trainable parameter(s) are not in model_parameters / the optimizer and will not "
                "be trained; set requires_grad=False: %s%s", len(left), ", ".join(left[:5]), more)
