"""Which hooked modules of a stage-3 model are inside their forward (innermost last), and the
units a forward keeps gathered to the end of the outermost one: a unit several modules read in
one forward (GPT-2's embedding and its tied head) is gathered once per forward, not once per
reader. The stage-3 runtime (stages/stage3.py) decides which units to defer; this only keeps
the stack and says when the outermost forward is over."""

from __future__ import annotations

from typing import Callable

from torch import nn

from zeroshard.stages.hooks import Hooks

__all__ = ["ForwardNesting"]


class ForwardNesting:
    def __init__(self, root: nn.Module | None = None, on_end: Callable[[], None] = lambda: None) -> None:
        self.active: list[nn.Module] = []  # modules in forward, innermost last
        self.deferred: set[int] = set()  # units kept to the end of the outermost forward
        self._root, self._on_end, self._hooks = root, on_end, Hooks()

    def hooked(self, on: bool) -> None:
        """Hooks on the model's own module (while any unit's hooks are attached), so that its
        forward is the outermost one even where it holds no unit (its parameters persistent, or
        none: HF's GPT2LMHeadModel); the deferred units are released when it is over."""
        if not on:
            self._hooks.remove()
        elif self._root is not None and not self._hooks.attached:
            self._hooks.around_forward(self._root, lambda module, args, kwargs: self.enter(module), self._after_root)

    def _after_root(self, module: nn.Module, output) -> None:
        self.leave(module)
        self._on_end()

    def enter(self, module: nn.Module) -> None:
        self.active.append(module)

    def leave(self, module: nn.Module) -> None:
        if self.active and self.active[-1] is module:
            self.active.pop()

    def innermost(self) -> nn.Module | None:
        return self.active[-1] if self.active else None

    def inside(self) -> bool:
        return bool(self.active)

    def ended(self) -> list[int]:
        """The deferred units, once the outermost forward is over (and then forgotten)."""
        if self.active or not self.deferred:
            return []
        done = sorted(self.deferred)
        self.deferred.clear()
        return done
