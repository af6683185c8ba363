"""The only place zeroshard calls torch.distributed collectives.

Every call is recorded in the CommLedger, returns a `Handle` (so callers overlap
communication with compute and wait later), and fails with a `CommError` that
says which collective, on what, and where in training (`Comm.where`) instead of a
bare backend traceback or a silent hang.
"""

from __future__ import annotations

import datetime
import time
from typing import Callable

import torch
import torch.distributed as dist

from zeroshard.comm.direct import DirectCollectives
from zeroshard.comm.ledger import CommLedger
from zeroshard.comm.topology import Group, Topology
from zeroshard.policies import CommError, CommTimeoutError

_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class Handle:
    """An issued collective. `wait()` blocks until it is done (or raises a CommError), then
    runs `finish` (a quantized or hierarchical collective dequantizes, reduces or issues its
    next hop there) before the result is handed back."""

    def __init__(self, comm: "Comm", work, what: str, totals, started: float,
                 finish: Callable[[], None] | None = None) -> None:
        works = work if isinstance(work, (list, tuple)) else ([] if work is None else [work])
        self._comm, self._works, self._what, self._finish = comm, works, what, finish
        self._totals, self._started, self._done = totals, started, False

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        entered = time.perf_counter()
        try:
            if self._comm.stream_ordered:
                # NCCL: a plain wait() orders the current CUDA stream after the collective and
                # returns; a wait with a timeout blocks the host until the GPU finishes. The
                # group's own timeout (comm_timeout_s, given to init_process_group / new_group)
                # still ends a stuck collective, through NCCL's watchdog.
                for work in self._works:
                    work.wait()
            else:
                for work in self._works:
                    work.wait(timeout=datetime.timedelta(seconds=self._comm.timeout_s))
        except Exception as exc:  # the backend's own error types vary by version and backend
            raise self._comm.failure(self._what, exc) from None
        if self._works:
            elapsed = time.perf_counter() - self._started
            for totals in self._totals:  # the ledger's overall and per-scope entries
                totals.seconds += elapsed
        if self._finish is not None:
            self._finish()
        if self._works:
            blocked = time.perf_counter() - entered
            for totals in self._totals:
                totals.waited += blocked

    def then(self, step: Callable[[], None]) -> "Handle":
        """Run `step` on wait, after the work already attached (e.g. a second hop that needs
        the first's result); returns this handle."""
        if self._done:
            raise RuntimeError(f"{self._what}: then() on a handle already waited on; "
                               "this is a zeroshard bug, please report it.")
        first = self._finish

        def both() -> None:
            if first is not None:
                first()
            step()

        self._finish = both
        return self

    @property
    def done(self) -> bool:
        return self._done

    @property
    def what(self) -> str:
        """The collective, its size and what it was for, as errors name it."""
        return self._what


