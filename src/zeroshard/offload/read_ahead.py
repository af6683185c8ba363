"""The NVMe parameter tier's host buffers: shards read ahead of their fetch, and updated shards
written behind their store, with one rule between the two: a shard never has a read and a
write of its region outstanding at once, and while its write is outstanding its new values
are in memory and every read of it is served from there.

- Read-ahead: each fetch records which shard followed the previous two (two, because a
  stage-3 pass fetches a shard in forward and again in backward, so one shard alone has two
  successors) and starts reading the next `count` shards of that chain into a pool of `count`
  aligned host buffers (shards over `numel` elements are read when fetched). A predicted
  fetch waits only for what is left of its read. Where nothing was learned yet (the first
  forward and backward), the next shards in placement order are read, in the direction of
  the last two fetches: a stage-3 build places the units in forward order, and the first
  backward walks them back.
- Write-behind: `store` copies the new values into a host buffer and starts the write; it does
  not wait for it. When a read of that shard is in flight (the read-ahead of the next forward,
  issued while backward was still running and the optimizer steps during backward) the read
  is waited for and its buffer takes the new values: the fetch is served from it. Otherwise
  one of `WRITE_BUFFERS` write buffers holds them until its write is done, and a fetch or a
  read-ahead of that shard copies from it instead of reading the disk.

The pool sizes are fixed up front: `count` read buffers and `WRITE_BUFFERS` write buffers of
the largest shard that fits `numel`. Nothing here knows about stages or optimizers.
"""

from __future__ import annotations

import torch

from zeroshard.offload.aio import DONE, Handle, aligned_empty

WRITE_BUFFERS = 2  # the write of one shard overlaps the copy of the next


