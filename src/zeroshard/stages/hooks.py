"""Every module and autograd hook zeroshard registers, in one place.

Stages 0-3 and `zeroshard.Init` reach torch's hook machinery only through this module, so
what runs when (and what `close()` must undo) can be read here:

- `Hooks.after_grad_accumulated(param, fn)`: `fn(param)` once the parameter's `.grad` for
  this backward is complete (stages 0-3 gradient buckets);
- `Hooks.around_forward(module, before, after)`: `before(module, args, kwargs)` may return
  new `(args, kwargs)`; `after(module, output)` may return a new output (stage-3 gather and
  release);
- `when_grad_reaches(tensors, fn)`: `fn()` when backward first reaches any of `tensors`
  (a stage-3 unit is gathered again for its backward); lives with the autograd graph;
- `after_inputs_grad(tensors, fn)`: identity on `tensors` whose backward calls `fn()` once
  the gradients w.r.t. all of them exist (a stage-3 unit's backward is over);
- `on_module_attached(fn)`: `fn(parent, name, child)` whenever a submodule is attached
  anywhere (global, for `zeroshard.Init`).

Every callback is wrapped in `torch.compiler.disable`: where a caller compiled a module whole
(`module.compile()`, which traces torch's `_call_impl` with its hooks), the gathers, releases,
reductions and ledger bookkeeping run eagerly at a graph break instead of being traced into a
graph. `engine.compile()` compiles only `forward` (api/compiled.py), so no hook is even seen.

Handles are kept by the `Hooks` object that registered them; `remove()` undoes them all.
`Handle` is what other code receives to undo something the runtime decides (a stage-3 unit's
hooks, which DeepSpeed clients remove around generation and add back after).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.nn.modules.module import register_module_module_registration_hook


class Hooks:
    def __init__(self) -> None:
        self._handles: list[Any] = []

    def after_grad_accumulated(self, param: nn.Parameter, fn: Callable[[nn.Parameter], None]) -> None:
        self._handles.append(param.register_post_accumulate_grad_hook(eager(fn)))

    def around_forward(self, module: nn.Module, before: Callable, after: Callable) -> None:
        self._handles.append(module.register_forward_pre_hook(eager(before), with_kwargs=True))
        self._handles.append(module.register_forward_hook(eager(lambda m, args, out: after(m, out))))

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def eager(fn: Callable) -> Callable:
    """`fn`, never traced by torch.compile (run at a graph break where a compiled frame reaches it)."""
    return torch.compiler.disable(fn, recursive=True)


class Handle:
    """`remove()` runs `undo` (once, as torch's RemovableHandle)."""

    def __init__(self, undo: Callable[[], None]) -> None:
        self._undo: Callable[[], None] | None = undo

    def remove(self) -> None:
        if self._undo is not None:
            undo, self._undo = self._undo, None
            undo()


def when_grad_reaches(tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
    torch.autograd.graph.register_multi_grad_hook(tensors, eager(lambda grads: fn()), mode="any")


def after_inputs_grad(tensors: list[torch.Tensor], fn: Callable[[], None]) -> tuple[torch.Tensor, ...]:
    return _InputsGradDone.apply(eager(fn), *tensors)


def on_module_attached(fn: Callable[[nn.Module, str, nn.Module | None], None]):
    """A global hook; the caller keeps the handle and removes it."""
    return register_module_module_registration_hook(fn)


class _InputsGradDone(torch.autograd.Function):
    """Identity on some tensors; its backward runs once their gradients are complete."""

    @staticmethod
    def forward(ctx, fn, *tensors):
        ctx.fn = fn
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        ctx.fn()
        return (None, *grads)


def tensors_in(obj):
    """The tensors in a module's output (nested lists, tuples and dicts)."""
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from tensors_in(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from tensors_in(o)
