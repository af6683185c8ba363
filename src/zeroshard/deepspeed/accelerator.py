"""`deepspeed.accelerator.get_accelerator()`: the device this rank trains on, as DeepSpeed names it.

One object for the two kinds of device zeroshard runs on: a CUDA device (NCCL) when torch
sees one, else the CPU (gloo), chosen as zeroshard's process group chooses. Each method
does what DeepSpeed's CUDA or CPU accelerator does: on CUDA the `torch.cuda` call, on the
CPU DeepSpeed's CPU meaning (device name "cpu", current device = LOCAL_RANK, memory queries
= this process's resident memory, pin_memory returns the tensor as it is). Building ops
(`create_op_builder`) is not served: zeroshard compiles nothing.
"""

from __future__ import annotations

import contextlib
import os
import resource

import torch

from zeroshard.policies import ConfigError

__all__ = ["get_accelerator", "is_current_accelerator_supported", "set_accelerator"]


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak, where /proc is absent


def _meminfo(key: str) -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {key}")


class ZeroshardAccelerator:
    """DeepSpeed's accelerator interface over torch.cuda, or over the host for CPU training."""

    def __init__(self) -> None:
        self._cuda = torch.cuda.is_available()
        self._name = "cuda" if self._cuda else "cpu"
        self._max_rss = _rss_bytes()

    # -- what the device is ---------------------------------------------------------------
    def is_available(self) -> bool:
        return not self._cuda or torch.cuda.is_available()

    def is_synchronized_device(self) -> bool:
        return not self._cuda

    use_host_timers = resolves_data_dependency = handles_memory_backpressure = is_synchronized_device

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def device_name(self, device_index: int | None = None) -> str:
        return f"cuda:{device_index}" if self._cuda and device_index is not None else self._name

    def device(self, device_index: int | None = None):
        return torch.cuda.device(device_index) if self._cuda else None

    def set_device(self, device_index) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else int(os.environ.get("LOCAL_RANK", "0"))

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def device_count(self) -> int:
        local = os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1"))
        return torch.cuda.device_count() if self._cuda else int(local)

    def synchronize(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._name

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True if self._cuda else bool(torch.backends.mkldnn.is_available())

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float] + [torch.bfloat16] * self.is_bf16_supported() + [torch.float16] * self.is_fp16_supported()

    def is_triton_supported(self) -> bool:
        return False

    def get_compile_backend(self) -> str:
        return "inductor"

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"] if self._cuda else []

    # -- random numbers --------------------------------------------------------------------
    def random(self):
        return torch.random

    def manual_seed(self, seed: int):
        return torch.cuda.manual_seed(seed) if self._cuda else torch.manual_seed(seed)

    def manual_seed_all(self, seed: int):
        return torch.cuda.manual_seed_all(seed) if self._cuda else torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed() if self._cuda else torch.initial_seed()

    def get_rng_state(self, device_index=None) -> torch.Tensor:
        return torch.cuda.get_rng_state(device_index or "cuda") if self._cuda else torch.get_rng_state()

    def set_rng_state(self, new_state: torch.Tensor, device_index=None) -> None:
        if self._cuda:
            torch.cuda.set_rng_state(new_state, device_index or "cuda")
        else:
            torch.set_rng_state(new_state)

    def default_generator(self, device_index: int):
        return torch.cuda.default_generators[device_index] if self._cuda else torch.default_generator

    # -- memory ------------------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **kwargs) -> torch.Tensor:
        return tensor.pin_memory() if self._cuda else tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if self._cuda else False

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def _rss(self) -> int:
        now = _rss_bytes()
        self._max_rss = max(self._max_rss, now)
        return now

    def memory_allocated(self, device_index=None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else self._rss()

    def max_memory_allocated(self, device_index=None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else max(self._max_rss, self._rss())

    def reset_max_memory_allocated(self, device_index=None) -> None:
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)
        else:
            self._max_rss = _rss_bytes()

    reset_peak_memory_stats = reset_max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_reserved(self, device_index=None) -> int:
        return torch.cuda.memory_reserved(device_index) if self._cuda else self._rss()

    memory_cached = memory_reserved

    def max_memory_reserved(self, device_index=None) -> int:
        return torch.cuda.max_memory_reserved(device_index) if self._cuda else self.max_memory_allocated()

    max_memory_cached = max_memory_reserved

    def memory_stats(self, device_index=None) -> dict:
        if self._cuda:
            return torch.cuda.memory_stats(device_index)
        return {"allocated_bytes.all.current": self._rss(), "allocated_bytes.all.peak": self._max_rss}

    def total_memory(self, device_index=None) -> int:
        if self._cuda:
            return torch.cuda.get_device_properties(device_index or 0).total_memory
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def available_memory(self, device_index=None) -> int:
        return torch.cuda.mem_get_info(device_index)[0] if self._cuda else _meminfo("MemAvailable")

    # -- streams and events ----------------------------------------------------------------------
    @property
    def Stream(self):
        return torch.cuda.Stream if self._cuda else None

    def stream(self, stream):
        return torch.cuda.stream(stream) if self._cuda else contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index) if self._cuda else None

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index) if self._cuda else None

    @property
    def Event(self):
        return torch.cuda.Event if self._cuda else None

    def range_push(self, msg: str, *args) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_push(msg)

    def range_pop(self, *args) -> None:
        if self._cuda:
            torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return torch.cuda._lazy_call(callback) if self._cuda else callback()

    # -- not served ----------------------------------------------------------------------------
    def create_op_builder(self, op_name: str):
        raise ConfigError(f"get_accelerator().create_op_builder({op_name!r}) is not served by zeroshard: it "
                          "compiles no DeepSpeed ops; use deepspeed.ops.adam.DeepSpeedCPUAdam / FusedAdam (torch's "
                          "fused Adam kernels) or a torch.optim optimizer")

    get_op_builder = create_op_builder


_ACCELERATOR: ZeroshardAccelerator | None = None


def get_accelerator() -> ZeroshardAccelerator:
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = ZeroshardAccelerator()
    return _ACCELERATOR


def set_accelerator(accel_obj) -> None:
    raise ConfigError("deepspeed.accelerator.set_accelerator() is not served by zeroshard: the accelerator is "
                      "CUDA when torch sees a device, else the CPU")


def is_current_accelerator_supported() -> bool:
    return True
