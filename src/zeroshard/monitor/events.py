"""The events rank 0 writes after each optimizer step, keyed by samples seen (DeepSpeed's
`global_samples`: steps x train_batch_size):

- DeepSpeed's: `Train/Samples/train_loss` (rank 0's loss, averaged over the accumulation window:
  no collective is added), `Train/Samples/lr`, `Train/Samples/loss_scale` under fp16, and with
  `wall_clock_breakdown` `Train/Samples/elapsed_time_ms_{forward,backward,step}` (this step's)
  and `..._backward_allreduce` (this step's seconds in gradient reductions, from the ledger);
- zeroshard's own: `Train/Samples/comm_sent_bytes/<collective>` (bytes this rank put on the wire
  in the step, from the traffic ledger), `Train/Samples/memory_bytes/<category>` (model states
  held now and their peaks, from the memory ledger), and with NVMe offload
  `Train/Samples/nvme_{read,write}_MBps` (the optimizer's swap I/O over the step).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from zeroshard.monitor.writers import WRITERS, Event

log = logging.getLogger("zeroshard")
EVENT_PREFIX = "Train/Samples/"
_REDUCE = ("reduce_scatter", "all_reduce", "reduce", "all_to_all")  # the gradient reductions (qgZ: all-to-all)
_MEMORY = ("params", "grads", "optimizer_states", "comm_buffers", "peak_params", "peak_grads",
           "peak_optimizer_states", "peak_comm_buffers")


class Monitors:
    """The writers of the enabled monitor sections (none on ranks other than 0)."""

    def __init__(self, writers: list[Any]) -> None:
        self.writers = writers
        self._loss_sum: torch.Tensor | None = None
        self._losses = 0
        self._last_timers: dict[str, float] = {}
        self._last_sent: dict[str, int] = {}
        self._last_reduce = 0.0
        self._last_io: tuple[float, int, int] | None = None  # (time, NVMe bytes read, written)

    def __bool__(self) -> bool:
        return bool(self.writers)

    def saw_loss(self, loss: torch.Tensor) -> None:
        """A micro-step's loss (summed without a sync; read once per optimizer step)."""
        value = loss.detach().double().mean()
        self._loss_sum = value if self._loss_sum is None else self._loss_sum + value
        self._losses += 1

    def events(self, engine) -> list[Event]:
        samples = engine.global_steps * engine.settings.batch.train_batch_size
        events: list[Event] = []
        if self._losses:
            events.append(("train_loss", float(self._loss_sum) / self._losses, samples))
            self._loss_sum, self._losses = None, 0
        events.append(("lr", float(engine.get_lr()[0]), samples))
        if engine.settings.precision.loss_scale is not None:
            events.append(("loss_scale", float(engine.loss_scale), samples))
        if engine.settings.wall_clock_breakdown:
            now = engine.timers()
            for phase in ("forward", "backward", "step"):
                ms = (now.get(phase, 0.0) - self._last_timers.get(phase, 0.0)) * 1000.0
                events.append((f"elapsed_time_ms_{phase}", ms, samples))
            self._last_timers = now
        lifetime = engine.comm.ledger.lifetime()  # not comm_stats(): a training loop may reset those
        for op, stats in lifetime.items():
            sent = int(stats["sent_bytes"])
            if sent != self._last_sent.get(op, 0):
                events.append((f"comm_sent_bytes/{op}", float(sent - self._last_sent.get(op, 0)), samples))
            self._last_sent[op] = sent
        if engine.settings.wall_clock_breakdown:  # DeepSpeed's name for the time in gradient reduction
            reduce = sum(lifetime[op]["seconds"] for op in _REDUCE if op in lifetime)
            events.append(("elapsed_time_ms_backward_allreduce", (reduce - self._last_reduce) * 1000.0, samples))
            self._last_reduce = reduce
        memory = engine.memory_stats()
        events += [(f"memory_bytes/{k}", float(memory[k]), samples) for k in _MEMORY if k in memory]
        events += self._nvme_rates(engine, samples)
        return [(EVENT_PREFIX + name, value, step) for name, value, step in events]

    def _nvme_rates(self, engine, samples: int) -> list[Event]:
        """The NVMe tiers' read and write rates (MB/s) since the last step, where any tier is on NVMe."""
        tiers = [*getattr(engine.optimizer, "tiers", []), *engine.param_tiers]
        ios = {id(t.io): t.io for t in tiers if getattr(t, "io", None) is not None}
        if not ios:
            return []
        now = (time.perf_counter(), sum(io.bytes_read for io in ios.values()),
               sum(io.bytes_written for io in ios.values()))
        last, self._last_io = self._last_io, now
        if last is None or now[0] <= last[0]:
            return []
        seconds = now[0] - last[0]
        return [("nvme_read_MBps", (now[1] - last[1]) / seconds / 1e6, samples),
                ("nvme_write_MBps", (now[2] - last[2]) / seconds / 1e6, samples)]

    def after_step(self, engine) -> None:
        if self.writers:
            events = self.events(engine)
            for writer in self.writers:
                writer.write(events)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
        self.writers = []


def open_monitors(sections: tuple, rank: int) -> Monitors:
    """Rank 0's writers for the enabled `(section, options)` pairs; none elsewhere."""
    if rank != 0:
        return Monitors([])
    writers = []
    for section, options in sections:
        writers.append(WRITERS[section](dict(options)))
        log.info("  monitor: %s -> %s", section, getattr(writers[-1], "dir", section))
    return Monitors(writers)
