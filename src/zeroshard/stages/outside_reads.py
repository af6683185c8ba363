"""While a stage-3 forward runs, a parameter read outside its unit's forward (a tied weight, a
module reading another's weight) gets its unit gathered first; `F.linear` on a managed weight
is stage 3's memory-efficient linear (stages/zero_linear.py)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from zeroshard.stages.zero_linear import linear

_ACCESSORS = {"__get__", "__set__", "__delete__"}


class OutsideReads(TorchFunctionMode):
    """While a stage-3 forward runs: any op handed a parameter whose unit is released gets the
    unit gathered first (see `Stage3Runtime.adopt`). One identity lookup per tensor argument.
    `F.linear` on a managed weight is stage 3's linear (stages/zero_linear.py)."""

    def __init__(self, runtime) -> None:  # a Stage3Runtime
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # attribute access (.data, .shape, .grad, ...) reads no values; the runtime's own
        # rebinding of `param.data` passes through here too
        if getattr(func, "__name__", "") in _ACCESSORS:
            return func(*args, **kwargs)
        for arg in (*args, *kwargs.values()):
            for t in arg if isinstance(arg, (list, tuple)) else (arg,):
                if isinstance(t, nn.Parameter) and self.runtime.is_released(t):
                    self.runtime.adopt(t)
        if func is F.linear and self.runtime.policy.memory_efficient_linear:
            out = linear(args, kwargs, self.runtime.manages, self.runtime.gathered_for_backward)
            if out is not None:
                return out
        return func(*args, **kwargs)
