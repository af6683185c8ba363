"""`deepspeed.runtime.zero.partition_parameters`, as transformers' ZeRO-3 model loading uses it.

transformers builds a ZeRO-3 model inside `deepspeed.zero.Init(config_dict_or_path=...)`
(here zeroshard.Init: each submodule sharded as it is attached, nothing gathered whole)
and loads weights with `GatheredParameters(params, modifier_rank=0)` one module at a time.
Around the build it swaps `zero_wrapper_for_fp_tensor_constructor` to keep `torch.arange`'s
dtype; zeroshard's Init wraps no tensor constructor (the model is built in the default dtype
and cast by `initialize`), so the swap changes nothing, and the helper here does what
DeepSpeed's does for anyone who calls it.

`ZeroParamStatus` is zeroshard's `ParamStatus` (DeepSpeed's names and values): at stage 3 every
parameter's `ds_status` holds one, kept true by the unit state machine (stages/param_status.py).
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from zeroshard.deepspeed.accelerator import get_accelerator
from zeroshard.deepspeed.zero import GatheredParameters, Init, register_external_parameter
from zeroshard.stages.param_status import ParamStatus as ZeroParamStatus

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "get_accelerator", "register_external_parameter",
           "zero_wrapper_for_fp_tensor_constructor"]

_orig_torch_arange = torch.arange
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full


def zero_wrapper_for_fp_tensor_constructor(fn: Callable, target_fp_dtype: torch.dtype,
                                           target_device: torch.device | None = None) -> Callable:
    """`fn` (a tensor constructor) making its tensor on `target_device` (default: this rank's
    device) and casting a floating result to `target_fp_dtype`, as DeepSpeed's."""

    @functools.wraps(fn)
    def wrapped_fn(*args, **kwargs) -> torch.Tensor:
        if kwargs.get("device") is None:
            kwargs["device"] = target_device or torch.device(get_accelerator().current_device_name())
        tensor = fn(*args, **kwargs)
        return tensor.to(target_fp_dtype) if tensor.is_floating_point() else tensor

    return wrapped_fn