class ReadAhead:
    def __init__(self, tier, count: int, numel: int) -> None:
        """`tier`: the NvmeTier whose shards these are (its read, write, wait and regions)."""
        self.tier, self.count, self.numel = tier, count, numel
        self.after: dict[tuple, int] = {}  # (id before, id) -> id of the home fetched next last time
        self.context: tuple = (None, None)  # the last two fetched
        # key -> (buffer, handle, writing): a read in flight (or landed), or a write of the new
        # values in flight from a read buffer that already holds them
        self.inflight: dict[int, tuple[torch.Tensor, Handle, bool]] = {}
        self.free: list[torch.Tensor] = []
        self.retiring: list[tuple[torch.Tensor, Handle]] = []  # read buffers whose write is still running
        self.landing: dict[int, Handle] = {}  # key -> its write from a retired buffer (a read waits for it)
        self.written: dict[int, tuple[torch.Tensor, Handle]] = {}  # key -> write buffer holding its new values
        self.write_free: list[torch.Tensor] = []
        self.buffers = self.write_buffers = 0
        self.buffer_bytes = 0
        self.hits = self.misses = self.served = 0  # served: fetches / reads answered by a pending write
        self.rewritten = 0  # stores that found a read of the same shard in flight (and took its buffer)
        self.wait_s = 0.0
        self.ledger = None  # a MemoryLedger, when the caller wants the pool counted
        self._placed: list[int] = []  # keys in placement order, and their positions (for `_guess`)
        self._position: dict[int, int] = {}

    @property
    def pool_bytes(self) -> int:
        return (self.buffers + self.write_buffers) * self.buffer_bytes

    def _size(self) -> int:
        if not self.buffer_bytes:
            sizes = [r.nbytes for _, r, h in self.tier.placed() if h.numel() <= self.numel]
            self.buffer_bytes = max(sizes or [0])
        return self.buffer_bytes

    def _wait(self, handle: Handle) -> None:
        self.tier.wait(handle)
        self.wait_s += handle.wait_s

    # -- reads ----------------------------------------------------------------------------------
    def fetch(self, home: torch.Tensor, region) -> torch.Tensor:
        key = id(home)
        if self.context[1] is not None:
            self.after[self.context] = key
        self.context = (self.context[1], key)
        entry = self.inflight.pop(key, None)
        nbytes = home.nbytes
        if entry is not None:
            buf, handle, writing = entry
            if not writing:
                self._wait(handle)
            out = buf[:nbytes].view(home.dtype).view(home.shape).clone()
            self._release(buf, handle if writing else DONE)
            if writing:
                self.landing[key] = handle
            self.hits += 1
        elif key in self.written:
            out = self.written[key][0][:nbytes].view(home.dtype).view(home.shape).clone()
            self.served += 1
        else:
            out = torch.empty(home.shape, dtype=home.dtype)
            self._landed(key)
            self._wait(self.tier.read(region, out))
            self.misses += 1
        self._ahead(key)
        return out

    def _ahead(self, key: int) -> None:
        window, state = [], self.context
        for _ in range(2 * self.count):
            k = self.after.get(state)
            if k is None or len(window) >= self.count:
                break
            if k != key and k not in window:
                window.append(k)
            state = (state[1], k)
        if not window and self.context[0] not in (None, key):
            window = self._guess(key)
        for other in [o for o in self.inflight if o not in window]:  # the order changed: drop them
            self._drop(other)
        if not self._size():
            return
        for k in window:
            region = self.tier.region_by_key(k)
            if k in self.inflight or region is None or region.nbytes > self.buffer_bytes:
                continue
            buf = self._buffer()
            if buf is None:
                break
            if k in self.written:  # its newest values are in memory: no read of the disk
                buf[:region.nbytes].copy_(self.written[k][0][:region.nbytes])
                self.inflight[k] = (buf, DONE, False)
                self.served += 1
            else:
                self._landed(k)
                self.inflight[k] = (buf, self.tier.read(region, buf[:region.nbytes]), False)

    def _guess(self, key: int) -> list[int]:
        """Nothing learned after this fetch: the `count` shards placed after `key` in the direction
        the last two fetches went (placement order; the first forward goes up, its backward down)."""
        placed = self.tier.placed()
        if len(placed) != len(self._placed):
            self._placed = [k for k, _, _ in placed]
            self._position = {k: i for i, k in enumerate(self._placed)}
        i, before = self._position.get(key), self._position.get(self.context[0])
        if i is None or before is None:
            return []
        step = 1 if i > before else -1
        ahead = range(i + step, i + step * (self.count + 1), step)
        return [self._placed[j] for j in ahead if 0 <= j < len(self._placed)]

    def _landed(self, key: int) -> None:
        """Before a read of `key` from the disk: its last write has landed (a read overlapping
        it would return the old values)."""
        handle = self.landing.pop(key, None)
        if handle is not None:
            self._wait(handle)

    def _buffer(self) -> torch.Tensor | None:
        if self.free:
            return self.free.pop()
        done = next((i for i, (_, h) in enumerate(self.retiring) if h.done()), None)
        if done is not None:
            buf, handle = self.retiring.pop(done)
            self._wait(handle)
            return buf
        if self.buffers >= self.count:
            if not self.retiring:
                return None
            buf, handle = self.retiring.pop(0)  # the oldest write: it is the nearest to done
            self._wait(handle)
            return buf
        self.buffers += 1
        self._count()
        return aligned_empty(self.buffer_bytes)

    def _release(self, buf: torch.Tensor, handle: Handle) -> None:
        """`buf` is no longer needed for its values; it is free once `handle` (its write) is done."""
        if handle is DONE or handle.done():
            self._wait(handle)
            self.free.append(buf)
        else:
            self.retiring.append((buf, handle))

    def _drop(self, key: int) -> None:
        buf, handle, writing = self.inflight.pop(key)
        if writing:
            self._release(buf, handle)
        else:
            self._wait(handle)
            self.free.append(buf)

    # -- writes ---------------------------------------------------------------------------------
    def store(self, home: torch.Tensor, region, work: torch.Tensor) -> bool:
        """Start writing `work` into `home`'s region without waiting for it; False when `home`
        is too large for the pool (the caller writes it directly)."""
        key = id(home)
        nbytes = home.nbytes
        if not self._size() or region.nbytes > self.buffer_bytes:
            return False
        value = work.detach().reshape(-1)
        self._landed(key)  # writes of one region land in order
        entry = self.inflight.pop(key, None)
        if entry is not None:  # a read or a write of it is outstanding: let it land, then reuse its buffer
            buf, handle, _ = entry
            self._wait(handle)
            self.rewritten += 1
            self._forget_written(key)  # an older write of it lands before the new one starts
        else:
            buf = self._write_buffer(key)
        buf[:nbytes].view(home.dtype).copy_(value)
        handle = self.tier.write(region, buf[:region.nbytes])
        if entry is not None:  # the read-ahead copy is the new value: its fetch is served from it
            self.inflight[key] = (buf, handle, True)
        else:
            self.written[key] = (buf, handle)
        return True

    def _write_buffer(self, key: int) -> torch.Tensor:
        if key in self.written:  # an earlier write of the same shard: wait for it, reuse its buffer
            buf, handle = self.written.pop(key)
            self._wait(handle)
            return buf
        if self.write_free:
            return self.write_free.pop()
        if self.write_buffers < WRITE_BUFFERS:
            self.write_buffers += 1
            self._count()
            return aligned_empty(self.buffer_bytes)
        oldest = next(iter(self.written))  # insertion order: the oldest write
        buf, handle = self.written.pop(oldest)
        self._wait(handle)
        return buf

    def _forget_written(self, key: int) -> None:
        if key in self.written:
            buf, handle = self.written.pop(key)
            self._wait(handle)
            self.write_free.append(buf)

    def _count(self) -> None:
        if self.ledger is not None:
            self.ledger.hold("comm_buffers", "nvme_param_read_ahead", self.pool_bytes, tier="host")

    def flush(self) -> None:
        """Every write started so far is on disk (the buffers keep serving their values)."""
        for _, handle, writing in self.inflight.values():
            if writing:
                self._wait(handle)
        for _, handle in self.written.values():
            self._wait(handle)
        for _, handle in self.retiring:
            self._wait(handle)
        self.landing.clear()

    def drop_all(self) -> None:
        for key in list(self.inflight):
            self._drop(key)
        self.flush()
        self.free += [buf for buf, _ in self.retiring]
        self.retiring.clear()
        self.write_free += [buf for buf, _ in self.written.values()]
        self.written.clear()
