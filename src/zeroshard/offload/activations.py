"""Activation offload (ZeRO-Infinity): the inputs a checkpointed segment keeps for backward,
on the device, on the host, or in files under `nvme_path`.

`checkpoint(function, *args)` is activation checkpointing (torch's, reentrant or not) whose
kept inputs go through the configured `ActivationOffload` store:

* reentrant: torch's `CheckpointFunction` saves the segment's tensor inputs with
  `save_for_backward`; the call runs under `torch.autograd.graph.saved_tensors_hooks`, so
  exactly those inputs reach `pack` (nothing else is saved: the segment runs without grad).
* non-reentrant: torch keeps the inputs in its recompute closure, out of the hooks' reach;
  the inputs are handed over in a box that is emptied into `pack` once forward returns and
  read back through `unpack` when backward recomputes the segment.

Tiers (`ActivationOffloadPolicy.device`):

* none: the tensor itself is kept (plain checkpointing); the ledger says "device".
* cpu (DeepSpeed's `cpu_checkpointing`): on CUDA a pinned host copy made with a non-blocking
  copy on a side stream, copied back when backward reaches the segment, and the next one
  (in reverse order) copied ahead on the side stream; on a CPU-only machine host and device
  are the same memory: no copy, the ledger says "host".
* nvme: each saved tensor is copied into one of `buffer_count` aligned host staging buffers and
  written through the NVMe tier's I/O engine (`offload/aio.py`, the same thread pool, O_DIRECT
  where allowed) to its own file in the run folder `nvme_path/zeroshard-<host>-<pid>-r<rank>-
  activations` (made, locked, swept and removed by `NvmeTier`). When backward unpacks one, the
  next `buffer_count - 1` still on disk, in reverse order of packing, are read ahead. A file is
  deleted as soon as it is read back, when autograd frees a graph that was never run backward,
  and at exit.

Every kept tensor is in the `MemoryLedger` category "activations" on its tier; the staging
buffers of the NVMe variant are "comm_buffers" on the host. Knows nothing of stages.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable

import torch
import torch.utils.checkpoint as torch_checkpoint

from zeroshard.offload.aio import Handle, align_up, aligned_empty
from zeroshard.policies import ActivationOffloadPolicy, AioPolicy, OffloadDevice

log = logging.getLogger("zeroshard")

__all__ = ["ActivationOffload", "checkpoint", "configure", "current", "reset"]

_TIER = {OffloadDevice.NONE: "device", OffloadDevice.CPU: "host", OffloadDevice.NVME: "nvme"}
_STAGING_KEY = "activation_io_buffers"


class _Saved:
    """What autograd holds in place of a saved tensor until backward unpacks it."""

    __slots__ = ("seq", "shape", "dtype", "device", "nbytes", "tensor", "event", "path", "write", "read",
                 "ahead", "unpacked", "__weakref__")

    def __init__(self, seq: int, t: torch.Tensor) -> None:
        self.seq, self.shape, self.dtype, self.device = seq, t.shape, t.dtype, t.device
        self.nbytes = t.nbytes
        self.tensor: torch.Tensor | None = None  # device / host copy (tiers none, cpu)
        self.event = None  # CUDA: the side-stream copy to the host is done
        self.path: str | None = None  # nvme: its file
        self.write: Handle | None = None
        self.read: tuple[torch.Tensor, Handle] | None = None  # nvme: read ahead into this buffer
        self.ahead = None  # cpu on CUDA: (device tensor, event) copied ahead of its unpack
        self.unpacked: torch.Tensor | None = None  # a second unpack (retain_graph) gets the same tensor


class ActivationOffload:
    """The store behind `checkpoint`: `pack` a kept tensor onto the tier, `unpack` it back."""

    def __init__(self, policy: ActivationOffloadPolicy | None = None, aio: AioPolicy | None = None,
                 ledger=None, rank: int = 0) -> None:
        self.policy = policy = policy or ActivationOffloadPolicy()
        self.device = policy.device
        self.tier = _TIER[self.device]
        self.ledger = ledger
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._live: dict[int, weakref.ref] = {}  # seq -> entry still waiting (nvme; cpu on CUDA)
        self._held: set[int] = set()  # seqs whose bytes are counted
        self._writing: deque[tuple[torch.Tensor, Handle]] = deque()
        self._free: list[torch.Tensor] = []
        self._buffers = 0
        self._staging_bytes = 0
        self._stream = None
        self.nvme = None
        self.closed = False
        # counters: tensors / bytes packed, read back (hits: read ahead in time), files now / at peak
        self.packed = self.packed_bytes = self.hits = self.misses = 0
        self.files = self.peak_files = 0
        self.now = {t: 0 for t in ("device", "host", "nvme")}
        self.peak = dict(self.now)
        if self.device == OffloadDevice.NVME:
            from zeroshard.offload.nvme import NvmeTier  # the run folder, its lock, sweep and clean-up

            self.nvme = NvmeTier(policy.nvme_path, aio or AioPolicy(), "activations", rank)
            self.io = self.nvme.io
            self.folder = self.nvme.folder

    # -- start-up ------------------------------------------------------------------------------------
    def describe(self) -> str:
        what = ("checkpointed activations (the inputs each checkpointed segment keeps; zeroshard.checkpoint_"
                "activations / deepspeed.checkpointing.checkpoint)")
        why = f" ({self.policy.why})" if self.policy.why else ""
        if self.device == OffloadDevice.NONE:
            return f"activations: {what} stay on the device (no activation offload configured)"
        if self.device == OffloadDevice.CPU:
            how = ("pinned host copies on a side stream, copied back ahead of backward" if torch.cuda.is_available()
                   else "host and device are the same memory here: no copy, the ledger counts them on the host")
            return f"activations: {what} live on the host{why}; {how}"
        return (f"activations: {what} live in files under {self.folder}{why}; {self.policy.buffer_count} host "
                f"staging buffer(s), read back ahead of backward in reverse order; {self.io.describe()}")

    # -- pack / unpack -----------------------------------------------------------------------------
    @contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield

    def pack(self, t: torch.Tensor) -> _Saved:
        entry = _Saved(next(self._seq), t)
        t = t.detach()
        if self.device == OffloadDevice.NONE:
            entry.tensor = t
        elif self.device == OffloadDevice.CPU:
            entry.tensor, entry.event = self._to_host(t)
        else:
            self._write(entry, t)
        self.packed += 1
        self.packed_bytes += entry.nbytes
        self._hold(entry)
        weakref.finalize(entry, self._forget, entry.seq, entry.path, entry.nbytes, entry.write)
        return entry

    def unpack(self, entry: _Saved) -> torch.Tensor:
        if entry.unpacked is not None:
            return entry.unpacked
        if self.device == OffloadDevice.NONE:
            out = entry.tensor
        elif self.device == OffloadDevice.CPU:
            out = self._from_host(entry)
        else:
            out = self._read(entry)
        entry.tensor = None
        entry.unpacked = out
        self._forget(entry.seq, entry.path, entry.nbytes, entry.write)
        entry.path = entry.write = None
        return out

    # -- host ---------------------------------------------------------------------------------------
    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _to_host(self, t: torch.Tensor):
        if not (t.is_cuda and torch.cuda.is_available()):
            return t, None  # CPU-only: host is the device's memory, nothing to move
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream(t.device))
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # the device memory is reused only after the copy
            event = torch.cuda.Event()
            event.record(stream)
        return host, event

    def _from_host(self, entry: _Saved) -> torch.Tensor:
        if entry.event is None:
            out = entry.tensor
        elif entry.ahead is not None:
            out, event = entry.ahead
            torch.cuda.current_stream(entry.device).wait_event(event)
            self.hits += 1
        else:
            torch.cuda.current_stream(entry.device).wait_event(entry.event)
            out = entry.tensor.to(entry.device, non_blocking=True)
            self.misses += 1
        if entry.event is not None:  # copy the next one in reverse order to the device ahead of time
            nxt = self._previous(entry.seq, lambda e: e.event is not None and e.ahead is None and e.tensor is not None)
            if nxt is not None:
                stream = self._side_stream()
                with torch.cuda.stream(stream):
                    stream.wait_event(nxt.event)
                    dev = nxt.tensor.to(nxt.device, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
                dev.record_stream(torch.cuda.current_stream(nxt.device))
                nxt.ahead = (dev, event)
        return out

    # -- nvme -----------------------------------------------------------------------------------------
    def _staging(self, nbytes: int) -> torch.Tensor:
        """An aligned host buffer of at least `nbytes`: a free one, a new one while fewer than
        `buffer_count` exist, else the oldest one being written (waited for)."""
        self._reclaim(block=False)
        while True:
            for i, buf in enumerate(self._free):
                if buf.numel() >= nbytes:
                    return self._free.pop(i)
            if self._buffers < self.policy.buffer_count:
                self._buffers += 1
                break
            if self._free:  # all free ones too small: replace one by a larger one
                self._staging_bytes -= self._free.pop().numel()
                break
            self._reclaim(block=True)
        buf = aligned_empty(nbytes)
        self._staging_bytes += buf.numel()
        if self.ledger is not None:
            self.ledger.hold("comm_buffers", _STAGING_KEY, self._staging_bytes, tier="host")
        return buf

    def _reclaim(self, block: bool) -> None:
        while self._writing and (block or self._writing[0][1].done()):
            buf, handle = self._writing.popleft()
            handle.wait()
            self._free.append(buf)
            block = False

    def flush(self) -> None:
        """Wait for every write in flight (NVMe)."""
        while self._writing:
            self._reclaim(block=True)

    def _write(self, entry: _Saved, t: torch.Tensor) -> None:
        buf = self._staging(entry.nbytes)
        buf[:entry.nbytes].view(t.dtype).view(t.shape).copy_(t)  # on CUDA a synchronous device -> host copy
        entry.path = self.io.open(f"act-{entry.seq:08d}.bin")
        entry.write = self.io.write(entry.path, buf[:align_up(entry.nbytes)], 0)
        self._writing.append((buf, entry.write))
        self.files += 1
        self.peak_files = max(self.peak_files, self.files)

    def _start_read(self, entry: _Saved) -> None:
        if entry.write is not None:
            entry.write.wait()  # the bytes must be on disk before they are read
        buf = aligned_empty(entry.nbytes)
        entry.read = (buf, self.io.read(entry.path, buf, 0))

    def _read(self, entry: _Saved) -> torch.Tensor:
        if entry.read is None:
            self.misses += 1
            self._start_read(entry)
        else:
            self.hits += 1
        buf, handle = entry.read
        handle.wait()
        entry.read = None
        out = buf[:entry.nbytes].view(entry.dtype).view(entry.shape)
        self._live.pop(entry.seq, None)
        # the next ones backward will need (reverse order of packing), read while this one is used
        ahead, seq = self.policy.buffer_count - 1, entry.seq
        while ahead > 0:
            nxt = self._previous(seq, lambda e: e.read is None and e.path is not None)
            if nxt is None:
                break
            self._start_read(nxt)
            seq, ahead = nxt.seq, ahead - 1
        return out if entry.device.type == "cpu" else out.to(entry.device, non_blocking=False)

    def _previous(self, seq: int, want: Callable[[_Saved], bool]) -> _Saved | None:
        """The entry packed last before `seq` that is still waiting and satisfies `want`."""
        for s in sorted((s for s in self._live if s < seq), reverse=True):
            e = self._live[s]()
            if e is not None and want(e):
                return e
        return None

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _hold(self, entry: _Saved) -> None:
        with self._lock:
            self._held.add(entry.seq)
            self.now[self.tier] += entry.nbytes
            self.peak[self.tier] = max(self.peak[self.tier], self.now[self.tier])
            if entry.path is not None or entry.event is not None:  # nvme, or cpu on CUDA: read / copied ahead
                self._live[entry.seq] = weakref.ref(entry)
        if self.ledger is not None:
            self.ledger.hold("activations", f"checkpoint:{entry.seq}", entry.nbytes, tier=self.tier)

    def _forget(self, seq: int, path: str | None, nbytes: int, write: Handle | None) -> None:
        """The tensor was read back or its graph was freed: release its bytes, delete its file."""
        with self._lock:
            if seq not in self._held:
                return
            self._held.discard(seq)
            self._live.pop(seq, None)
            self.now[self.tier] -= nbytes
        if self.ledger is not None:
            self.ledger.release("activations", f"checkpoint:{seq}")
        if path is not None and not self.closed:
            if write is not None:
                write.wait()  # a write still in flight finishes before its file goes
            self.io.discard(path)
            self.files -= 1

    def stats(self) -> dict[str, Any]:
        return {"tier": self.tier, "packed": self.packed, "packed_bytes": self.packed_bytes,
                "hits": self.hits, "misses": self.misses, "files": self.files, "peak_files": self.peak_files,
                **{f"now_{t}": v for t, v in self.now.items()}, **{f"peak_{t}": v for t, v in self.peak.items()}}

    def reset_peaks(self) -> None:
        self.peak = dict(self.now)
        self.peak_files = self.files

    def close(self) -> None:
        """Remove the run folder and its files (NVMe); idempotent."""
        if self.closed:
            return
        self.closed = True
        self._writing.clear()
        self._free.clear()
        if self.ledger is not None:
            self.ledger.release("comm_buffers", _STAGING_KEY)
        if self.nvme is not None:
            self.nvme.close()


# -- the process's store and the checkpoint function ---------------------------------------------
_DEFAULT = ActivationOffload()
_CURRENT: ActivationOffload = _DEFAULT


def current() -> ActivationOffload:
    return _CURRENT


def configure(store: ActivationOffload | None) -> ActivationOffload:
    """Make `store` the one `checkpoint` uses (None: plain checkpointing); the previous is closed."""
    global _CURRENT
    previous, _CURRENT = _CURRENT, store or _DEFAULT
    if previous is not _CURRENT and previous is not _DEFAULT:
        previous.close()
    return _CURRENT


def reset() -> None:
    configure(None)


class _Inputs:
    """The tensor inputs of a non-reentrant segment, handed to torch's closure in a box: the real
    tensors during forward, packed onto the tier after it, unpacked for the recomputation."""

    def __init__(self, args: tuple) -> None:
        self.args = list(args)
        self.packed: dict[int, tuple[_Saved, bool]] | None = None
        self.store: ActivationOffload | None = None

    def offload(self, store: ActivationOffload) -> None:
        self.store, self.packed = store, {}
        for i, a in enumerate(self.args):
            if isinstance(a, torch.Tensor):
                self.packed[i] = (store.pack(a), a.requires_grad)
                self.args[i] = None

    def get(self) -> list:
        if self.packed is None:
            return self.args
        out = list(self.args)
        for i, (entry, requires_grad) in self.packed.items():
            out[i] = self.store.unpack(entry).detach().requires_grad_(requires_grad)
        return out


def checkpoint(function: Callable, *args, use_reentrant: bool = True, **kwargs):
    """Activation checkpointing (torch.utils.checkpoint) whose kept inputs live on the tier of
    the configured store (`zeroshard.initialize` configures it from the config)."""
    store = _CURRENT
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if use_reentrant:
        with store.hooks():
            return torch_checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)
    box = _Inputs(args)
    out = torch_checkpoint.checkpoint(lambda b, **kw: function(*b.get(), **kw), box, use_reentrant=False, **kwargs)
    box.offload(store)
    return out