class Comm(DirectCollectives):
    """Plain collectives on one group (the world unless `on(group)` made it): an `AllGather`,
    `ReduceScatter` and `AllToAll` (comm.interfaces). Quantized and hierarchical collectives
    (comm.zeropp) implement the same interfaces and issue through `issue` and `launch_*`."""

    def __init__(self, topology: Topology, ledger: CommLedger, timeout_s: float,
                 group: Group | None = None, root: "Comm | None" = None, pool=None) -> None:
        self.topology = topology
        self.ledger = ledger
        self.timeout_s = timeout_s
        self.on_group = group if group is not None else topology.world
        self._root = root
        self.pool = pool  # a BufferPool for transient buffers, the root comm's (`on` passes it on); None: fresh ones
        self._sequence: dict[tuple, int] = {}  # direct collectives issued per group (root comm only)
        self._channels: dict = {}  # comm/cma.py's intra-host channel per group, or None (root comm only)
        self._where = "start-up"  # set by the engine: "step 12, backward", ...

    @property
    def where(self) -> str:
        return self._root.where if self._root is not None else self._where

    @where.setter
    def where(self, value: str) -> None:
        if self._root is not None:
            self._root.where = value
        else:
            self._where = value

    def scratch(self, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        """A transient 1-D buffer from the root comm's BufferPool (partition.buffer_pool; a
        fresh one without a pool); hand it back with `give_back` once its values are used."""
        if self.pool is not None:
            return self.pool.empty(numel, dtype, device)
        return torch.empty(numel, dtype=dtype, device=device)

    def give_back(self, *buffers: torch.Tensor) -> None:
        if self.pool is not None:
            for t in buffers:
                self.pool.give(t)

    def on(self, group: Group) -> "Comm":
        """The same collectives, ledger and timeout on `group`."""
        return Comm(self.topology, self.ledger, self.timeout_s, group, root=self._root or self, pool=self.pool)

    @property
    def world_size(self) -> int:
        """Ranks in this comm's group (the world size for the engine's comm)."""
        return self.on_group.size

    @property
    def group(self):
        return self.on_group.handle

    @property
    def rank(self) -> int:
        """This rank's index in the group (its global rank for the engine's comm)."""
        return self.on_group.rank

    @property
    def scope(self) -> str:
        return self.on_group.scope

    @property
    def stream_ordered(self) -> bool:
        """Whether a wait only orders the device's stream after the collective (NCCL on a
        CUDA machine) instead of blocking the host until it is done (gloo)."""
        return self.topology.backend == "nccl" and torch.cuda.is_available()

    def failure(self, what: str, exc: BaseException) -> CommError:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        timed_out = "timeout" in text.lower() or "timed out" in text.lower()
        cls = CommTimeoutError if timed_out else CommError
        hint = f"did not finish within {self.timeout_s:g}s" if timed_out else "failed"
        on = "" if self.on_group.name == "world" else f" on the {self.on_group.name} group {list(self.on_group.ranks)}"
        return cls(f"rank {self.topology.rank}/{self.topology.world_size}: {what}{on} during {self.where} {hint} "
                   f"({text}). A peer rank has died, is stuck, or issued a different collective; check the other "
                   "ranks' errors. Raise `zeroshard.comm_timeout_s` only if the peers are merely slow.")

    def issue(self, op: str, tensor: torch.Tensor, elements: int, what: str, call,
              wire_bytes: int | None = None, finish: Callable[[], None] | None = None,
              dtype_name: str | None = None) -> Handle:
        """Record and launch one collective of `elements` logical elements of `tensor`'s dtype
        (`wire_bytes`: what really travels, if not that). `call` returns the backend's work, a
        list of them (a quantized collective moves payload and scales; see `launch_*`) or None;
        it is not called where nothing leaves the rank (one rank, no process group). `finish`
        runs after the wait."""
        totals = self.ledger.record(op, tensor.dtype, elements, self.world_size, self.scope, wire_bytes)
        dtype = dtype_name or str(tensor.dtype).replace('torch.', '')
        label = f"{op} of {elements} {dtype} elements ({what})"
        started = time.perf_counter()
        if not self.topology.distributed or self.world_size == 1:
            return Handle(self, None, label, totals, started, finish)
        try:
            work = call()
        except Exception as exc:
            raise self.failure(label, exc) from None
        return Handle(self, work, label, totals, started, finish)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", what: str = "") -> Handle:
        return self.issue("all_reduce", tensor, tensor.numel(), what,
                           lambda: dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True))

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, what: str = "",
                       average: bool = False) -> Handle:
        """Sum `input` (world_size x output.numel()) across ranks; rank r keeps chunk r in `output`.
        With `average` the result is the mean over ranks (what gradient reduction wants).

        `output` may be rank r's chunk of `input` itself (in place); with `average` `input`
        may be overwritten (its chunks pre-divided) on backends that cannot average."""
        self.check_sizes("reduce_scatter", input, output)
        if self.world_size == 1 and output.data_ptr() != input.data_ptr():
            output.copy_(input.view(-1)[: output.numel()].view_as(output))
        if self._direct(input):
            return self._reduce_scatter_direct(output, input, what, average)
        if average and self.world_size > 1:
            input.mul_(1.0 / self.world_size)
        return self.issue("reduce_scatter", input, input.numel(), what,
                           lambda: _RS(output, input, op=dist.ReduceOp.SUM, group=self.group, async_op=True))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        """Concatenate every rank's `input` into `output`; `input` may be rank r's chunk of it."""
        self.check_sizes("all_gather", output, input)
        if self.world_size == 1 and output.data_ptr() != input.data_ptr():
            output.view(-1)[: input.numel()].copy_(input.view(-1))
        if self._direct(output):
            size, out = input.numel(), output.view(-1)
            return self._all_gather_direct([out[p * size : (p + 1) * size] for p in range(self.world_size)],
                                           input, what)
        return self.issue("all_gather", output, output.numel(), what,
                           lambda: _AG(output, input, group=self.group, async_op=True))

    def all_gather_into(self, outputs: list[torch.Tensor], input: torch.Tensor, what: str = "") -> Handle:
        """Rank r's `input` lands in `outputs[r]` on every rank. The outputs are views anywhere,
        e.g. the same slice of every rank's shard of a rank-major bucket, so a bucket larger
        than `allgather_bucket_size` is gathered in pieces straight into place, with no staging
        buffer and no copy out. `input` may be `outputs[rank]` itself."""
        n, size = self.world_size, input.numel()
        if len(outputs) != n or any(o.numel() != size or o.dtype != input.dtype for o in outputs):
            raise CommError(f"all_gather_into: expected {n} outputs of {size} {input.dtype} elements, got "
                            f"{[(o.numel(), o.dtype) for o in outputs]}; this is a zeroshard bug, please report it.")
        if self._direct(input):
            return self._all_gather_direct(outputs, input, what)
        mine = outputs[self.rank]
        if mine.data_ptr() != input.data_ptr():
            mine.view(-1).copy_(input.view(-1))
        return self.issue("all_gather", input, n * size, what,
                           lambda: dist.all_gather(list(outputs), input, group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int = 0, what: str = "") -> Handle:
        return self.issue("broadcast", tensor, tensor.numel(), what,
                           lambda: dist.broadcast(tensor, src=src, group=self.group, async_op=True))

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, what: str = "") -> Handle:
        if self.world_size == 1:
            output.copy_(input)
        return self.issue("all_to_all", input, input.numel(), what,
                           lambda: dist.all_to_all_single(output, input, group=self.group, async_op=True))

    # -- the backend calls a collective object launches inside `issue`'s `call` ---------------
    def launch_all_gather(self, output: torch.Tensor, input: torch.Tensor):
        """torch's all-gather of `input` into `output` on this group, async, unrecorded."""
        return _AG(output, input, group=self.group, async_op=True)

    def launch_all_to_all(self, output: torch.Tensor, input: torch.Tensor):
        """torch's all-to-all (equal chunks along dim 0) on this group, async, unrecorded."""
        return dist.all_to_all_single(output, input, group=self.group, async_op=True)

    def check_sizes(self, op: str, full: torch.Tensor, shard: torch.Tensor) -> None:
        """`full` must be world_size x `shard` elements (a CommError naming `op` if not)."""
        if full.numel() != shard.numel() * self.world_size:
            raise CommError(f"{op}: full tensor has {full.numel()} elements, expected world_size ({self.world_size}) "
                            f"x shard ({shard.numel()}); this is a zeroshard bug, please report it.")
