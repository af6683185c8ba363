"""Optimizer states DeepSpeed swapped to NVMe (stage 3, `offload_optimizer: nvme`).

Read from DeepSpeed 0.18's runtime/engine.py (`save_checkpoint`, `load_checkpoint`),
runtime/zero/stage3.py and runtime/swap_tensor/optimizer_utils.py:

- a sub-group whose fp32 partition is 1 MiB or more on a rank (swap_tensor's MIN_AIO_BYTES, or
  `aio.block_size` if larger) lives in swap files; before saving, DeepSpeed releases the
  swapped tensors, so that rank's optim_states file holds an empty `fp32_flat_groups[i]` and
  empty Adam states for it (its `step` stays there);
- `save_checkpoint` copies the rank's swap folder to `global_stepN/offloaded_tensors/rankNN/`:
  `<first>_<last>.tensor.swp` is the fp32 partition of the sub-group whose parameters have
  DeepSpeed ids first..last (ids grow in parameter order), `exp_avg-<first>_<last>.tensor.swp`
  and `exp_avg_sq-<first>_<last>.tensor.swp` its Adam states: raw fp32, little-endian, the
  partition's elements first, then padding up to the I/O alignment.

So the swapped sub-groups, in order, are the fp32 files sorted by their first id. Files are
memory-mapped, one at a time, read only over the range a read needs.
"""

from __future__ import annotations

import mmap
import os
import re
import warnings

import torch

from zeroshard.policies import CheckpointError

FOLDER = "offloaded_tensors"
FP32_FILE = re.compile(r"^(\d+)_(\d+)\.tensor\.swp$")


def swap_folder(tag_dir: str, rank: int) -> str:
    return os.path.join(tag_dir, FOLDER, f"rank{rank:02d}")


class Offloaded:
    """The swap files of the sub-groups `swapped` (indices, in order), `sizes[i]` elements each
    on every rank."""

    def __init__(self, tag_dir: str, swapped: list[int], sizes: list[int]) -> None:
        self.tag_dir, self.swapped, self.sizes = tag_dir, swapped, sizes
        self._ids: dict[int, dict[int, str]] = {}  # rank -> sub-group -> DeepSpeed id ("first_last")

    def _ids_of(self, rank: int) -> dict[int, str]:
        if rank not in self._ids:
            folder = swap_folder(self.tag_dir, rank)
            if not os.path.isdir(folder):
                raise CheckpointError(f"{folder}: missing; rank {rank}'s optimizer states were swapped to NVMe and "
                                      "DeepSpeed saves them there: the checkpoint is incomplete")
            found = sorted((int(m.group(1)), m.group(0)[: -len(".tensor.swp")])
                           for m in map(FP32_FILE.match, os.listdir(folder)) if m)
            if len(found) != len(self.swapped):
                raise CheckpointError(f"{folder}: {len(found)} fp32 swap file(s) (<first>_<last>.tensor.swp), but "
                                      f"{len(self.swapped)} sub-group(s) are empty in the optim_states file: the "
                                      "swap folder is not this checkpoint's")
            self._ids[rank] = {k: ds_id for k, (_, ds_id) in zip(self.swapped, found)}
        return self._ids[rank]

    def tensor(self, rank: int, flat: int, key: str | None) -> torch.Tensor:
        """Sub-group `flat`'s fp32 partition (key None) or its state `key` on `rank`: the file
        mapped, its first sizes[flat] elements."""
        ds_id = self._ids_of(rank)[flat]
        name = f"{ds_id}.tensor.swp" if key is None else f"{key}-{ds_id}.tensor.swp"
        path = os.path.join(swap_folder(self.tag_dir, rank), name)
        n = self.sizes[flat]
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointError(f"{path}: missing; the checkpoint's NVMe swap files are incomplete") from None
        if size < n * 4:
            raise CheckpointError(f"{path}: {size} bytes, sub-group {flat} needs {n * 4} (truncated?)")
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), n * 4, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # a read-only buffer: the tensor is only ever read
            warnings.simplefilter("ignore")
            return torch.frombuffer(mapped, dtype=torch.float32, count=n)
