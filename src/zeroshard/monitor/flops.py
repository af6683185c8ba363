"""DeepSpeed's `flops_profiler` section: a per-module profile of one training step (issue 45).

At optimizer step `profile_step` (DeepSpeed's meaning: the step whose `global_steps` equals it)
rank 0 counts FLOPs with `torch.utils.flop_counter.FlopCounterMode` from the first forward of
the step to its optimizer step (forward and backward), times each module's forward with hooks,
and prints a table to the log or `output_file`:

- per module, down to `module_depth` (-1: every depth), the `top_modules` largest by FLOPs at
  each depth (`detailed: false`: depth 1 only): parameters (the full counts, not stage 3's
  shards), forward and backward FLOPs, forward time and its FLOP/s;
- the whole step: FLOPs, time, achieved FLOP/s, and the check against 6 x Φ x tokens.

The CPU's fused attention (`_scaled_dot_product_flash_attention_for_cpu` and its backward)
is counted with torch's SDPA formula; torch's counter leaves it out. Causal masking is not
discounted (as torch's and DeepSpeed's counters do not). Collectives, gathers and the optimizer
cost time but no FLOPs here.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.utils import flop_counter

log = logging.getLogger("zeroshard")
aten = torch.ops.aten


def _register_cpu_attention() -> None:
    """The CPU flash-attention ops, with torch's own SDPA formulas (once)."""
    forward = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if forward is None or forward in flop_counter.flop_registry:
        return

    @flop_counter.register_flop_formula(forward)
    def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    @flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


