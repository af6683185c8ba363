"""Fences for asynchronous copies between pinned host memory and a device.

A `non_blocking` copy from a pinned host tensor to a device returns before the copy has read
its source: the host must not write that source again until the device stream has passed the
copy, or the device receives a mix of old and new values (CUDA gives no error; training is
silently wrong). The sharded optimizer writes each updated fp32 master from pinned host memory
(`offload_optimizer` with `pin_memory`) into its device shard this way, and steps the same
master in place one step later, or edits it in place for `GatheredParameters` or a checkpoint
load. `CopyFences` records an event on the current stream after a key's copies are issued and,
before the key's sources are written again, blocks the host until the event has passed
(usually long done: a forward and a backward lie between). Without CUDA every copy is
synchronous and nothing is recorded.
"""

from __future__ import annotations

from typing import Any, Callable, Hashable

import torch

__all__ = ["CopyFences"]


class CopyFences:
    def __init__(self, enabled: bool | None = None, make_event: Callable[[], Any] | None = None) -> None:
        """`enabled` defaults to CUDA being available; `make_event` to `torch.cuda.Event`
        (tests give a stand-in that records what was waited for)."""
        self.enabled = torch.cuda.is_available() if enabled is None else enabled
        self._make_event = make_event or torch.cuda.Event
        self._pending: dict[Hashable, Any] = {}

    def record(self, key: Hashable) -> None:
        """After `key`'s asynchronous copies were issued on the current stream."""
        if self.enabled:
            event = self._make_event()
            event.record()
            self._pending[key] = event

    def wait(self, key: Hashable) -> None:
        """Before `key`'s copy sources are written again: the copies have read them."""
        event = self._pending.pop(key, None)
        if event is not None:
            event.synchronize()

    def wait_all(self) -> None:
        for key in list(self._pending):
            self.wait(key)

    @property
    def pending(self) -> int:
        return len(self._pending)
