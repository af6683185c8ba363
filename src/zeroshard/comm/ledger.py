"""CommLedger: every collective this rank issues, counted exactly.

`elements` is the numel of the full, unsharded logical tensor (what the ZeRO paper
counts); `sent_bytes` is what this rank puts on the wire for a ring algorithm:
all-reduce 2(N-1)/N, reduce-scatter, all-gather and all-to-all (N-1)/N of the full
tensor, broadcast the whole tensor (a pipelined chain forwards it once per rank).
`seconds` is each call's time from issue to the end of its wait; `waited` the time this
rank's host was blocked in `wait()` (its finishing work included): the communication that
did not overlap with anything. Where a wait only orders a CUDA stream (NCCL), the host does
not block and `waited` stays near 0 whatever the GPU does.

`bytes` is the full tensor as it travels: for a quantized collective the int8 / int4
payload plus its fp32 scales (`wire_bytes`), not dtype x elements. Each call is also
counted under its scope: "intra_node" when every rank of its group lives on one node,
else "inter_node" (`stats(by_scope=True)`). A hierarchical collective records each hop
as its own call, on its own group.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from zeroshard.comm.topology import INTER_NODE, SCOPES

COLLECTIVES = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all")

# Paper units: a ring all-reduce is a reduce-scatter plus an all-gather.
PAPER_FACTOR = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "all_to_all": 1}


def ring_sent_bytes(op: str, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for `op` over a tensor of `nbytes` with a ring algorithm."""
    if world_size <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (world_size - 1) * nbytes // world_size
    if op == "broadcast":
        return nbytes
    return (world_size - 1) * nbytes // world_size


@dataclass
class OpTotals:
    calls: int = 0
    elements: int = 0
    bytes: int = 0
    sent_bytes: int = 0
    seconds: float = 0.0
    waited: float = 0.0


class CommLedger:
    """Cumulative totals per collective since the last `reset()`, and since the ledger was
    made (`lifetime()`: what monitors difference step by step, whoever resets)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._lifetime = {op: OpTotals() for op in COLLECTIVES}
        self.reset()

    def record(self, op: str, dtype: torch.dtype, elements: int, world_size: int | None = None,
               scope: str = INTER_NODE, wire_bytes: int | None = None) -> tuple[OpTotals, OpTotals]:
        """Count one call of `elements` logical elements on a group of `world_size` ranks
        (`wire_bytes`: what the whole tensor weighs on the wire, if not dtype x elements).
        Returns its overall, per-scope and lifetime entries, so the caller can add its time to each later."""
        n = self.world_size if world_size is None else world_size
        nbytes = elements * torch.empty((), dtype=dtype).element_size() if wire_bytes is None else wire_bytes
        entries = (self._totals[op], self._scoped[scope][op], self._lifetime[op])
        for t in entries:
            t.calls += 1
            t.elements += elements
            t.bytes += nbytes
            t.sent_bytes += ring_sent_bytes(op, nbytes, n)
        return entries

    def reset(self) -> None:
        self._totals = {op: OpTotals() for op in COLLECTIVES}
        self._scoped = {scope: {op: OpTotals() for op in COLLECTIVES} for scope in SCOPES}

    def stats(self, by_scope: bool = False) -> dict:
        """{op: {calls, elements, bytes, sent_bytes, seconds, waited}}; with `by_scope`,
        {"intra_node": {op: ...}, "inter_node": {op: ...}} with the same fields."""
        if by_scope:
            return {scope: {op: asdict(t) for op, t in ops.items()} for scope, ops in self._scoped.items()}
        return {op: asdict(t) for op, t in self._totals.items()}

    def lifetime(self) -> dict:
        """{op: {calls, elements, bytes, sent_bytes, seconds, waited}} since the ledger was made (never reset)."""
        return {op: asdict(t) for op, t in self._lifetime.items()}

    def paper_elements(self) -> int:
        """Volume in the ZeRO paper's units (all-reduce counts twice its elements)."""
        return sum(PAPER_FACTOR[op] * t.elements for op, t in self._totals.items())
