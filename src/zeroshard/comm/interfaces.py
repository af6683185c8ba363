"""The collective interfaces the stages program against (in the spirit of FSDP2's
`AllGather` / `ReduceScatter`): a collective is an object bound to a group; issuing it
returns a `Handle` whose `wait()` finishes the work (dequantize, reduce, a second hop)
before the result is handed back.

Who implements what:

* `Comm` (plain, on any group: the world, or a rank's hpZ group for hpZ's backward gather)
  implements all three.
* `QuantizedAllGather` (qwZ) is an `AllGather`; `QuantizedAllToAll` (one qgZ hop) an
  `AllToAll`; `QuantizedHierarchicalReduceScatter` (qgZ, two quantized all-to-alls) a
  `ReduceScatter`.

A new collective (another quantization, another hierarchy) implements one of these and
issues its backend calls through `Comm.issue` with `Comm.launch_*`, so the ledger records
what it really puts on the wire and a failure says which collective, where.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from zeroshard.comm.collectives import Handle


@runtime_checkable
class Collective(Protocol):
    """A collective bound to one group: this rank's index in it and the group's size."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


@runtime_checkable
class AllGather(Collective, Protocol):
    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """Every rank's `input` concatenated into `output` (world_size x input.numel()
        elements) once the handle is waited on; `input` may be this rank's chunk of `output`."""
        ...


@runtime_checkable
class ReduceScatter(Collective, Protocol):
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """The sum over ranks of `input` (world_size x output.numel() elements); this rank's
        chunk lands in `output` once the handle is waited on. `output` may be a view into
        `input`, which may be overwritten."""
        ...


@runtime_checkable
class AllToAll(Collective, Protocol):
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """Chunk j of `input` (world_size equal chunks) goes to rank j; chunk i of `output`
        holds what rank i sent this rank, once the handle is waited on."""
        ...


__all__ = ["AllGather", "AllToAll", "Collective", "ReduceScatter"]
