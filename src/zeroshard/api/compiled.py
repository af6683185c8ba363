"""`engine.compile()`: each unit (stage 3) or each repeated block (stages 0-2) compiled in place.

Only a region's `forward` is replaced by its `torch.compile`d self, so `Module.__call__` (torch's
`_call_impl`) stays eager: stage 3's gather / release / prefetch hooks, the backward
bookkeeping on the region's inputs and outputs, and the gradient hooks (post-accumulate-grad,
run by autograd's eager AccumulateGrad) never enter a graph. A region is compiled only when no
module strictly inside it carries zeroshard's hooks (stage 3's root unit, which holds the blocks,
stays eager). Stage 3's torch-function mode (stages/outside_reads.py: reads of a released
parameter) is suspended while a compiled region runs: the region's own unit is gathered by then.

Guards relied on for 0 recompiles after the first step: each region's parameters are the same
Parameter objects every step (stage 3 swaps their `.data`, never the object), with the same
shape, dtype and (gathered, contiguous) strides when the region runs; the inputs' shapes and
dtypes; the grad mode and `module.training`, each cached as its own entry (so train / eval /
no_grad switches compile once each, then hit the cache). Data pointers are not guarded.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

import torch
from torch import nn

from zeroshard.policies import ConfigError

log = logging.getLogger("zeroshard")


class CompiledRegions:
    """What `Engine.compile` did: the regions, their graph breaks, the first compiled step's time."""

    def __init__(self, backend: Any, kwargs: dict) -> None:
        self.backend, self.kwargs = backend, kwargs
        self.names: list[str] = []
        self.skipped: list[str] = []
        self.breaks: dict[str, list[str]] = {}  # region -> dynamo's graph-break reasons
        self.first_step_s: float | None = None
        self._step_started: float | None = None

    def step_begins(self) -> None:
        if self.first_step_s is None and self._step_started is None:
            self._step_started = time.perf_counter()

    def step_ends(self) -> None:
        if self.first_step_s is None and self._step_started is not None:
            self.first_step_s = time.perf_counter() - self._step_started
            log.info("compile: first step %.2fs with compilation (%d region(s), backend %s)",
                     self.first_step_s, len(self.names), _backend_name(self.backend))

    def describe(self) -> str:
        first = "" if self.first_step_s is None else f", first step {self.first_step_s:.2f}s"
        return f"compile: {len(self.names)} region(s) compiled in place, backend {_backend_name(self.backend)}{first}"


def _backend_name(backend) -> str:
    return backend if isinstance(backend, str) else getattr(backend, "__name__", type(backend).__name__)


def regions_of(module: nn.Module, stage3) -> tuple[list[tuple[str, nn.Module]], list[str]]:
    """(name, module) of the regions to compile, and the names passed over with why."""
    names = {id(m): n for n, m in module.named_modules()}
    if stage3 is not None and stage3.units:  # (a model whose parameters are all persistent has no units)
        hooked = stage3.hooked_modules()
        candidates = [u.module for u in stage3.units]
    else:
        from zeroshard.stages.units import repeated_blocks

        hooked = set()
        candidates = repeated_blocks(module) or [module]
    chosen, skipped = [], []
    for m in candidates:
        inner = [names.get(id(s), "?") for s in m.modules() if s is not m and id(s) in hooked]
        if inner:
            skipped.append(f"{names.get(id(m)) or '<root>'} (holds hooked modules {', '.join(inner[:3])})")
        else:
            chosen.append((names.get(id(m)) or "<root>", m))
    return chosen, skipped


def compile_regions(module: nn.Module, stage3, backend, compile_kwargs: dict | None) -> CompiledRegions:
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        log.warning("compile: `backend` in compile_kwargs is overridden by the backend argument")
        kwargs.pop("backend")
    backend = backend or "inductor"
    report = CompiledRegions(backend, kwargs)
    chosen, report.skipped = regions_of(module, stage3)
    if not chosen:
        raise ConfigError("engine.compile(): no region of this model can be compiled with zeroshard's hooks "
                          f"outside the graph ({'; '.join(report.skipped)}); leave compilation off")
    for name, m in chosen:
        _compile_forward(name, m, backend, kwargs, report, suspend_modes=stage3 is not None)
        report.names.append(name)
    for s in report.skipped:
        log.info("compile: %s stays eager", s)
    return report


def _compile_forward(name: str, module: nn.Module, backend, kwargs: dict, report: CompiledRegions,
                     suspend_modes: bool) -> None:
    eager = module.forward
    _wrap_forward(name, module, torch.compile(eager, backend=backend, **kwargs), eager, report, suspend_modes)


def _wrap_forward(name: str, module: nn.Module, compiled, eager, report: CompiledRegions,
                  suspend_modes: bool) -> None:
    counters = torch._dynamo.utils.counters  # dynamo's own tally of graph breaks, by reason
    seen = [False]

    @functools.wraps(eager)
    def forward(*args, **kw):
        if torch.compiler.is_compiling():  # inside a caller's own compiled graph: trace the plain forward
            return eager(*args, **kw)
        before = dict(counters["graph_break"]) if not seen[0] else None
        if suspend_modes:
            with torch._C.DisableTorchFunction():
                out = compiled(*args, **kw)
        else:
            out = compiled(*args, **kw)
        if before is not None:
            seen[0] = True
            new = [r for r, n in counters["graph_break"].items() if n > before.get(r, 0)]
            if new:
                report.breaks[name] = new
                log.warning("compile: %s (%s) breaks its graph %d time(s): %s", name, type(module).__name__,
                            len(new), "; ".join(r.splitlines()[0][:200] for r in new[:3]))
        return out

    forward.__zeroshard_eager__ = eager
    module.forward = forward


def take_over_module_compiles(stage3) -> list[str]:
    """Stage 3: a unit's module compiled whole after `initialize` (`module.compile()`, as
    Accelerate's regional compilation does) would trace torch's `_call_impl` with the unit's
    hooks (run eagerly at graph breaks, stages/hooks.py). Take its compile context (same backend
    and options) and compile only its `forward` instead: 0 breaks. Names of the modules taken over."""
    from torch._dynamo.eval_frame import _TorchDynamoContext

    taken = []
    for unit in stage3.units:
        m = unit.module
        impl = getattr(m, "_compiled_call_impl", None)
        if impl is None:
            continue
        if hasattr(m.__dict__.get("forward"), "__zeroshard_eager__"):  # engine.compile() did: its forward is compiled
            m._compiled_call_impl = None
            continue
        context = next((c.cell_contents for c in impl.__closure__ or ()
                        if isinstance(c.cell_contents, _TorchDynamoContext)), None)
        if context is None:  # another torch: leave it compiled whole (correct, with graph breaks)
            continue
        m._compiled_call_impl = None
        _wrap_forward(unit.label, m, context(m.forward), m.forward, CompiledRegions("module.compile", {}), True)
        taken.append(unit.label)
    if taken:
        log.info("compile: %d stage-3 unit(s) compiled whole (module.compile) now compile their forward only, "
                 "zeroshard's hooks outside the graph: %s", len(taken), ", ".join(taken[:4]))
    return taken


def uncompile(module: nn.Module) -> None:
    """Give every compiled region its eager forward back."""
    for m in module.modules():
        eager = getattr(m.__dict__.get("forward"), "__zeroshard_eager__", None)
        if eager is not None:
            del m.forward
