"""The only place zeroshard calls torch.distributed collectives.

Every call is recorded in the CommLedger, returns a `Handle` (so callers overlap
communication with compute and wait later), and fails with a `CommError` that
says which collective, on what, and where in training (`Comm.where`) instead of a
bare backend traceback or a silent hang.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from zeroshard.comm.ledger import CommLedger, OpTotals
from zeroshard.comm.topology import Topology
from zeroshard.policies import CommError, CommTimeoutError

_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Handle:
    """An issued collective. `wait()` blocks until it is done (or raises a CommError)."""

    def __init__(self, comm: "Comm", work, what: str, totals: OpTotals, started: float) -> None:
        self._comm, self._work, self._what = comm, work, what
        self._totals, self._started, self._done = totals, started, work is None

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._work.wait(timeout=datetime.timedelta(seconds=self._comm.timeout_s))
        except Exception as exc:  # the backend's own error types vary by version and backend
            raise self._comm.failure(self._what, exc) from None
        self._totals.seconds += time.perf_counter() - self._started

    @property
    def done(self) -> bool:
        return self._done


class Comm:
    """Plain collectives over the default group. Quantized or hierarchical variants subclass it."""

    def __init__(self, topology: Topology, ledger: CommLedger, timeout_s: float) -> None:
        self.topology = topology
        self.ledger = ledger
        self.timeout_s = timeout_s
        self.where = "start-up"  # set by the engine: "step 12, backward", ...

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def group(self):
        return self.topology.group

    @property
    def rank(self) -> int:
        return self.topology.rank

    def failure(self, what: str, exc: BaseException) -> CommError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        cls = CommTimeoutError if timed_out else CommError
        hint = (
            f"did not finish within {self.timeout_s:g}s" if timed_out else "failed"
        )
        return cls(
            f"rank {self.rank}/{self.world_size}: {what} during {self.where} {hint} ({text}). "
            "A peer rank has died, is stuck, or issued a different collective; check the other "
            "ranks' errors. Raise `zeroshard.comm_timeout_s` only if the peers are merely slow."
        )

    def _issue(self, op: str, tensor: torch.Tensor, elements: int, what: str, call) -> Handle:
        totals = self.ledger.record(op, tensor.dtype, elements)
        label = f"{op} of {elements} {str(tensor.dtype).replace('torch.', '')} elements ({what})"
        started = time.perf_counter()
        if not self.topology.distributed:
            return Handle(self, None, label, totals, started)
        try:
            work = call()
        except Exception as exc:
            raise self.failure(label, exc) from None
        return Handle(self, work, label, totals, started)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str = "") -> Handle:
        return self._issue("all_reduce", tensor, tensor.numel(), what,
                           lambda: dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """Sum `input` (world_size x output.numel()) across ranks; rank r keeps chunk r in `output`.

        `output` may be rank r's chunk of `input` itself (in place)."""
        self._check_sizes("reduce_scatter", input, output)
        if not self.topology.distributed and output.data_ptr() != input.data_ptr():
            output.copy_(input.view(-1)[: output.numel()].view_as(output))
        return self._issue("reduce_scatter", input, input.numel(), what,
                           lambda: _RS(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """Concatenate every rank's `input` into `output`; `input` may be rank r's chunk of it."""
        self._check_sizes("all_gather", output, input)
        if not self.topology.distributed and output.data_ptr() != input.data_ptr():
            output.view(-1)[: input.numel()].copy_(input.view(-1))
        return self._issue("all_gather", output, output.numel(), what,
                           lambda: _AG(output, input, group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: str = "") -> Handle:
        return self._issue("broadcast", tensor, tensor.numel(), what,
                           lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        if not self.topology.distributed:
            output.copy_(input)
        return self._issue("all_to_all", input, input.numel(), what,
                           lambda: dist.all_to_all_single(output, input, group=self.group, async_op=True))

    def _check_sizes(self, op: str, full: torch.Tensor, shard: torch.Tensor) -> None:
        if full.numel() != shard.numel() * self.world_size:
            raise CommError(
                f"{op}: full tensor has {full.numel()} elements, expected world_size "
                f"({self.world_size}) x shard ({shard.numel()}); this is a zeroshard bug, please report it."
            )
