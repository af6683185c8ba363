"""`zeroshard.Init`: build a model already partitioned, so no rank ever holds all of it.

    with zeroshard.Init(config):
        model = MyModel()          # each submodule is sharded the moment it is attached
    engine = zeroshard.initialize(model, config)

Uses torch's global module-registration hook (no monkey-patching): when a finished
submodule is attached to its parent, its own parameters are broadcast from rank 0 (so
every rank starts from the same values whatever its RNG) and each rank keeps only its
1/N slice. Peak memory while building is about the largest single module plus the
shards. Parameters of the outermost module itself are sharded by `initialize()`.

Models often initialise weights again after construction (`self.apply(_init_weights)`,
Hugging Face's `post_init`). Inside the context, a torch function handed a sharded
parameter (`nn.init.normal_(w)`, `w.zero_()`, `w.copy_(...)`) runs on its full value,
gathered for that one call, and the result (rank 0's, for a write) is sharded again.
Writes through `w.data` bypass torch functions and are not supported.
Only meaningful for stage 3; with another stage it does nothing.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

from torch import nn
from torch.overrides import TorchFunctionMode

from zeroshard.comm import Comm, CommLedger, setup_topology, world_size_hint
from zeroshard.config import load_config
from zeroshard.partition.param_shards import materialize, shard_of, shard_parameter
from zeroshard.policies import Stage
from zeroshard.stages.hooks import on_module_attached


class Init:
    def __init__(self, config: Mapping[str, Any] | str | os.PathLike, enabled: bool = True) -> None:
        self.settings = load_config(dict(config) if isinstance(config, Mapping) else config, world_size_hint())
        self.enabled = enabled and self.settings.zero.stage == Stage.PARAMETERS
        self._handle = None
        self.peak_bytes = 0  # largest full parameter held while sharding (for tests and reports)
        self.shard_bytes = 0

    def __enter__(self) -> "Init":
        if self.enabled:
            topology = setup_topology(self.settings.runtime.comm_timeout_s)
            self.comm = Comm(topology, CommLedger(topology.world_size), self.settings.runtime.comm_timeout_s)
            self.comm.where = "zeroshard.Init"
            self._handle = on_module_attached(self._on_attach)
            self._writes = _ShardedCalls(self.comm)
            self._writes.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._handle is not None:
            self._writes.__exit__(*exc)
            self._handle.remove()
            self._handle = None
            self.comm.topology.release_group()

    def _on_attach(self, parent: nn.Module, name: str, child: nn.Module | None):
        if child is None:
            return None
        for pname, param in child.named_parameters(recurse=False):
            if shard_of(param) is not None or param.is_meta:
                continue
            full = param.detach()
            if self.comm.world_size > 1:
                self.comm.broadcast(full, 0, what=f"initial value of {type(child).__name__}.{pname}").wait()
            self.peak_bytes = max(self.peak_bytes, full.nbytes)
            entry = shard_parameter(param, self.comm.rank, self.comm.world_size, self.comm.timeout_s)
            self.shard_bytes += entry.shard.nbytes
        return None


class _ShardedCalls(TorchFunctionMode):
    """A torch function given sharded parameters runs on their full values; writes keep rank 0's."""

    def __init__(self, comm: Comm) -> None:
        super().__init__()
        self.comm = comm

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__"):
            return func(*args, **kwargs)
        sharded = [t for arg in (*args, *kwargs.values())
                   for t in (arg if isinstance(arg, (list, tuple)) else (arg,))
                   if isinstance(t, nn.Parameter) and shard_of(t) is not None]
        if not sharded:
            return func(*args, **kwargs)
        for p in sharded:
            materialize(p, self.comm)
        try:
            return func(*args, **kwargs)
        finally:
            for p in sharded:
                if self.comm.world_size > 1:
                    self.comm.broadcast(p.data, 0, what="a write to a parameter under zeroshard.Init").wait()
                shard_parameter(p, self.comm.rank, self.comm.world_size, self.comm.timeout_s)
