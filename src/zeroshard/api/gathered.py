"""`zeroshard.GatheredParameters`: full parameters for a moment, on every rank.

    with zeroshard.GatheredParameters(model.lm_head.weight, modifier_rank=0):
        if engine.rank == 0:
            model.lm_head.weight.zero_()     # changes made on rank 0 ...
    # ... are now in every rank's shards and in the fp32 master weights

A collective: every rank enters with the same parameters. The parameters may belong to
several engines (a policy and its reference model, as TRL's ref-model sync passes them):
each engine's own are gathered by that engine, engines taken in the order they were built
(the same on every rank, so no rank waits on a collective another never issues), and
`modifier_rank`'s values are written back into each one's shards and fp32 masters. Also
serves parameters built under `zeroshard.Init` before `initialize()`. Whole parameters no
engine owns and `Init` did not shard are left as they are (DeepSpeed's GatheredParameters
ignores parameters without `ds_id` too).

Masters take only the elements modifier_rank changed: an element whose new 16-bit value is
still its master's rounding keeps its fp32 master, so passing a training model's parameters
along (TRL passes the policy's with the reference model's) costs the policy no precision.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref

import torch
from torch import nn

from zeroshard.comm import Comm, CommLedger, setup_topology
from zeroshard.partition.param_shards import materialize, shard_of, shard_parameter
from zeroshard.policies import RuntimePolicy

_ENGINES: dict[int, "weakref.ref"] = {}  # build number -> engine; initialize() is collective, so
_BUILT = itertools.count()  # every rank numbers its engines alike


def register_engine(engine) -> None:
    _ENGINES[next(_BUILT)] = weakref.ref(engine)


def unregister_engine(engine) -> None:
    """A closed engine's collectives are gone: its parameters are no longer gathered by it."""
    for key, ref in list(_ENGINES.items()):
        if ref() is None or ref() is engine:
            del _ENGINES[key]


def engines_in_order() -> list:
    """The live engines in the order they were built (the same on every rank)."""
    return [e for _, ref in sorted(_ENGINES.items()) if (e := ref()) is not None]


def split_by_engine(params: list[nn.Parameter]) -> tuple[list[tuple[object, list[nn.Parameter]]], list[nn.Parameter]]:
    """`[(engine, its parameters among params)]` in build order, each engine's in its module's
    order, and the parameters no engine owns (in the order given). A parameter two engines
    hold goes to the first built."""
    left = {id(p): p for p in params}  # duplicates dropped: a bucket is broadcast once
    owned = []
    for engine in engines_in_order():
        if not left:
            break
        own = [p for p in dict.fromkeys(engine.module.parameters()) if id(p) in left]
        for p in own:
            del left[id(p)]
        if own:
            owned.append((engine, own))
    return owned, list(left.values())


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        self.params = [params] if isinstance(params, torch.Tensor) else [p for p in params if p is not None]
        self.modifier_rank, self.enabled = modifier_rank, enabled
        self._owned: list[tuple[object, list[nn.Parameter]]] = []
        self._held = contextlib.ExitStack()  # each engine's `gathered` context while inside
        self._init_params: list[nn.Parameter] = []

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled or not self.params:
            return self
        self._owned, rest = split_by_engine(self.params)
        with contextlib.ExitStack() as stack:  # a failure half-way releases what was gathered
            for engine, params in self._owned:
                stack.enter_context(engine.params.gathered(params))
            self._enter_init(rest)
            self._held = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled or not self.params:
            return
        with self._held:
            if self.modifier_rank is not None and exc[0] is None:
                for engine, params in self._owned:
                    write_back(engine, params, self.modifier_rank)
            self._exit_init()

    # -- before initialize(): parameters sharded one by one by zeroshard.Init ------------------
    def _comm(self) -> Comm:
        """Collectives for parameters `zeroshard.Init` sharded, with the `comm_timeout_s` of the
        config it was given (the default's where a shard does not say)."""
        timeout_s = max((t for p in self._init_params if (t := shard_of(p).timeout_s) is not None),
                        default=RuntimePolicy().comm_timeout_s)
        topology = setup_topology(timeout_s)
        return Comm(topology, CommLedger(topology.world_size), timeout_s)

    def _enter_init(self, rest: list[nn.Parameter]) -> None:
        self._init_params = [p for p in rest if shard_of(p) is not None]
        if self._init_params:
            self._comm_obj = self._comm()
            for p in self._init_params:
                materialize(p, self._comm_obj)

    def _exit_init(self) -> None:
        if not self._init_params:
            return
        comm = self._comm_obj
        for p in self._init_params:
            if self.modifier_rank is not None and comm.world_size > 1:
                comm.broadcast(p.data, self.modifier_rank, what="GatheredParameters (Init)").wait()
            shard_parameter(p, comm.rank, comm.world_size, comm.timeout_s)
        comm.topology.release_group()  # the group setup_topology made on a user's default group


def write_back(engine, params: list[nn.Parameter], src: int) -> None:
    """Rank `src`'s values of `params` (gathered by `engine`) go to every rank: whole buckets are
    broadcast, each rank keeps its shard (in memory, on its tier or in its nvme file), and fp32
    masters take the elements that changed (on whatever tier holds them)."""
    ids = {id(p) for p in params}
    comm, what = engine.comm, f"GatheredParameters from rank {src}"
    touched: set[int] = set()
    trainable = len(engine.buckets)
    for b, bucket in enumerate(engine.buckets + engine.frozen_buckets):
        if not any(id(p) in ids for p in bucket.params):
            continue
        touched.update(id(p) for p in bucket.params)
        comm.broadcast(bucket.data, src, what=what).wait()
        lo, hi = bucket.shard_range
        new = bucket.data[lo:hi]
        if b < trainable:
            with engine.optimizer.resident(b):  # nvme tier: read, edited, written back
                master = engine.optimizer.masters[b]
                if master.data_ptr() != bucket.shard().data_ptr():
                    take_changes(master, new)
        bucket.write_shard(new)  # a stage-3 shard kept apart: in memory, on the host, or in its file
    for p in params:  # an engine's parameters outside its buckets (kept whole, not trained)
        if id(p) not in touched:
            comm.broadcast(p.data, src, what=what).wait()


def take_changes(master: torch.Tensor, new: torch.Tensor) -> None:
    """`master` (fp32) takes `new` (the shard's compute-dtype values) where they differ from
    the master's own rounding to that dtype; elsewhere the master keeps its precision."""
    new = new.to(master.device)
    if new.dtype == master.dtype:
        master.copy_(new)
        return
    changed = new != master.to(new.dtype)
    master.copy_(torch.where(changed, new.to(master.dtype), master))
