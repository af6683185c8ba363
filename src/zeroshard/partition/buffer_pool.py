"""Reuse of large transient CPU buffers: stage 3's gathered units and gradient buckets, and the
receive buffer of gloo's reduce-scatter.

glibc hands a block above its mmap threshold (32 MiB at most) back to the kernel when it is
freed, and the next allocation of that size faults in every page again; smaller blocks come
from its heap, whose free top is given back too (above M_TRIM_THRESHOLD, which follows the mmap
threshold) and whose holes `malloc_trim` returns (partition/malloc_trim.py). Measured on this
project's 2-core machine: filling a fresh 33.6 MB buffer takes 65-95 ms, a reused one 11-14 ms.
Stage 3 allocates such blocks every step for every gather, gradient bucket and reduce-scatter of
its units (50M: 24 MB units, of which one rank faulted 27,800 pages per step in again while they
were left to glibc), so every block of 1 MiB or more is pooled.

Buffers are kept by exact (elements, dtype), on the CPU only (CUDA's caching allocator already
reuses device memory): of each, as many as were out at once since the last `end_period()` (the
engine calls it once per optimizer step), and at least `keep`. A step that holds every unit
gathered from its forward to its backward (stage 3's default when the model fits
`stage3_max_live_parameters`) gets all of them back the next step: with a fixed two, the
other units' buffers were unmapped and faulted in again every step (150M on 2 ranks: 108,500
page faults and 0.78 s of system CPU per step against 590 and 0.19 s; bench/RESULTS.md). The
pool never holds more than the step's own peak, which the step needed anyway; a one-off larger
peak (a whole model gathered for generation) is let go at the end of the next step.

A buffer is handed out again only if nothing else still uses its storage (a view autograd
saved, a tensor a user kept, a collective's work object): its storage's use count says so; one
still in use is dropped from the pool and left to be freed by its last user. Idle pooled bytes
are held in the ledger as `comm_buffers` ("pool").
"""

from __future__ import annotations

import torch

from zeroshard.partition.memory import MemoryLedger

MIN_BYTES = 1 << 20


def _sole_owner(t: torch.Tensor) -> bool:
    """Nothing but `t` (and the storage object this call makes) refers to its storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) <= 2


def empty_from(pool: "BufferPool | None", numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """`pool.empty(...)`, or a plain new buffer where there is no pool."""
    return pool.empty(numel, dtype, device) if pool is not None else torch.empty(numel, dtype=dtype, device=device)


class BufferPool:
    def __init__(self, memory: MemoryLedger, min_bytes: int | None = None, keep: int = 2) -> None:
        self.memory, self.keep = memory, keep
        self.min_bytes = MIN_BYTES if min_bytes is None else min_bytes
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.reused = 0  # buffers handed out again (for tests and benchmarks)
        self.fresh = 0  # new buffers of a pooled size (each one faulted in)
        self._idle = 0
        self._out: dict[tuple[int, torch.dtype], int] = {}  # handed out, not given back yet
        self._peak: dict[tuple[int, torch.dtype], int] = {}  # most out at once in this period

    def _pooled(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and numel * dtype.itemsize >= self.min_bytes

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D buffer: a pooled one of this size if one is free, else a new one."""
        if self._pooled(numel, dtype, torch.device(device)):
            key = (numel, dtype)
            self._out[key] = out = self._out.get(key, 0) + 1
            self._peak[key] = max(self._peak.get(key, 0), out)
            free = self._free.get(key, [])
            while free:
                t = free.pop()
                self._count(-t.nbytes)
                if _sole_owner(t):
                    self.reused += 1
                    return t
            self.fresh += 1
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor | None) -> None:
        """`t` (from `empty`) is no longer needed by its caller."""
        if t is None or not self._pooled(t.numel(), t.dtype, t.device) or t.storage_offset() != 0 \
                or t.dim() != 1 or t.untyped_storage().nbytes() != t.nbytes:
            return
        key = (t.numel(), t.dtype)
        self._out[key] = max(0, self._out.get(key, 0) - 1)
        free = self._free.setdefault(key, [])
        if len(free) < self._limit(key):
            free.append(t)
            self._count(t.nbytes)

    def _limit(self, key: tuple[int, torch.dtype]) -> int:
        return max(self.keep, self._peak.get(key, 0))

    def end_period(self) -> None:
        """A step is over: drop idle buffers beyond what this step had out at once (a larger
        peak of an earlier period, e.g. a whole model gathered for generation), and count the
        next period's peak from what is out now."""
        for key, free in self._free.items():
            while len(free) > self._limit(key):
                self._count(-free.pop().nbytes)
        self._peak = dict(self._out)

    def clear(self) -> None:
        self._free.clear()
        self._count(-self._idle)
        self._out.clear()
        self._peak.clear()

    def _count(self, delta: int) -> None:
        self._idle += delta
        self.memory.hold("comm_buffers", "pool", self._idle)
