"""Which hooked modules of a stage-3 model are inside their forward (innermost last), and the
units a forward keeps gathered to the end of the outermost one: a unit several modules read in
one forward (GPT-2's embedding and its tied head) is gathered once per forward, not once per
reader. The stage-3 runtime (stages/stage3.py) decides which units to defer; this only keeps
the stack and says when the outermost forward is over."""

from __future__ import annotations

from torch import nn

__all__ = ["ForwardNesting"]


class ForwardNesting:
    def __init__(self) -> None:
        self.active: list[nn.Module] = []  # modules in forward, innermost last
        self.deferred: set[int] = set()  # units kept to the end of the outermost forward

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
