"""One writer per DeepSpeed monitor section. Each takes a list of (name, value, step) events, as
DeepSpeed's `Monitor.write_events` does, and lays its files out as DeepSpeed does:

- csv_monitor: `output_path/job_name/<name with '/' and ' ' as '_'>.csv`, a `step,<last part of
  the name>` header, then `step,value` rows (deepspeed/monitor/csv_monitor.py);
- tensorboard: a `torch.utils.tensorboard.SummaryWriter` in `output_path/job_name`, one scalar per
  event, flushed after each call;
- wandb: `wandb.init(project=, group=, entity=team)` and `wandb.log({name: value}, step=...)`;
  `WANDB_MODE=offline` writes the run under ./wandb with no network;
- comet: `comet_ml.start(...)` with the section's keys (`online: false`: an offline experiment),
  `log_metric(name, value, step=)` every `samples_log_interval` samples per event.
"""

from __future__ import annotations

import csv
import os
from typing import Any, Callable

Event = tuple[str, float, int]


class CsvWriter:
    def __init__(self, options: dict[str, Any]) -> None:
        self.dir = os.path.join(options.get("output_path") or "", options.get("job_name") or "DeepSpeedJobName")
        os.makedirs(self.dir or ".", exist_ok=True)
        self._started: set[str] = set()

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            filename = name.replace("/", "_").replace(" ", "_")
            with open(os.path.join(self.dir, filename + ".csv"), "a+", newline="") as f:
                out = csv.writer(f)
                if filename not in self._started:
                    self._started.add(filename)
                    out.writerow(["step", name.split("/")[-1]])
                out.writerow([step, value])

    def close(self) -> None:
        pass


class TensorBoardWriter:
    def __init__(self, options: dict[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.dir = os.path.join(options.get("output_path") or "", options.get("job_name") or "DeepSpeedJobName")
        os.makedirs(self.dir or ".", exist_ok=True)
        self.writer = SummaryWriter(log_dir=self.dir)

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbWriter:
    def __init__(self, options: dict[str, Any]) -> None:
        import wandb

        self.wandb = wandb
        self.run = wandb.init(project=options.get("project") or "deepspeed", group=options.get("group"),
                              entity=options.get("team"))

    def write(self, events: list[Event]) -> None:
        for step in sorted({s for _, _, s in events}):
            self.run.log({name: value for name, value, s in events if s == step}, step=step)

    def close(self) -> None:
        self.run.finish()


class CometWriter:
    """As DeepSpeed's CometMonitor: an event is sent when `samples_log_interval` samples have
    passed since that event was last sent (and the first time)."""

    def __init__(self, options: dict[str, Any]) -> None:
        import comet_ml

        keys = ("api_key", "project", "workspace", "experiment_key", "mode", "online")
        self.experiment = comet_ml.start(**{k: options.get(k) for k in keys})
        if options.get("experiment_name") is not None:
            self.experiment.set_name(options["experiment_name"])
        self.interval = int(options.get("samples_log_interval") or 100)
        self._last: dict[str, int] = {}

    def write(self, events: list[Event]) -> None:
        for name, value, step in events:
            if name not in self._last or step - self._last[name] >= self.interval:
                self._last[name] = step
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()


WRITERS: dict[str, Callable[[dict[str, Any]], Any]] = {
    "csv_monitor": CsvWriter, "tensorboard": TensorBoardWriter, "wandb": WandbWriter, "comet": CometWriter}
