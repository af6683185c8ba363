"""The Engine's read-only surface for code written for DeepSpeed, DDP or Accelerate: sizes,
ranks, the batch arithmetic, the ledgers, and module pass-throughs. Kept apart so that
api/engine.py reads as the training loop."""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from zeroshard.config.build import TORCH_GRAD_SCALER
from zeroshard.policies import NotSupportedYetError, Precision, Settings

log = logging.getLogger("zeroshard")


class EngineSurface:
    """Mixed into the Engine; reads only `settings`, `topology`, `module`, `comm`, `memory`,
    `optimizer`, `loss_scaler` and the Engine's `_timers` and `_grad_norm`."""

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm of the last step, before clipping (None before any step)."""
        return self._grad_norm

    def gradient_accumulation_steps(self) -> int:
        return self.settings.batch.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.settings.batch.micro_batch_size

    def train_batch_size(self) -> int:
        return self.settings.batch.train_batch_size

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @contextlib.contextmanager
    def no_sync(self):
        """Accepted for code written for DDP or Accelerate, and harmless: the engine already
        reduces only at the accumulation boundary (stages 0/1) or must reduce every micro-step
        to keep gradients sharded (stage 2). Use `gradient_accumulation_steps` instead."""
        if not self._warned_no_sync:
            log.warning("engine.no_sync() does nothing: accumulation follows gradient_accumulation_steps")
            self._warned_no_sync = True
        yield

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    # -- ledgers ------------------------------------------------------------------------------
    def comm_stats(self, by_scope: bool = False) -> dict:
        """Per collective: calls, elements (full logical tensor), bytes (as sent: quantized
        payload + scales where quantized), sent_bytes, seconds (issue to the end of the wait),
        waited (this rank's host blocked in the waits: communication that did not overlap, or a
        slower rank; ~0 on NCCL, whose waits only order the stream). With `by_scope`, the same per
        scope: {"intra_node": {op: ...}, "inter_node": {op: ...}}; a call on a group whose
        ranks all live on one node (LOCAL_WORLD_SIZE consecutive ranks) is intra-node."""
        return self.comm.ledger.stats(by_scope=by_scope)

    def reset_comm_stats(self) -> None:
        self.comm.ledger.reset()

    def memory_stats(self) -> dict[str, int]:
        """Bytes held now by category (params, grads, optimizer_states, comm_buffers), and peak_*."""
        return self.memory.stats()

    def reset_memory_stats(self) -> None:
        self.memory.reset_peaks()

    def timers(self) -> dict[str, float]:
        """Cumulative seconds in forward, backward and step (wall_clock_breakdown)."""
        return dict(self._timers)


def resolve_autocast(settings: Settings, device: torch.device) -> Settings:
    """`torch_autocast` without a dtype runs in torch.autocast's default for `device`."""
    if settings.runtime.autocast != "default":
        return settings
    dtype = str(torch.get_autocast_dtype(device.type)).replace("torch.", "")
    precision = settings.precision
    if dtype == "float16":  # DeepSpeed's GradScaler, as for an explicit float16 (config/build.py)
        if precision.compute != Precision.FP32:
            raise NotSupportedYetError(f"torch_autocast without a dtype runs in float16 on {device.type}, which with "
                                       f"a {precision.compute.value} model is not built: set torch_autocast.dtype to "
                                       "\"bfloat16\", or disable the fp16/bf16 section")
        precision = dataclasses.replace(precision, loss_scale=TORCH_GRAD_SCALER)
    return dataclasses.replace(settings, precision=precision,
                               runtime=dataclasses.replace(settings.runtime, autocast=dtype))


def autocast_forward(dtype_name: str | None, device: torch.device):
    """DeepSpeed's `torch_autocast`: the forward under `torch.autocast` in that dtype (replacing
    an autocast the caller opened, as DeepSpeed's `autocast_if_enabled` does), else nothing."""
    if dtype_name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype_name), enabled=True)


def cast_floats(obj, dtype: torch.dtype):
    """`obj` (tensors, in lists, tuples and dicts) with floating-point tensors cast to `dtype`."""
    if torch.is_tensor(obj):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def needs_grad(obj) -> bool:
    """Whether any tensor in `obj` (in lists, tuples and dicts) requires a gradient."""
    if torch.is_tensor(obj):
        return obj.requires_grad
    if isinstance(obj, (list, tuple)):
        return any(needs_grad(o) for o in obj)
    if isinstance(obj, dict):
        return any(needs_grad(o) for o in obj.values())
    return False
