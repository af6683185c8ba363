"""Tiers: where a shard's storage lives, and how it moves to and from the device.

A tier allocates a shard's home (`place`), hands a work copy to a device (`fetch`, async on
CUDA: pinned host memory and a side stream) and writes a work tensor back home (`store`).
`device` keeps shards where the model computes; `host` keeps them in CPU memory, pinned when
CUDA exists and `pin_memory` is set; `nvme` (offload/nvme.py) keeps them in files. On a
CPU-only machine device and host are the same memory: `fetch` and `store` return or write
the same tensor, no copy is made, and only the ledger's tier says where a byte belongs. The
NVMe tier (files, positioned I/O, offload/nvme.py) plugs into the same three calls.

Nothing here knows about stages, buckets or optimizers.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

import torch

from zeroshard.partition.layout import offload_split
from zeroshard.policies import OffloadDevice, OffloadPolicy

log = logging.getLogger("zeroshard")

class Tier:
    name = "device"

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device(device)  # where this tier's tensors live

    def place(self, tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """`tensor` moved to (or, with `copy`, copied into) this tier's memory."""
        if tensor.device == self.device:
            return tensor.clone() if copy else tensor
        return tensor.to(self.device)

    def fetch(self, home: torch.Tensor, device: torch.device, stream=None) -> torch.Tensor:
        """A tensor on `device` with `home`'s values: `home` itself when it already is there."""
        if home.device == torch.device(device):
            return home
        if stream is None:
            return home.to(device, non_blocking=home.is_pinned())
        with torch.cuda.stream(stream):
            return home.to(device, non_blocking=home.is_pinned())

    def home(self, tensor: torch.Tensor, copy: bool = False) -> "Home":
        """A home on this tier for `tensor`'s values (moved, or with `copy` copied, there)."""
        return Home(self, self.place(tensor, copy))

    def store(self, home: torch.Tensor, work: torch.Tensor) -> None:
        """Write `work` back into `home` (nothing to do when they are the same tensor)."""
        if work.data_ptr() != home.data_ptr():
            home.copy_(work, non_blocking=home.is_pinned() or work.is_pinned())

    def same_memory(self, device: torch.device) -> bool:
        return self.device == torch.device(device)

    def describe(self) -> str:
        return f"{self.name} ({self.device})"

    def close(self) -> None:
        """Release what the tier holds outside tensors (files, threads); memory tiers hold none."""


class Home:
    """Where one shard rests on a tier. `tensor` stands for it in memory: the shard itself on the
    device and host tiers, a placeholder with its shape on the nvme tier (offload/nvme.py)."""

    def __init__(self, tier: Tier, tensor: torch.Tensor) -> None:
        self.tier, self.tensor = tier, tensor

    def read(self) -> torch.Tensor:
        """The values: the shard itself in memory (a fresh tensor read from a file on nvme)."""
        return self.tensor

    def write(self, value: torch.Tensor, asynchronous: bool = False) -> None:
        """New values; `asynchronous` lets a copy between pinned host memory and a device run
        on the stream (the next read on that stream sees it)."""
        if asynchronous:
            self.tier.store(self.tensor, value)
        else:
            self.tensor.copy_(value)

    def fetch(self, device: torch.device, stream=None) -> torch.Tensor:
        """A work copy on `device` (the shard itself when it is there already)."""
        return self.tier.fetch(self.tensor, device, stream)


class DeviceTier(Tier):
    name = "device"


class HostTier(Tier):
    """CPU memory; pinned (page-locked) when CUDA exists and `pin` asks for it, so device
    copies run asynchronously. Pinning that cannot be had falls back to pageable memory
    once, with a start-up note."""

    name = "host"

    def __init__(self, pin: bool) -> None:
        super().__init__(torch.device("cpu"))
        self.pin = bool(pin) and torch.cuda.is_available()
        self.note = "" if self.pin or not pin else "pin_memory: no CUDA here, host memory is the device memory"

    def place(self, tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
        out = super().place(tensor, copy)
        if self.pin and not out.is_pinned():
            try:
                out = out.pin_memory()
            except RuntimeError as exc:  # locked-memory limit, or no driver
                self.pin = False
                self.note = f"pin_memory: could not pin host memory ({str(exc).splitlines()[0]}); using pageable"
                log.warning("zeroshard: %s", self.note)
        return out

    def describe(self) -> str:
        return "host (cpu" + (", pinned)" if self.pin else ")")


def memory_tier(policy: OffloadPolicy, device: torch.device) -> Tier:
    """The tier in memory `policy` asks for: the host with `cpu`, else the device (the nvme
    tier is offload/nvme.py's; `zeroshard.offload.make_tier` chooses among all three)."""
    if policy.device is OffloadDevice.CPU:
        return HostTier(policy.pin_memory)
    return DeviceTier(device)


def host_step_threads(local_world_size: int) -> tuple[int, str]:
    """Intra-op threads for this rank's host step, so the ranks of a node never oversubscribe
    its cores: set to cores // local ranks when torch would use more; what torch or
    OMP_NUM_THREADS (torchrun sets 1 per rank) chose is kept when it fits."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    share = max(1, cores // max(1, local_world_size))
    now = torch.get_num_threads()
    if now * max(1, local_world_size) > cores:
        torch.set_num_threads(share)
        return share, f"{share} thread(s) ({cores} cores / {local_world_size} local ranks; was {now})"
    return now, f"{now} thread(s) ({cores} cores, {local_world_size} local ranks)"


def optimizer_tiers(policy: OffloadPolicy, sizes: Sequence[int], device: torch.device,
                    offload: Tier | None) -> list[Tier]:
    """The tier of each bucket shard's master and optimizer states: all on the device, or on
    `offload` (the host with `cpu`, files with `nvme`; from `optimizer_offload_tier`), the first
    `ratio` of the elements at stage 3."""
    device_tier = DeviceTier(device)
    if offload is None:
        return [device_tier] * len(sizes)
    return [offload if goes else device_tier for goes in offload_split(sizes, policy.ratio)]
