"""`deepspeed.runtime.zero.parameter_offload.DeepSpeedZeRoOffload`: at stage 3,
`engine.optimizer.parameter_offload`, the surface RLHF libraries drive around generation
(TRL's `unwrap_model_for_generation` removes the stage-3 hooks while the whole model is
gathered, generates, and adds them back).

Names only: what each does is stage 3's runtime's (`engine.stage3`, stages/stage3.py), which
alone knows whether a unit's hooks are attached.

- `module`: the model;
- `forward_hooks` / `backward_hooks`: one handle per unit; `remove()` really detaches the unit's
  module hooks (a forward of its modules then gathers nothing) / the preparation of its backward;
- `param_coordinator.is_invalid_trace()` / `_invalidate_trace()`: the recorded gather order;
- `_register_deepspeed_module(module)` (older name `_register_hooks_recursively`): re-attach the
  hooks of the units inside `module`, and list their handles again; `_remove_module_hooks()`;
- every module of the model gets `ds_external_parameters()`: `(id, parameter)` pairs of the
  parameters of other units its forward reads, as DeepSpeed's.
"""

from __future__ import annotations

import types

from torch import nn

__all__ = ["DeepSpeedZeRoOffload"]


class _Coordinator:
    def __init__(self, runtime) -> None:
        self._runtime = runtime

    def is_invalid_trace(self) -> bool:
        return self._runtime.trace_invalid()

    def _invalidate_trace(self) -> None:
        self._runtime.invalidate_trace()

    def reset_step(self) -> None:
        """DeepSpeed starts each forward's trace position here; zeroshard's engine does it itself."""


class DeepSpeedZeRoOffload:
    def __init__(self, engine) -> None:
        """`engine`: a stage-3 `zeroshard.Engine`."""
        self._runtime = engine.stage3
        self.module = engine.module
        self.param_coordinator = _Coordinator(self._runtime)
        self.forward_hooks: list = []
        self.backward_hooks: list = []
        self._list_handles()
        runtime = self._runtime
        for m in self.module.modules():
            m.ds_external_parameters = types.MethodType(
                lambda mod: [(id(p), p) for p in runtime.external_params(mod)], m)

    def get_param_coordinator(self) -> _Coordinator:
        return self.param_coordinator

    def _list_handles(self) -> None:
        attached = [u for u in self._runtime.units if self._runtime.hooks_attached(u)]
        self.forward_hooks = [self._runtime.hook_handle(u) for u in attached]
        self.backward_hooks = [self._runtime.hook_handle(u, backward=True) for u in attached]

    def _register_deepspeed_module(self, module: nn.Module, count=None) -> None:
        if module is self.module and not self._runtime.trace_invalid():
            self._runtime.invalidate_trace()  # as DeepSpeed: re-registering on the root re-records
        inside = {id(m) for m in module.modules()}
        self._runtime.attach_hooks([u for u in self._runtime.units if id(u.module) in inside])
        self._list_handles()

    _register_hooks_recursively = _register_deepspeed_module

    def _remove_module_hooks(self) -> None:
        for handle in self.forward_hooks + self.backward_hooks:
            handle.remove()
        self.forward_hooks, self.backward_hooks = [], []
