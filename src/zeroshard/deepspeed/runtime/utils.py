"""`deepspeed.runtime.utils`: the two helpers example scripts call (`see_memory_usage`, `move_to_device`)."""

from __future__ import annotations

import gc
import logging

import torch

from zeroshard.deepspeed.accelerator import get_accelerator

__all__ = ["move_to_device", "see_memory_usage"]

log = logging.getLogger("zeroshard.deepspeed")


def see_memory_usage(message: str, force: bool = False) -> None:
    """With `force`, rank 0 logs the accelerator's memory now and at peak (GB) and the host's
    memory in use, then starts a new peak, as DeepSpeed's; without it, nothing."""
    from zeroshard.deepspeed import comm

    if not force or comm.get_rank() != 0:
        return
    gc.collect()
    acc = get_accelerator()
    gb = 2**30
    total, available = acc.total_memory(), acc.available_memory()
    log.info("%s", message)
    log.info("MA %.2f GB         Max_MA %.2f GB         CA %.2f GB         Max_CA %.2f GB ",
             acc.memory_allocated() / gb, acc.max_memory_allocated() / gb, acc.memory_reserved() / gb,
             acc.max_memory_reserved() / gb)
    log.info("CPU Virtual Memory:  used = %.2f GB, percent = %.1f%%", (total - available) / gb,
             100.0 * (total - available) / total)
    acc.reset_peak_memory_stats()


def move_to_device(item, device, criterion_func=lambda t: True):
    """`item` with every tensor (in lists, tuples and dicts, at any depth) that `criterion_func`
    accepts moved to `device`; other values as they are."""
    if torch.is_tensor(item):
        return item.to(device) if criterion_func(item) else item
    if isinstance(item, list):
        return [move_to_device(v, device, criterion_func) for v in item]
    if isinstance(item, tuple):
        return tuple(move_to_device(v, device, criterion_func) for v in item)
    if isinstance(item, dict):
        return {k: move_to_device(v, device, criterion_func) for k, v in item.items()}
    return item
