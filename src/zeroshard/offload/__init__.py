"""Tiers: where a shard's storage lives (device, host; nvme next). Knows nothing of stages."""

from zeroshard.offload.tiers import DeviceTier, HostTier, Tier, host_step_threads, make_tier, optimizer_tiers

__all__ = ["DeviceTier", "HostTier", "Tier", "host_step_threads", "make_tier", "optimizer_tiers"]
