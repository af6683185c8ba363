"""The training data loader `deepspeed.initialize(training_data=...)` returns.

Built as DeepSpeed's `deepspeed_io` builds it: a `torch.utils.data.DistributedSampler`
over the data-parallel ranks with its defaults (shuffled, seed 0, padded rather than
dropped), batches of `train_micro_batch_size_per_gpu` samples per rank, the given
`collate_fn`, and `drop_last` from the config's `dataloader_drop_last`. Call
`loader.sampler.set_epoch(epoch)` (or DeepSpeed's `loader.data_sampler.set_epoch`) for a
new order each epoch; like DeepSpeed's loader, it never does so by itself. Workers: 0 (DeepSpeed starts 2 per GPU; the order is the same).
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = ["build_dataloader"]


def build_dataloader(dataset: Dataset, micro_batch_size: int, world_size: int, rank: int,
                     collate_fn=None, drop_last: bool = False) -> DataLoader:
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank)
    loader = DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate_fn,
                        drop_last=drop_last, pin_memory=torch.cuda.is_available(), num_workers=0)
    loader.data_sampler = sampler  # DeepSpeedDataLoader's name for it (scripts call .data_sampler.set_epoch)
    return loader
