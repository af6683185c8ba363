"""A stage-3 unit's state machine: RELEASED, GATHERING (all-gather in flight) or GATHERED.

`Unit.move` is the one place a unit's state changes; it checks the move against its
buckets' storage and sets every parameter's `ds_status` to match (stages/param_status.py),
so what a client reads on a parameter is true at every moment. `active` holds the ids of
the modules whose forward is using the unit now (the parameters' `ds_active_sub_modules`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from torch import nn

from zeroshard.partition.unit_bucket import UnitBucket
from zeroshard.stages.param_status import ParamStatus, label_bucket, set_status


class UnitState(enum.Enum):
    RELEASED = "released"
    GATHERING = "gathering"
    GATHERED = "gathered"


# The only moves a unit makes. GATHERING -> RELEASED drops a prefetch nobody used (after its
# all-gather finished: a collective is never abandoned half-way).
_MOVES = {(UnitState.RELEASED, UnitState.GATHERING), (UnitState.GATHERING, UnitState.GATHERED),
          (UnitState.GATHERED, UnitState.RELEASED), (UnitState.GATHERING, UnitState.RELEASED)}
# what each parameter of a unit is in each state (its `ds_status`, stages/param_status.py)
_STATUS = {UnitState.RELEASED: ParamStatus.NOT_AVAILABLE, UnitState.GATHERING: ParamStatus.INFLIGHT,
           UnitState.GATHERED: ParamStatus.AVAILABLE}


@dataclass
class Unit:
    index: int
    name: str
    module: nn.Module
    buckets: list[UnitBucket]
    state: UnitState = UnitState.RELEASED
    users: int = 0
    active: set[int] = field(default_factory=set)  # ids of the modules whose forward uses it now

    def __post_init__(self) -> None:
        for bucket in self.buckets:  # its parameters' ds_* attributes, shared `active` set
            label_bucket(bucket, _STATUS[self.state], persist=False, active=self.active)

    @property
    def numel(self) -> int:
        return sum(b.layout.padded_numel for b in self.buckets)

    @property
    def label(self) -> str:
        return self.name or "<root>"

    def move(self, to: UnitState) -> None:
        """The one place a unit's state changes; its buckets' storage must agree with it."""
        if (self.state, to) not in _MOVES:
            raise RuntimeError(f"stage 3: unit '{self.label}' cannot go from {self.state.value} to {to.value}; "
                               "this is a zeroshard bug, please report it")
        full = [b.data is not None for b in self.buckets]
        if to is UnitState.GATHERED and not all(full) or to is UnitState.RELEASED and any(full):
            raise RuntimeError(f"stage 3: unit '{self.label}' is {to.value} but its buckets say otherwise; "
                               "this is a zeroshard bug, please report it")
        self.state = to
        for bucket in self.buckets:
            set_status(bucket.params, _STATUS[to])
