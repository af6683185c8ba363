"""`engine.offload_states()` / `reload_states()`: DeepSpeed 0.19.8's way to free an engine's
device memory between phases of an RLHF loop (OpenRLHF moves the policy's optimizer states off
the GPU while it generates, then back).

The state kinds are DeepSpeed's `OffloadStateTypeEnum`, mapped onto zeroshard's runtime:

    optim_states            the torch optimizer's states over the fp32 master shards
    hp_params               the fp32 masters, where they are separate from the parameters
                            (bf16 / fp16 training; in fp32 the master is the shard itself)
    lp_params               the parameters' storage: each bucket's full buffer below stage 3,
                            this rank's shards at stage 3 (gathered units released first)
    lp_grads                the gradient buffers kept between steps (the full buffers at stages
                            0-1, the shard accumulators at stages 2-3)
    contiguous_grad_buffer  the reusable reduce and gather buffers (freed, not restored: DeepSpeed
                            does not restore them either)

Each storage is parked in host memory and freed (offload/parking.py) and comes back bit for
bit with `reload_states()`. While states are offloaded, a forward (parameters parked), a backward
(parameters or gradients) or a step (any) refuses with one line naming `reload_states()`. As in DeepSpeed: only the cpu device, not with
`offload_param` (its shards live off the device already), not for an engine without an
optimizer; with `offload_optimizer` the states and masters are on the host already and are
left out of `include`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from zeroshard.offload.parking import ParkedStorages
from zeroshard.policies import ConfigError

__all__ = ["KINDS", "EngineStates"]

KINDS = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")
# where the memory ledger counts each kind: while parked, its bytes move from the device tier to the host
_CATEGORY = {"optim_states": "optimizer_states", "hp_params": "optimizer_states", "lp_params": "params",
             "lp_grads": "grads"}


def _name(kind: Any) -> str:
    name = str(getattr(kind, "value", kind))
    if name not in KINDS:
        raise ConfigError(f"offload_states: unknown state {name!r}; the states are {', '.join(KINDS)} "
                          "(deepspeed.runtime.zero.offload_config.OffloadStateTypeEnum)")
    return name


class EngineStates:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.parked = ParkedStorages()
        self.kinds: set[str] = set()  # the kinds offloaded now

    def _tensors(self, kind: str) -> Iterable[torch.Tensor]:
        e = self.engine
        opt = e.optimizer
        if kind == "optim_states":
            for state in opt.optimizer.state.values():
                yield from (v for v in state.values() if torch.is_tensor(v) and v.numel() > 1)
        elif kind == "hp_params":
            yield from (m for m, separate in zip(opt.masters, opt._separate) if separate)
        elif kind == "lp_params":
            for bucket in (*e.buckets, *e.frozen_buckets):
                yield bucket.shard()
        elif kind == "lp_grads":
            yield from getattr(e.grads, "grads", [])
            yield from getattr(e.grads, "shards", [])

    def offload(self, include, device, pin_memory: bool, non_blocking: bool) -> None:
        e = self.engine
        device = str(getattr(device, "value", device))
        if e.inference_only:
            raise ConfigError("offload_states: this engine has no optimizer, so it has no states to move (as in "
                              "DeepSpeed); give initialize() an optimizer")
        if device == "none":
            return
        if device != "cpu":
            raise ConfigError(f"offload_states(device={device!r}): only the cpu device is served, as in DeepSpeed")
        zero = e.settings.zero
        if zero.offload_param.device.value != "none":
            raise ConfigError("offload_states: the parameters are offloaded already (offload_param); as in DeepSpeed, "
                              "moving states across devices is not supported then")
        kinds = [_name(k) for k in (KINDS if include is None else include)]
        if zero.offload_optimizer.device.value != "none":  # DeepSpeed's _refine_include_states
            kinds = [k for k in kinds if k not in ("hp_params", "optim_states")]
        e.empty_partition_cache()  # gathered units released; reusable buffers freed
        for kind in kinds:
            if kind not in self.kinds and kind != "contiguous_grad_buffer":
                nbytes = self.parked.park(self._tensors(kind), pin_memory, non_blocking)
                e.memory.hold(_CATEGORY[kind], f"offloaded.{kind}", -nbytes)  # off the device tier
                e.memory.hold(_CATEGORY[kind], f"offloaded.{kind}.host", nbytes, tier="host")
            self.kinds.add(kind)

    def reload(self, non_blocking: bool) -> None:
        self.parked.unpark(non_blocking)
        for kind in self.kinds - {"contiguous_grad_buffer"}:
            self.engine.memory.release(_CATEGORY[kind], f"offloaded.{kind}")
            self.engine.memory.release(_CATEGORY[kind], f"offloaded.{kind}.host")
        self.kinds.clear()

    # what each call reads: a forward the parameters, a backward the gradient buffers too, a step all
    _NEEDS = {"forward": {"lp_params"}, "backward": {"lp_params", "lp_grads"},
              "step": {"lp_params", "lp_grads", "hp_params", "optim_states"}}

    def check(self, what: str) -> None:
        """Refuse `what` (forward, backward, step) while states it reads are parked."""
        parked = self._NEEDS[what] & self.kinds
        if parked:
            raise ConfigError(f"{what} while the engine's states are offloaded ({', '.join(sorted(parked))}): "
                              "call engine.reload_states() first")
