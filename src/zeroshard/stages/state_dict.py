"""The full state dict: every parameter and buffer whole, in fp32, on the CPU of every rank."""

from __future__ import annotations

import torch

from zeroshard.comm import Comm
from zeroshard.partition import FlatBucket
from zeroshard.stages.train_state import TrainState


def full_fp32_buckets(buckets: list[FlatBucket], masters, comm: Comm, sharded: bool):
    """Yield (bucket, full fp32 buffer) one bucket at a time: peak = one bucket in fp32."""
    for bucket, master in zip(buckets, masters):
        if not sharded:
            yield bucket, master
            continue
        device = bucket.device  # a host master (offload) is gathered from the device: NCCL needs it there
        full = torch.empty(bucket.layout.padded_numel, dtype=torch.float32, device=device)
        comm.all_gather(full, master.to(device), what=f"full state dict, bucket {bucket.layout.index}").wait()
        yield bucket, full


def full_state_dict(ts: TrainState, sharded: bool) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor on CPU}, trainable values from the fp32 masters (`sharded`: each
    rank holds a slice of them), gathered one bucket at a time (peak: one bucket in fp32). Tied
    parameters appear under each of their names. A collective: every rank must call it."""
    where = {id(p): (bucket, slot) for bucket in [*ts.buckets, *ts.frozen_buckets]
             for slot, p in zip(bucket.slots, bucket.params)}
    full_of: dict[int, torch.Tensor] = {}
    masters = (ts.optimizer.master_value(b) for b in range(len(ts.buckets)))  # one at a time (nvme)
    for bucket, full in full_fp32_buckets(ts.buckets, masters, ts.comm, sharded):
        full_of[id(bucket)] = full.cpu()
    for bucket in ts.frozen_buckets:
        with bucket.whole(ts.comm, f"full state dict, frozen unit '{bucket.name}'") as full:
            full_of[id(bucket)] = full.float().cpu()
    out: dict[str, torch.Tensor] = {}
    for name, t in ts.module.state_dict(keep_vars=True).items():
        if id(t) in where:
            bucket, slot = where[id(t)]
            out[name] = full_of[id(bucket)][slot.offset : slot.end].view(slot.shape).clone()
        else:
            t = t.detach()
            out[name] = (t.float() if t.is_floating_point() else t).cpu().clone()
    return out
