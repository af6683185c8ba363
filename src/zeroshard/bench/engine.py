"""zeroshard's rows of `zeroshard bench`: the engine built from the same DeepSpeed-style
config a user writes (the shared optimizer, no clipping, the system's `zero_optimization`
keys; everything else left to zeroshard's defaults), and its ledgers read for the report.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

import zeroshard
from zeroshard.bench.peers import AdamW
from zeroshard.bench.systems import BenchSystem
from zeroshard.comm import PAPER_FACTOR

__all__ = ["EngineRunner", "bench_config", "unit_numel"]

# what each collective is for, in the step's breakdown: reductions (gradients, the gradient norm,
# qgZ's all-to-all) and gathers (parameters)
_REDUCE = ("reduce_scatter", "all_reduce", "all_to_all")
_GATHER = ("all_gather", "broadcast")


def unit_numel(module: nn.Module, unit_classes: list[str]) -> int:
    """Elements of the largest module of `unit_classes` (a stage-3 unit): what `"{unit}"` means."""
    return max((sum(p.numel() for p in m.parameters()) for m in module.modules()
                if type(m).__name__ in unit_classes), default=0)


def bench_config(system: BenchSystem, micro_batch: int, bf16: bool, unit_classes: list[str],
                 scratch: str, unit: int = 0) -> dict[str, Any]:
    cfg = system.config(micro_batch, scratch, unit, optimizer=AdamW.config())
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if system.stage == 3 and unit_classes:
        cfg["zeroshard"] = {"stage3_unit_classes": list(unit_classes)}
    return cfg


class EngineRunner:
    """Same surface as `bench.peers.PeerRunner` (`phases`: the last step's forward, backward and
    optimizer-step seconds), plus the ledgers and `waits`: the seconds of the last step this
    rank's host was blocked in a collective's wait (the ledger's `waited`), in each phase and by
    kind (exposed reductions and gathers); None where a wait does not block the host (NCCL)."""

    def __init__(self, system: BenchSystem, module: nn.Module, unit_classes: list[str], micro_batch: int,
                 bf16: bool, scratch: str) -> None:
        self.config = bench_config(system, micro_batch, bf16, unit_classes, scratch, unit_numel(module, unit_classes))
        self.engine = zeroshard.initialize(module, self.config)
        self.module = self.engine.module
        self.topology = self.engine.topology
        self.phases = (0.0, 0.0, 0.0)
        self.waits: dict[str, float] | None = None

    def _waited(self) -> tuple[float, float]:
        """(reductions, gathers): seconds blocked in wait() since the engine's ledger was made."""
        life = self.engine.comm.ledger.lifetime()
        return sum(life[op]["waited"] for op in _REDUCE), sum(life[op]["waited"] for op in _GATHER)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        w0, t0 = self._waited(), time.perf_counter()
        loss = self.engine(x, y)[1]
        w1, t1 = self._waited(), time.perf_counter()
        self.engine.backward(loss)
        w2, t2 = self._waited(), time.perf_counter()
        self.engine.step()
        t3, w3 = time.perf_counter(), self._waited()
        self.phases = (t1 - t0, t2 - t1, t3 - t2)
        if self.engine.comm.stream_ordered:
            self.waits = None
        else:
            each = [(b[0] - a[0], b[1] - a[1]) for a, b in ((w0, w1), (w1, w2), (w2, w3))]
            self.waits = {"fwd_wait": sum(each[0]), "bwd_wait": sum(each[1]), "opt_wait": sum(each[2]),
                          "reduce_wait": w3[0] - w0[0], "gather_wait": w3[1] - w0[1]}
        return float(loss.detach().float())

    def start_window(self) -> None:
        """The measured steps start: ledgers count from here."""
        self.engine.reset_comm_stats()
        self.engine.reset_memory_stats()

    def ledgers(self, steps: int) -> dict[str, Any]:
        """comm_stats() per step (the window's totals over `steps`) and memory_stats()."""
        comm = self.engine.comm_stats()
        per_step = {op: {k: v / steps for k, v in s.items()} for op, s in comm.items() if s["calls"]}
        paper = sum(PAPER_FACTOR[op] * s["elements"] for op, s in per_step.items())
        return {"comm_per_step": per_step, "paper_elements_per_step": paper,
                "sent_bytes_per_step": sum(s["sent_bytes"] for s in per_step.values()),
                "memory": self.engine.memory_stats(),
                "trainable": sum(p.numel() for p in self.module.parameters() if p.requires_grad)}

    def model_states(self, x, y) -> dict[str, int]:
        """At rest after the measured steps, from the memory ledger (no extra step)."""
        mem = self.engine.memory_stats()
        return {k: mem[k] for k in ("params", "grads", "optimizer_states")}

    def close(self) -> None:
        self.engine.close()
