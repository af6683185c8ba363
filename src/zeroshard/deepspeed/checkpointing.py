"""`deepspeed.checkpointing` over zeroshard's checkpoint function (`zeroshard.checkpoint_activations`).

    deepspeed.checkpointing.configure(None, deepspeed_config="ds.json")   # optional
    x = deepspeed.checkpointing.checkpoint(block, x)

`checkpoint` is DeepSpeed's reentrant activation checkpointing; `non_reentrant_checkpoint` the
non-reentrant one. The kept segment inputs live where the engine's config says
(`activation_checkpointing.cpu_checkpointing: true` -> host memory; `zeroshard.activation_offload`
-> host or NVMe files): `deepspeed.initialize` configures it, as DeepSpeed's engine does.
`configure(checkpoint_in_cpu=True)` moves them to the host too. Model parallelism (`mpu_`) and
`partition_activations` are not supported; `contiguous_checkpointing`, `num_checkpoints`,
`synchronize` and `profile` are accepted and have no effect.
"""

from __future__ import annotations

import dataclasses
import logging

from zeroshard.config import load_config
from zeroshard.deepspeed.config import unsupported
from zeroshard.offload import activations
from zeroshard.policies import ActivationOffloadPolicy, ConfigError, NotSupportedYetError, OffloadDevice

log = logging.getLogger("zeroshard")

__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset"]

_configured = False


def checkpoint(function, *args):
    """DeepSpeed's `checkpoint(function, *args)`: reentrant activation checkpointing."""
    return activations.checkpoint(function, *args, use_reentrant=True)


def non_reentrant_checkpoint(function, *args):
    return activations.checkpoint(function, *args, use_reentrant=False)


def configure(mpu_, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None) -> None:
    """DeepSpeed's signature. `checkpoint_in_cpu` (or the config's `cpu_checkpointing`) keeps the
    checkpointed activations on the host; the rest of DeepSpeed's knobs are accepted with a note."""
    global _configured
    if mpu_ is not None:
        raise ConfigError(unsupported("model parallelism (checkpointing.configure(mpu_=...))"))
    policy = load_config(deepspeed_config, 1).activations if deepspeed_config is not None else None
    if partition_activations:
        raise NotSupportedYetError("checkpointing.configure(partition_activations=True): not supported yet by "
                                   "zeroshard; set it to False")
    if checkpoint_in_cpu:
        policy = ActivationOffloadPolicy(device=OffloadDevice.CPU, why="checkpointing.configure(checkpoint_in_cpu=True)")
    elif checkpoint_in_cpu is False and policy is not None and policy.device == OffloadDevice.CPU:
        policy = dataclasses.replace(policy, device=OffloadDevice.NONE, why="")
    ignored = [n for n, v in (("contiguous_checkpointing", contiguous_checkpointing),
                              ("num_checkpoints", num_checkpoints), ("synchronize", synchronize),
                              ("profile", profile)) if v]
    if ignored:
        log.info("checkpointing.configure: %s have no effect in zeroshard", ", ".join(ignored))
    _configured = True
    if policy is None:
        return
    old = activations.current()
    if old.policy == policy:
        return
    store = activations.ActivationOffload(policy, ledger=old.ledger)  # the engine's ledger, if one configured it
    activations.configure(store)
    log.info("  %s", store.describe())


def is_configured() -> bool:
    return _configured or activations.current() is not activations._DEFAULT


def reset() -> None:
    """DeepSpeed frees its partitioned-activation buffers here; zeroshard keeps none between steps."""
