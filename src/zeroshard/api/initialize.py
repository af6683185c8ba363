"""`zeroshard.initialize`: validate the config, join the process group, build the Engine."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, Mapping

from torch import nn

from zeroshard.api.engine import Engine, SchedulerArg
from zeroshard.api.surface import resolve_autocast
from zeroshard.comm import discover, setup_topology, world_size_hint
from zeroshard.config import load_config
from zeroshard.optim.template import OptimizerArg

log = logging.getLogger("zeroshard")


def _configure_logging() -> None:
    """Start-up lines go to stderr on rank 0 unless the application configured logging."""
    if log.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    rank = discover(find_master=False).rank  # torchrun's RANK, or mpirun's / srun's rank
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def initialize(model: nn.Module, config: Mapping[str, Any] | str | os.PathLike, optimizer: OptimizerArg = None,
               lr_scheduler: SchedulerArg = None) -> Engine:
    """Wrap `model` for ZeRO training. `config` is a dict or the path of a DeepSpeed-style JSON
    file, validated before any process-group work. `optimizer` is used when the config has no
    `optimizer` section: a callable `params -> torch.optim.Optimizer`, or an optimizer built over
    `model`'s parameters (its class, defaults and param groups are rebuilt over the shards).
    `lr_scheduler` is a callable `optimizer -> scheduler`, or a scheduler over that optimizer;
    otherwise the config's `scheduler` section applies."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize() needs a torch.nn.Module, got {type(model).__name__}")
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    settings = load_config(dict(config) if isinstance(config, Mapping) else config,
                           world_size_hint(), hidden_size=hidden)
    _configure_logging()
    topology = setup_topology(settings.runtime.comm_timeout_s)
    return Engine(model, resolve_autocast(settings, topology.device), topology, optimizer, lr_scheduler)
