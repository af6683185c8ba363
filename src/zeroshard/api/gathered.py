"""`zeroshard.GatheredParameters`: full parameters for a moment, on every rank.

    with zeroshard.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if engine.rank == 0:
            model.lm_head.weight.zero_()     # changes made on rank 0 ...
    # ... are now in every rank's shards and in the fp32 master weights

A collective: every rank enters with the same parameters. Works for stage-3 units,
for parameters built under `zeroshard.Init` before `initialize()`, and (as a no-op
gather) for whole parameters, whose edits are still broadcast and written to masters.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from zeroshard.comm import Comm, CommLedger, setup_topology
from zeroshard.partition.param_shards import materialize, shard_of, shard_parameter
from zeroshard.policies import RuntimePolicy

_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def register_engine(engine) -> None:
    _ENGINES.add(engine)


def _owner(params: list[nn.Parameter]):
    ids = {id(p) for p in params}
    for engine in list(_ENGINES):
        if any(id(p) in ids for p in engine.module.parameters()):
            return engine
    return None


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._engine = None
        self._held = None  # the parameter strategy's `gathered` context while inside
        self._init_params: list[nn.Parameter] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled or not self.params:
            return self
        self._engine = _owner(self.params)
        if self._engine is None:
            self._enter_init()
            return self
        self._held = self._engine.params.gathered(self.params)
        self._held.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled or not self.params:
            return
        if self._engine is None:
            self._exit_init()
            return
        try:
            if self.modifier_rank is not None and exc[0] is None:
                self._scatter_back(self._engine)
        finally:
            self._held.__exit__(None, None, None)

    def _scatter_back(self, engine) -> None:
        """Rank `modifier_rank`'s values go to every rank, into shards and fp32 masters."""
        ids = {id(p) for p in self.params}
        comm, src = engine.comm, self.modifier_rank
        touched = set()
        for b, bucket in enumerate(engine.buckets + engine.frozen_buckets):
            if not any(id(p) in ids for p in bucket.params):
                continue
            touched.update(id(p) for p in bucket.params)
            comm.broadcast(bucket.data, src, what=f"GatheredParameters from rank {src}").wait()
            lo, hi = bucket.shard_range
            bucket.write_shard(bucket.data[lo:hi])  # a stage-3 shard kept apart: in memory, or in its nvme file
            if b < len(engine.buckets):
                with engine.optimizer.resident(b):  # nvme tier: read, edited, written back
                    engine.optimizer.masters[b].copy_(bucket.data[lo:hi])
        for p in self.params:
            if id(p) not in touched:
                comm.broadcast(p.data, src, what=f"GatheredParameters from rank {src}").wait()

    # -- before initialize(): parameters sharded one by one by zeroshard.Init ------------------
    def _comm(self) -> Comm:
        """Collectives for parameters `zeroshard.Init` sharded, with the `comm_timeout_s` of the
        config it was given (the default's where a shard does not say)."""
        timeout_s = max((t for p in self._init_params if (t := shard_of(p).timeout_s) is not None),
                        default=RuntimePolicy().comm_timeout_s)
        topology = setup_topology(timeout_s)
        return Comm(topology, CommLedger(topology.world_size), timeout_s)

    def _enter_init(self) -> None:
        self._init_params = [p for p in self.params if shard_of(p) is not None]
        if self._init_params:
            self._comm_obj = self._comm()
            for p in self._init_params:
                materialize(p, self._comm_obj)

    def _exit_init(self) -> None:
        comm = getattr(self, "_comm_obj", None)
        for p in self._init_params:
            if self.modifier_rank is not None and comm.world_size > 1:
                comm.broadcast(p.data, self.modifier_rank, what="GatheredParameters (Init)").wait()
            shard_parameter(p, comm.rank, comm.world_size, comm.timeout_s)
        if comm is not None:
            comm.topology.release_group()  # the group setup_topology made on a user's default group