class FlopsProfiler:
    """Profiles one optimizer step of `module` (rank 0 only); `full_numel`: parameter name ->
    its full element count (stage 3 holds shards)."""

    def __init__(self, options: dict[str, Any], module: nn.Module, full_numel: dict[str, int]) -> None:
        self.profile_step = int(options.get("profile_step", 1))
        self.depth = int(options.get("module_depth", -1))
        self.top = int(options.get("top_modules", 1))
        self.detailed = bool(options.get("detailed", True))
        self.output_file = options.get("output_file")
        self.module, self.full_numel = module, full_numel
        self._counter: flop_counter.FlopCounterMode | None = None
        self._hooks: list[Any] = []
        self._fwd_seconds: dict[str, float] = defaultdict(float)
        self._fwd_flops: dict[str, int] = {}
        self._started = 0.0
        self._tokens = 0
        self._before_forward: dict[str, int] = {}
        self.report: dict[str, Any] | None = None  # the last profile, for tests and monitors
        _register_cpu_attention()

    @property
    def active(self) -> bool:
        return self._counter is not None

    def begin_forward(self, global_steps: int, args: tuple, kwargs: dict) -> None:
        """Before each forward: the profile starts at the first one of step `profile_step`;
        while it runs, the tokens (elements of the integer inputs) are counted."""
        if self._counter is None and self.report is None and global_steps == self.profile_step:
            self._counter = flop_counter.FlopCounterMode(display=False, depth=None)
            self._counter.__enter__()
            self._attach_timers()
            self._started = time.perf_counter()
        if self._counter is not None:
            ids = [t for t in (*args, *kwargs.values()) if torch.is_tensor(t) and not t.is_floating_point()]
            self._tokens += ids[0].numel() if ids else 0
            self._before_forward = self._totals()

    def end_forward(self) -> None:
        """After each forward of the profiled step: its FLOPs, by module, are forward FLOPs."""
        if self._counter is not None:
            for key, flops in self._totals().items():
                self._fwd_flops[key] = self._fwd_flops.get(key, 0) + flops - self._before_forward.get(key, 0)

    def _totals(self) -> dict[str, int]:
        return {k: sum(v.values()) for k, v in self._counter.get_flop_counts().items()}

    def finish(self, engine) -> None:
        """At the optimizer step that closes the profiled step: build and print the report."""
        if self._counter is None:
            return
        seconds = time.perf_counter() - self._started
        self._counter.__exit__(None, None, None)
        for h in self._hooks:
            h.remove()
        counts = self._totals()
        self._counter = None
        self.report = self._build(counts, seconds, engine)
        text = format_report(self.report)
        if self.output_file:
            with open(self.output_file, "w") as f:
                f.write(text + "\n")
            log.info("flops profiler: step %d written to %s", self.profile_step, self.output_file)
        else:
            for line in text.splitlines():
                log.info(line)

    def _attach_timers(self) -> None:
        root = type(self.module).__name__
        for name, sub in self.module.named_modules():
            key = f"{root}.{name}" if name else root
            started: list[float] = []
            self._hooks.append(sub.register_forward_pre_hook(lambda m, a, s=started: s.append(time.perf_counter())))
            self._hooks.append(sub.register_forward_hook(
                lambda m, a, o, s=started, k=key: self._fwd_seconds.__setitem__(
                    k, self._fwd_seconds[k] + time.perf_counter() - s.pop()) if s else None))

    def _params(self) -> dict[str, int]:
        """Full parameter counts by module key ("GPT.h.0.attn"), from the layout's names."""
        root = type(self.module).__name__
        out: dict[str, int] = defaultdict(int)
        for name, numel in self.full_numel.items():
            parts = name.split(".")[:-1]
            out[root] += numel
            for i in range(1, len(parts) + 1):
                out[".".join([root, *parts[:i]])] += numel
        return out

    def _build(self, counts: dict[str, int], seconds: float, engine) -> dict[str, Any]:
        params, root = self._params(), type(self.module).__name__
        total = counts.get("Global", 0)
        fwd_total = self._fwd_flops.get("Global", 0)
        tokens = self._tokens * engine.world_size  # every rank's micro-batches: the step's tokens
        rows = []
        for key, flops in counts.items():
            if key == "Global":
                continue
            depth = key.count(".")
            fwd = self._fwd_flops.get(key, 0)
            rows.append({"module": key, "depth": depth, "params": params.get(key, 0), "flops": flops,
                         "fwd_flops": fwd, "bwd_flops": flops - fwd, "fwd_seconds": self._fwd_seconds.get(key, 0.0)})
        trainable = sum(self.full_numel.values())
        # FLOPs are rank 0's (its micro-batches); 6 x params x tokens is taken over the same tokens
        return {"step": self.profile_step, "world_size": engine.world_size, "params": params.get(root, trainable),
                "flops": total, "fwd_flops": fwd_total, "bwd_flops": total - fwd_total, "seconds": seconds,
                "tokens": self._tokens, "six_phi_tokens": 6 * params.get(root, trainable) * self._tokens,
                "step_tokens": tokens, "rows": self._select(rows)}

    def _select(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        deepest = 1 if not self.detailed else (self.depth if self.depth >= 0 else max((r["depth"] for r in rows),
                                                                                      default=0))
        keep = []
        for d in range(0, deepest + 1):
            level = sorted((r for r in rows if r["depth"] == d), key=lambda r: -r["flops"])
            keep += level[: self.top] if d > 0 else level
        return keep


def format_report(r: dict[str, Any]) -> str:
    rate = r["flops"] / r["seconds"] if r["seconds"] > 0 else 0.0
    ratio = r["flops"] / r["six_phi_tokens"] if r["six_phi_tokens"] else float("nan")
    lines = [
        f"flops profiler: step {r['step']} on rank 0 of {r['world_size']}",
        f"  parameters {r['params']:,}; FLOPs fwd {r['fwd_flops']:,} + bwd {r['bwd_flops']:,} = {r['flops']:,}"
        f" in {r['seconds']:.3f} s: {rate / 1e9:.3g} GFLOP/s achieved",
        f"  6 x params x tokens ({r['tokens']:,} tokens) = {r['six_phi_tokens']:,}: counted / that = {ratio:.3f}"
        " (above 1: attention; below: embeddings, which cost no FLOPs)",
        f"  {'module':<40} {'params':>12} {'fwd FLOPs':>14} {'bwd FLOPs':>14} {'fwd ms':>9} {'fwd GFLOP/s':>11}",
    ]
    for row in r["rows"]:
        ms = row["fwd_seconds"] * 1000
        gflops = row["fwd_flops"] / row["fwd_seconds"] / 1e9 if row["fwd_seconds"] > 0 else 0.0
        name = "  " * row["depth"] + row["module"]
        lines.append(f"  {name:<40} {row['params']:>12,} {row['fwd_flops']:>14,} {row['bwd_flops']:>14,} "
                     f"{ms:>9.2f} {gflops:>11.3g}")
    return "\n".join(lines)


def open_flops_profiler(options: dict[str, Any] | None, module: nn.Module, layouts, rank: int) -> FlopsProfiler | None:
    """Rank 0's profiler when the `flops_profiler` section is enabled; `layouts`: the buckets'
    layouts (trainable and frozen), whose slots give each parameter's full size."""
    if rank != 0 or not options or not options.get("enabled"):
        return None
    full = {slot.name: slot.numel for layout in layouts for slot in layout.slots}
    return FlopsProfiler(options, module, full)
