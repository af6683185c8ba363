"""`deepspeed.checkpoint.utils.clone_tensors_for_torch_save`."""

from __future__ import annotations

import torch

__all__ = ["clone_tensors_for_torch_save"]


def clone_tensors_for_torch_save(item, device: torch.device = torch.device("cpu")):
    """A copy of `item` (tensors, in lists, tuples and dicts, at any depth) whose tensors own
    just their own storage on `device`: saving a view of a large flat buffer (a zeroshard
    bucket) then writes the view, not the buffer. Other values are returned as they are."""
    if torch.is_tensor(item):
        return item.detach().clone().to(device) if item.device != device else item.detach().clone()
    if isinstance(item, list):
        return [clone_tensors_for_torch_save(v, device) for v in item]
    if isinstance(item, tuple):
        return tuple(clone_tensors_for_torch_save(v, device) for v in item)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    return item
