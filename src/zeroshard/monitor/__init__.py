"""DeepSpeed's monitors (`tensorboard`, `csv_monitor`, `wandb`, `comet` config sections): rank 0
writes scalar events keyed by samples seen, as DeepSpeed does, plus zeroshard's own (traffic by
collective, memory by category, NVMe I/O). Each writer's library is an optional extra; a section
enabled without it fails when the config loads (config/support.py), not mid-run."""

from zeroshard.monitor.events import EVENT_PREFIX, Monitors, open_monitors
from zeroshard.monitor.writers import WRITERS

__all__ = ["EVENT_PREFIX", "Monitors", "WRITERS", "open_monitors"]
