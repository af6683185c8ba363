"""Reuse of large transient CPU buffers: stage 3's gathered units and gradient buckets, and the
receive buffer of gloo's reduce-scatter.

glibc hands a block above its mmap threshold (32 MiB at most) back to the kernel when it is
freed, and the next allocation of that size faults in every page again. Measured on this
project's 2-core machine: filling a fresh 33.6 MB buffer takes 65-95 ms, a reused one 11-14 ms.
Stage 3 allocates blocks that large every step wherever one parameter is (an embedding, an LM
head: 16384 x 512 fp32 is 33.5 MB) and for every gather, gradient bucket and reduce-scatter
of its unit. Smaller blocks come back from glibc's heap without faults and are not pooled.

Buffers are kept by exact (elements, dtype), at most `keep` of each, on the CPU only (CUDA's
caching allocator already reuses device memory). A buffer is handed out again only if nothing
else still uses its storage (a view autograd saved, a tensor a user kept, a collective's work
object): its storage's use count says so; one still in use is dropped from the pool and left to
be freed by its last user. Idle pooled bytes are held in the ledger as `comm_buffers` ("pool").
"""

from __future__ import annotations

import torch

from zeroshard.partition.memory import MemoryLedger

MIN_BYTES = 32 << 20


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
        self._idle = 0

    def _pooled(self, numel: int, dtype: torch.dtype, device: torch.device) -> bool:
        return device.type == "cpu" and numel * dtype.itemsize >= self.min_bytes

    def empty(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An uninitialised 1-D buffer: a pooled one of this size if one is free, else a new one."""
        if self._pooled(numel, dtype, torch.device(device)):
            free = self._free.get((numel, dtype), [])
            while free:
                t = free.pop()
                self._count(-t.nbytes)
                if _sole_owner(t):
                    self.reused += 1
                    return t
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor | None) -> None:
        """`t` (from `empty`) is no longer needed by its caller."""
        if t is None or not self._pooled(t.numel(), t.dtype, t.device) or t.storage_offset() != 0 \
                or t.dim() != 1 or t.untyped_storage().nbytes() != t.nbytes:
            return
        free = self._free.setdefault((t.numel(), t.dtype), [])
        if len(free) < self.keep:
            free.append(t)
            self._count(t.nbytes)

    def clear(self) -> None:
        self._free.clear()
        self._count(-self._idle)

    def _count(self, delta: int) -> None:
        self._idle += delta
        self.memory.hold("comm_buffers", "pool", self._idle)
