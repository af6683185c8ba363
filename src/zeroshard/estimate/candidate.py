"""A strategy priced on a cluster: memory, communication and step time, against the budgets.

The planner (`planner.py`) walks its route over these.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.policies import ConfigError, Precision

from zeroshard.estimate.activations import activation_bytes
from zeroshard.estimate.byte_units import GIB
from zeroshard.estimate.comm import CommEstimate, estimate_comm
from zeroshard.estimate.hardware import Cluster
from zeroshard.estimate.memory import MemoryEstimate, device_budget, estimate_memory, host_budget
from zeroshard.estimate.model_size import ModelShape
from zeroshard.estimate.strategy import Strategy
from zeroshard.estimate.timing import TimeEstimate, estimate_time

__all__ = ["Workload", "Candidate", "evaluate"]


@dataclass(frozen=True)
class Workload:
    seq: int = 2048
    micro_batch: int = 1
    gradient_accumulation_steps: int = 1
    precision: Precision = Precision.BF16
    optimizer: str = "adam"
    optimizer_bytes: int | None = None
    activation_checkpointing: bool | None = None  # None: the planner decides
    flash_attention: bool = True
    host_is_device: bool = False  # CPU-only machine (zeroshard on gloo): see Strategy.host_is_device
    grads_to_host: bool = False  # DeepSpeed's offload gradient model: see Strategy.grads_to_host

    def __post_init__(self) -> None:
        object.__setattr__(self, "precision", Precision(self.precision))
        for name in ("seq", "micro_batch", "gradient_accumulation_steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Candidate:
    strategy: Strategy
    memory: MemoryEstimate
    comm: CommEstimate
    time: TimeEstimate
    device_budget: int
    host_budget: int
    nvme_budget: int

    @property
    def fits_device(self) -> bool:
        return self.memory.device_total <= self.device_budget

    @property
    def fits_host(self) -> bool:
        return self.memory.host_per_node <= self.host_budget

    @property
    def fits_nvme(self) -> bool:
        return self.memory.nvme_per_node <= self.nvme_budget

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host and self.fits_nvme

    def why_not(self) -> str:
        m = self.memory
        reasons = (
            (self.fits_device, f"device needs {m.device_total / GIB:.1f} GiB > {self.device_budget / GIB:.1f} GiB usable"),
            (self.fits_host, f"host needs {m.host_per_node / GIB:.1f} GiB/node > {self.host_budget / GIB:.1f} GiB usable"),
            (self.fits_nvme, f"NVMe needs {m.nvme_per_node / GIB:.1f} GiB/node > {self.nvme_budget / GIB:.1f} GiB"))
        return "; ".join(text for fits, text in reasons if not fits) or "fits"

    def label(self) -> str:
        return self.strategy.label() + (" +AC" if self.strategy.activation_checkpointing else "")

    def as_dict(self) -> dict:
        s = self.strategy
        return {"label": self.label(), "stage": int(s.stage), "offload_optimizer": s.offload_optimizer.value,
                "offload_param": s.offload_param.value, "quantized_weights": s.quantized_weights,
                "hpz_partition_size": s.hpz_partition_size, "quantized_gradients": s.quantized_gradients,
                "activation_checkpointing": s.activation_checkpointing, "fits": self.fits,
                "fits_device": self.fits_device, "fits_host": self.fits_host, "fits_nvme": self.fits_nvme,
                "device_budget": self.device_budget, "host_budget_per_node": self.host_budget,
                "memory": self.memory.as_dict(), "time_s": self.time.as_dict(), "comm": self.comm.as_dict()}


def evaluate(shape: ModelShape, strategy: Strategy, cluster: Cluster, work: Workload) -> Candidate:
    acts = activation_bytes(work.seq, work.micro_batch, shape.hidden, shape.heads, shape.layers, shape.vocab,
                            checkpointing=strategy.activation_checkpointing,
                            flash_attention=work.flash_attention, act_bytes=strategy.param_bytes)
    mem = estimate_memory(shape, strategy, cluster.world_size, cluster.gpus_per_node, acts)
    comm = estimate_comm(shape.trainable_params, strategy, cluster.nodes, cluster.gpus_per_node,
                         work.gradient_accumulation_steps, frozen=shape.frozen_params)
    t = estimate_time(shape, strategy, cluster, comm, work.seq, work.micro_batch, work.gradient_accumulation_steps)
    return Candidate(strategy, mem, comm, t, device_budget(cluster.gpu.memory), host_budget(cluster.host_mem),
                     cluster.nvme)
