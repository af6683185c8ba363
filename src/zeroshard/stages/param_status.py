"""What each stage-3 parameter is at this moment, on the parameter itself, under the names
DeepSpeed's clients read (TRL, OpenRLHF, peft, transformers):

- `ds_id`: a number unique in the process, given in engine build order then bucket by
  bucket, so it is the same on every rank (sorting by it orders collectives alike everywhere);
- `ds_status`: `ParamStatus.AVAILABLE` (full values in `param.data`), `INFLIGHT` (its unit's
  all-gather is under way) or `NOT_AVAILABLE` (only this rank's shard exists); the unit
  state machine (`stages.stage3.Unit.move`) sets it with every move, so it is never stale;
- `ds_shape`, `ds_numel`: the full shape and size (the parameter keeps its shape anyway);
- `ds_tensor`: this rank's part of the parameter, a view into its bucket's shard (empty
  where this rank's shard holds none of it; the whole flattened value for a frozen parameter
  kept whole outside any bucket);
- `ds_active_sub_modules`: the modules (by `id`) whose forward is using the parameter now;
  one set per unit, kept by the runtime's forward hooks;
- `ds_persist`: kept whole on every rank (`stage3_param_persistence_threshold`).

`ParamStatus` has DeepSpeed's `ZeroParamStatus` names and values; the drop-in serves it
under that name.
"""

from __future__ import annotations

import enum
import itertools
from typing import Iterable

import torch
from torch import nn

from zeroshard.partition import FlatBucket


class ParamStatus(enum.Enum):
    AVAILABLE = 1  # full values on this rank
    NOT_AVAILABLE = 2  # only this rank's shard
    INFLIGHT = 3  # being gathered


_IDS = itertools.count()  # every rank builds the same engines in the same order


def set_status(params: Iterable[nn.Parameter], status: ParamStatus) -> None:
    for p in params:
        p.ds_status = status


def label_bucket(bucket: FlatBucket, status: ParamStatus, persist: bool, active: set[int] | None = None) -> None:
    """Give the parameters of `bucket` their ids, sizes and shard views."""
    shard = bucket.shard()
    lo = bucket.shard_range[0]
    in_memory = shard.numel() == bucket.layout.shard_numel and shard.stride() == (1,)
    for slot, p in zip(bucket.slots, bucket.params):
        part = bucket.layout.slot_in_shard(slot, bucket.shard_index)
        view = shard[part[0] - lo : part[1] - lo] if part and in_memory else shard.new_empty(0)
        _label(p, view, status, persist, active if active is not None else set())


def label_whole(params: Iterable[nn.Parameter]) -> None:
    """Parameters outside any bucket, kept whole on every rank."""
    for p in params:
        _label(p, p.data.view(-1), ParamStatus.AVAILABLE, True, set())


def _label(p: nn.Parameter, local: torch.Tensor, status: ParamStatus, persist: bool, active: set[int]) -> None:
    p.ds_id = next(_IDS)
    p.ds_shape, p.ds_numel = p.shape, p.numel()
    p.ds_tensor, p.ds_status, p.ds_persist = local, status, persist
    p.ds_active_sub_modules = active
