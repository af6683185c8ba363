"""Which tier a policy asks for: the one place that knows all three (device, host, nvme)."""

from __future__ import annotations

import torch

from zeroshard.offload.nvme import NvmeTier
from zeroshard.offload.tiers import Tier, memory_tier
from zeroshard.policies import AioPolicy, OffloadDevice, OffloadPolicy


def make_tier(policy: OffloadPolicy, device: torch.device, aio: AioPolicy | None = None, rank: int = 0,
              purpose: str = "shards") -> Tier:
    """The tier `policy` asks for. `aio`, `rank` and `purpose` name and drive the NVMe tier's
    files (`purpose` "params" reads shards ahead, with offload_param's buffers); the other
    tiers ignore them."""
    if policy.device is OffloadDevice.NVME:
        read_ahead = (policy.buffer_count, policy.buffer_size) if purpose == "params" else (0, 0)
        return NvmeTier(policy.nvme_path, aio or AioPolicy(), purpose, rank, read_ahead)
    if policy.device in (OffloadDevice.CPU, OffloadDevice.NONE):
        return memory_tier(policy, device)
    raise NotImplementedError(f"offload device {policy.device.value!r} has no tier")


def optimizer_offload_tier(policy: OffloadPolicy, device: torch.device, aio: AioPolicy | None = None,
                           rank: int = 0) -> Tier | None:
    """The one tier `offload_optimizer` sends masters and states to, or None without offload."""
    return None if policy.device is OffloadDevice.NONE else make_tier(policy, device, aio, rank, "optimizer")
