"""Parking tensors' storage in host memory: DeepSpeed's `offload_states` / `reload_states`.

`park(tensors)` copies each distinct storage behind `tensors` into a host buffer (pinned on a
CUDA machine when asked) and frees the storage itself (resized to zero bytes), so the memory
goes back while every tensor object, view and optimizer reference stays valid; `unpark()`
gives each storage its size back and copies the bytes home, exactly. The storage level is
what makes this safe for views: a parameter's `.grad` view into a flat gradient buffer, a
parameter's view into its bucket, or a master the torch optimizer holds, all see the bytes
again without being rebound. On a machine without CUDA the host is the device, so the bytes
move from one host buffer to another: the same code, the same exactness, no memory saved.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["ParkedStorages"]


class ParkedStorages:
    def __init__(self) -> None:
        self._parked: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}

    def park(self, tensors: Iterable[torch.Tensor], pin_memory: bool = True, non_blocking: bool = False) -> int:
        """Free the storage behind `tensors` (each once), keeping its bytes on the host; bytes parked."""
        moved = 0
        pin = pin_memory and torch.cuda.is_available()
        for t in tensors:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in self._parked or storage.nbytes() == 0:
                continue
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, device="cpu", pin_memory=pin)
            host.untyped_storage().copy_(storage, non_blocking=non_blocking and pin)
            if non_blocking and pin:
                torch.cuda.current_stream().synchronize()  # the bytes are on the host before the storage goes
            self._parked[key] = (storage, host)
            moved += storage.nbytes()
            storage.resize_(0)
        return moved

    def unpark(self, non_blocking: bool = False) -> int:
        """Every parked storage back at its size with its bytes; bytes restored."""
        restored = 0
        for storage, host in self._parked.values():
            storage.resize_(host.numel())
            storage.copy_(host.untyped_storage(), non_blocking=non_blocking and host.is_pinned())
            restored += host.numel()
        self._parked.clear()
        return restored

    @property
    def parked_bytes(self) -> int:
        return sum(host.numel() for _, host in self._parked.values())

    def __bool__(self) -> bool:
        return bool(self._parked)
