"""Tiers: where a shard's storage lives (device, host, nvme files). Knows nothing of stages."""

from zeroshard.offload.choose import make_tier, optimizer_offload_tier
from zeroshard.offload.tiers import DeviceTier, Home, HostTier, Tier, host_step_threads, optimizer_tiers

__all__ = ["DeviceTier", "Home", "HostTier", "Tier", "host_step_threads", "make_tier", "optimizer_offload_tier",
           "optimizer_tiers"]
