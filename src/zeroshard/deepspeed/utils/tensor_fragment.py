"""`deepspeed.utils.safe_get_full_*` / `safe_set_full_fp32_param`: one parameter's whole fp32 value.

A trainable parameter lives in one bucket of the engine `deepspeed.initialize` built; its
fp32 master, reduced gradient and optimizer states are split over the ranks (stages 1-3).
The getters all-gather that bucket's shards and return the parameter's part, shaped like
the parameter, in fp32 on the host: collectives, so every rank calls them together, as with
DeepSpeed. The gradient is the reduced mean gradient, there between the boundary's
`backward` and `step` (after `step` it is zero). The setter writes the value into the
master shard each rank owns and republishes the bucket's parameters. A frozen parameter
has none of these: the getters return None, as DeepSpeed's.
"""

from __future__ import annotations

import torch

from zeroshard.policies import ConfigError
from zeroshard.stages.state_dict import gather_fp32

__all__ = ["safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
           "safe_get_local_fp32_param", "safe_set_full_fp32_param"]


def _locate(param: torch.Tensor):
    """(zeroshard engine, bucket index, slot) of a trainable parameter; None if frozen."""
    from zeroshard.deepspeed.engine import live_engines

    for shim in live_engines():
        engine = shim.zeroshard
        for b, bucket in enumerate(engine.buckets):
            for s, p in enumerate(bucket.params):
                if p is param:
                    return engine, b, bucket.slots[s]
        if any(p is param for p in engine.module.parameters()):
            return None  # frozen: not optimized, as DeepSpeed's (no fp32 copy, no gradient)
    raise ConfigError("safe_get_full_* / safe_set_full_fp32_param: this parameter belongs to no model given to "
                      "deepspeed.initialize (call them after initialize, with the model's own parameters)")


def _param_part(engine, b: int, slot, shard: torch.Tensor, what: str) -> torch.Tensor:
    if engine.grads.partitioned:
        full = gather_fp32(engine.buckets[b], shard, engine.comm, f"{what} of {slot.name}")
    else:
        full = shard.float()
    return full[slot.offset : slot.end].view(slot.shape).cpu().clone()


def _full(param: torch.Tensor, shard_of, what: str) -> torch.Tensor | None:
    """The parameter's part of the bucket whose shards `shard_of(engine, b)` gives; None if frozen."""
    where = _locate(param)
    if where is None:
        return None
    engine, b, slot = where
    return _param_part(engine, b, slot, shard_of(engine, b), what)


def safe_get_full_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    return _full(param, lambda engine, b: engine.optimizer.master_value(b), "safe_get_full_fp32_param")


def safe_get_full_grad(param: torch.Tensor) -> torch.Tensor | None:
    return _full(param, lambda engine, b: engine.grads.grad_shard(b), "safe_get_full_grad")


def safe_get_full_optimizer_state(param: torch.Tensor, optim_state_key: str) -> torch.Tensor | None:
    """`optim_state_key` as torch names it (Adam: "exp_avg", "exp_avg_sq"); None before the first step."""
    where = _locate(param)
    if where is None:
        return None
    engine, b, slot = where
    try:
        state = engine.optimizer.state_value(b, optim_state_key)
    except KeyError:
        state = None
    present = torch.tensor([0.0 if state is None or not torch.is_tensor(state) or state.numel() == 1 else 1.0])
    if engine.grads.partitioned:  # every rank must agree to gather, or say why not together
        engine.comm.all_reduce(present.to(engine.device), what="safe_get_full_optimizer_state").wait()
    if float(present.sum()) < (engine.world_size if engine.grads.partitioned else 1):
        return None
    return _param_part(engine, b, slot, state, f"safe_get_full_optimizer_state({optim_state_key!r})")


def safe_get_local_fp32_param(param: torch.Tensor) -> torch.Tensor | None:
    """This rank's part of the fp32 master, flat (empty where the rank owns none of it)."""
    where = _locate(param)
    if where is None:
        return None
    engine, b, slot = where
    bucket = engine.buckets[b]
    master = engine.optimizer.master_value(b)
    if not engine.grads.partitioned:
        return master[slot.offset : slot.end].clone()
    lo, _ = bucket.shard_range
    part = bucket.layout.slot_in_shard(slot, bucket.shard_index)
    return master[part[0] - lo : part[1] - lo].clone() if part else master.new_empty(0)


def safe_set_full_fp32_param(param: torch.Tensor, value: torch.Tensor) -> None:
    """Every rank passes the same full `value`; the fp32 master and the parameter take it."""
    where = _locate(param)
    if where is None:
        raise ConfigError("safe_set_full_fp32_param: the parameter is frozen (requires_grad=False); zeroshard "
                          "keeps no fp32 master for it")
    engine, b, slot = where
    if tuple(value.shape) != tuple(slot.shape):
        raise ConfigError(f"safe_set_full_fp32_param({slot.name}): value of shape {tuple(value.shape)}, the "
                          f"parameter is {tuple(slot.shape)}")
    bucket = engine.buckets[b]
    flat = value.detach().reshape(-1).float().to(bucket.device)
    with engine.optimizer.resident(b):
        master = engine.optimizer.masters[b]
        if engine.grads.partitioned:
            lo, _ = bucket.shard_range
            part = bucket.layout.slot_in_shard(slot, bucket.shard_index)
            if part is not None:
                master[part[0] - lo : part[1] - lo].copy_(flat[part[0] - slot.offset : part[1] - slot.offset])
        else:
            master[slot.offset : slot.end].copy_(flat)
        if master.data_ptr() != bucket.shard().data_ptr():
            bucket.write_shard(master)
    engine.params.publish(b)
    engine.params.wait()
