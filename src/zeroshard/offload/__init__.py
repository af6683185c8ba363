"""Tiers: where a shard's storage lives (device, host, nvme files). Knows nothing of stages."""

from zeroshard.offload.tiers import (DeviceTier, HostTier, Tier, file_home_owner, host_step_threads, make_tier,
                                     optimizer_offload_tier, optimizer_tiers, readable, store_value)

__all__ = ["DeviceTier", "HostTier", "Tier", "file_home_owner", "host_step_threads", "make_tier",
           "optimizer_offload_tier", "optimizer_tiers", "readable", "store_value"]
