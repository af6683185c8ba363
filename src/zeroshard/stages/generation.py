"""Generation at stage 3 by a memory budget: `engine.generation(max_bytes=...)`.

Decoding N tokens calls the model N times. With stage 3's hooks on, every call gathers every
unit and releases it again: one all-gather per unit per token, which is what makes ZeRO-3
generation slow in DeepSpeed (trl#3858, DeepSpeedExamples#718). Inside `generation()` the
runtime keeps the units it gathers, up to `max_bytes` of gathered parameters, so each kept unit
is gathered once for all the tokens; a unit that does not fit in what is left of the budget is
gathered for each forward and released after it, as without the context. `max_bytes=None`
keeps every unit (gather-once: the unsharded model's speed when it fits).

Why not evict the least recently used unit (reasoned, not measured): a decoding step visits the units in the same order
every token, a loop, and LRU on a loop larger than the budget evicts exactly the unit needed
next: every unit is gathered every token, the per-forward cost, as soon as the model is a byte
over the budget. Keeping the units that fit and streaming the rest makes the gathers per token
fall in proportion to the budget: with half the model kept, half the units are gathered per
token (tests/test_generation.py checks the counts between per-forward and gather-once).

On exit every kept unit is released and training goes on as before. It runs under
`torch.no_grad()` (a backward through kept units would skip their regathering) and between
steps. Every rank keeps and streams the same units: the decisions depend only on the sequence
of forwards, the same on every rank (stop criteria that differ by rank must be synchronized, as
with DeepSpeed).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from zeroshard.stages.unit_state import Unit

__all__ = ["KeepGathered", "generation"]


def unit_bytes(unit: Unit) -> int:
    """Bytes of `unit`'s gathered (full) buffers."""
    return sum(b.layout.padded_numel * b.dtype.itemsize for b in unit.buckets)


class KeepGathered:
    """The units a generation keeps gathered, within `max_bytes` (None: every unit)."""

    def __init__(self, max_bytes: int | None) -> None:
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"generation(max_bytes={max_bytes}): a budget is 0 bytes or more (None: no limit)")
        self.max_bytes = max_bytes
        self.kept: dict[int, int] = {}  # unit index -> bytes of its gathered buffers
        self.bytes = 0
        self.streamed = 0  # forwards of a unit that did not fit: gathered, then released

    def used(self, unit: Unit) -> bool:
        """`unit` has just computed (gathered): whether it stays gathered."""
        if unit.index in self.kept:
            return True
        size = unit_bytes(unit)
        if self.max_bytes is None or self.bytes + size <= self.max_bytes:
            self.kept[unit.index] = size
            self.bytes += size
            return True
        self.streamed += 1
        return False


@contextlib.contextmanager
def generation(runtime, max_bytes: int | None) -> Iterator[KeepGathered]:
    """Keep gathered units across forwards within `max_bytes` (see the module's docstring)."""
    if runtime.keep is not None:
        raise RuntimeError("engine.generation() is already active; nest nothing inside it")
    runtime.release_all()  # a clean start: nothing gathered from an earlier pass
    keep = KeepGathered(max_bytes)
    runtime.keep = keep
    try:
        with torch.no_grad():
            yield keep
    finally:
        runtime.keep = None
        keep.kept.clear()
        keep.bytes = 0
        runtime.release_all()  # every unit, the kept ones included
