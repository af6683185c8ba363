"""The full state dict: every parameter and buffer whole, in fp32, on the CPU of every rank."""

from __future__ import annotations

import torch

from zeroshard.comm import Comm
from zeroshard.partition import FlatBucket
from zeroshard.stages.train_state import TrainState


def gather_fp32(bucket: FlatBucket, shard: torch.Tensor, comm: Comm, what: str) -> torch.Tensor:
    """The bucket's full fp32 buffer from every rank's `shard` of it (a collective), on the
    bucket's device: a host shard (offload) is gathered from there, as NCCL needs."""
    full = torch.empty(bucket.layout.padded_numel, dtype=torch.float32, device=bucket.device)
    comm.all_gather(full, shard.float().to(bucket.device), what=what).wait()
    return full


def full_state_dict(ts: TrainState, sharded: bool) -> dict[str, torch.Tensor]:
    """{name: full fp32 tensor on CPU}, trainable values from the fp32 masters (`sharded`: each
    rank holds a slice of them), gathered one bucket at a time (peak: one bucket in fp32). Tied
    parameters appear under each of their names. A collective: every rank must call it."""
    where = {id(p): (bucket, slot) for bucket in [*ts.buckets, *ts.frozen_buckets]
             for slot, p in zip(bucket.slots, bucket.params)}
    full_of: dict[int, torch.Tensor] = {}
    for b, bucket in enumerate(ts.buckets):
        full = ts.optimizer.master_value(b)  # one at a time (nvme: read from its file)
        if sharded:
            full = gather_fp32(bucket, full, ts.comm, f"full state dict, bucket {bucket.layout.index}")
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
