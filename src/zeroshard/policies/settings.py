"""Frozen, typed settings the engine runs on. Built by `zeroshard.config`, read everywhere else.

Each knob's default is declared here once: the config schema (`zeroshard.config`) and the
estimator (`zeroshard.estimate`) read their defaults from these dataclasses.
This module imports nothing internal: it is the bottom of the layer chain.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    import torch


class Stage(enum.IntEnum):
    """ZeRO stage: what each rank shards beyond plain data parallelism."""

    DATA_PARALLEL = 0
    OPTIMIZER_STATES = 1
    GRADIENTS = 2
    PARAMETERS = 3


class Precision(str, enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        import torch  # here, so the command line can read settings before it imports torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]

    @property
    def itemsize(self) -> int:
        """Bytes per element (dtype.itemsize, without importing torch)."""
        return 4 if self is Precision.FP32 else 2


class OffloadDevice(str, enum.Enum):
    NONE = "none"
    CPU = "cpu"
    NVME = "nvme"


@dataclass(frozen=True)
class BatchPolicy:
    """train_batch_size == micro_batch_size * gradient_accumulation_steps * data-parallel size."""

    train_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int


@dataclass(frozen=True)
class LossScalePolicy:
    """fp16 loss scaling, DeepSpeed's knobs. `static_scale` 0 means dynamic scaling."""

    static_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    # "deepspeed": the fp16 section's scaler (the knobs above); "torch": torch.amp.GradScaler's
    # defaults and rule, which DeepSpeed uses for torch_autocast in float16 (the knobs unused)
    rule: str = "deepspeed"

    @property
    def dynamic(self) -> bool:
        return self.static_scale == 0.0


@dataclass(frozen=True)
class PrecisionPolicy:
    """Dtypes of each kind of state. Master weights and optimizer states are fp32."""

    compute: Precision = Precision.FP32
    reduce: Precision = Precision.FP32
    loss_scale: LossScalePolicy | None = None  # set iff compute is fp16
    # dtype the reduced gradient shards accumulate in across micro-steps (stages 2-3; None: the
    # compute dtype): DeepSpeed's data_types.grad_accum_dtype "fp32" with bf16 / fp16
    grad_accum: Precision | None = None

    # Not settings: zeroshard keeps fp32 masters and optimizer states whatever the config says
    # (bf16_master_weights_and_grads / bf16_optimizer_states are refused), so nothing sets them.
    @property
    def master(self) -> Precision:
        return Precision.FP32

    @property
    def optimizer_states(self) -> Precision:
        return Precision.FP32


@dataclass(frozen=True)
class GradientReducePolicy:
    """How the ranks' gradients are combined: DeepSpeed's `gradient_allreduce_op`,
    `prescale_gradients` and `gradient_predivide_factor`, which act as in DeepSpeed's
    `allreduce_bucket`: "sum" adds the ranks' gradients (N x the mean); `prescale` divides
    each rank's gradient by N before the sum; `predivide_factor` f divides by f before the sum
    and multiplies by f / N after. Every "mean" form is the mean: they differ only in where
    an fp16 sum may overflow or lose digits."""

    average: bool = True
    prescale: bool = False
    predivide_factor: float = 1.0

    def factors(self, world_size: int, collective_can_average: bool) -> tuple[float, float, bool]:
        """(multiplier before the sum, multiplier after it, whether the collective averages)."""
        n = world_size
        if n == 1 or not self.average:
            return 1.0, 1.0, False
        if self.prescale:
            return 1.0 / n, 1.0, False
        if self.predivide_factor != 1.0:
            f = self.predivide_factor
            return 1.0 / f, (f / n if f != n else 1.0), False
        return (1.0, 1.0, True) if collective_can_average else (1.0 / n, 1.0, False)


@dataclass(frozen=True)
class OffloadPolicy:
    """Where a kind of state lives (`offload_optimizer` / `offload_param`)."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None
    pin_memory: bool = True
    buffer_count: int = 4
    buffer_size: int = 100_000_000
    ratio: float = 1.0


@dataclass(frozen=True)
class AioPolicy:
    """DeepSpeed's top-level `aio` block: how the NVMe tier's I/O engine is driven."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = True
    use_gds: bool = False


@dataclass(frozen=True)
class Stage3Policy:
    """Stage 3 knobs, in elements unless named otherwise."""

    prefetch_bucket_size: int = 50_000_000
    param_persistence_threshold: int = 100_000
    model_persistence_threshold: int = 2**63 - 1
    max_live_parameters: int = 1_000_000_000
    max_reuse_distance: int = 1_000_000_000
    gather_16bit_weights_on_model_save: bool = False
    memory_efficient_linear: bool = True  # stages/zero_linear.py: saves a Linear's weight, not a view of it
    unit_classes: tuple[str, ...] = ()  # leaf_module.classes: module class names gathered as one unit
    min_unit_params: int = 100_000  # without unit_classes: a subtree this large becomes a unit


@dataclass(frozen=True)
class ZeroPlusPlusPolicy:
    """ZeRO++: qwZ, hpZ, qgZ."""

    quantized_weights: bool = False
    quantized_nontrainable_weights: bool = False
    hpz_partition_size: int = 1
    quantized_gradients: bool = False


# Hugging Face's heuristics for "auto" from the model's hidden size h
# (transformers/integrations/deepspeed.py): the loader fills these keys, the planner sizes buckets.
HIDDEN_SIZE_AUTO: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "param_persistence_threshold": lambda h: 10 * h,
}


@dataclass(frozen=True)
class ZeroPolicy:
    """`zero_optimization`. Bucket sizes are in elements, as in DeepSpeed."""

    stage: Stage = Stage.DATA_PARALLEL
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    sub_group_size: int = 1_000_000_000
    ignore_unused_parameters: bool = True
    compute_grad_norm: bool = True
    offload_optimizer: OffloadPolicy = field(default_factory=OffloadPolicy)
    offload_param: OffloadPolicy = field(default_factory=lambda: OffloadPolicy(buffer_count=5))
    stage3: Stage3Policy = field(default_factory=Stage3Policy)
    zeropp: ZeroPlusPlusPolicy = field(default_factory=ZeroPlusPlusPolicy)


@dataclass(frozen=True)
class OptimizerSpec:
    """`optimizer` section: `type` lower-cased ("adam", "adamw", "sgd", ...), `params` as given."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SchedulerSpec:
    """`scheduler` section: `type` as DeepSpeed spells it ("WarmupLR", ...), `params` as given."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class CommsLoggerPolicy:
    """`comms_logger`: when enabled, the collectives of each step are printed with the step line."""

    enabled: bool = False


@dataclass(frozen=True)
class RuntimePolicy:
    """zeroshard's own knobs (the `zeroshard` block of a config)."""

    comm_timeout_s: float = 600.0  # every collective fails loudly after this long
    cast_forward_inputs: bool = True  # floating inputs are cast to the compute dtype
    step_during_backward: bool | None = None  # None: on where nothing forbids it (stages 0-2)
    trim_host_memory: bool | None = None  # None: on where the host holds training state
    autocast: str | None = None  # DeepSpeed's torch_autocast: the forward runs under torch.autocast in this dtype


@dataclass(frozen=True)
class ActivationOffloadPolicy:
    """Where the inputs of checkpointed segments wait for backward (zeroshard's checkpoint function).

    `device` NONE: on the compute device (plain activation checkpointing); CPU: host memory
    (DeepSpeed's `activation_checkpointing.cpu_checkpointing`); NVME: files under `nvme_path`
    (`zeroshard.activation_offload`). `buffer_count`: host staging buffers of the NVMe variant
    (writes in flight, and reads ahead of backward)."""

    device: OffloadDevice = OffloadDevice.NONE
    nvme_path: str | None = None
    buffer_count: int = 2
    why: str = ""  # which key asked for it, for the start-up line


# the monitor sections that need a library: section -> (module imported, pip package)
MONITOR_LIBRARIES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                     "comet": ("comet_ml", "comet_ml")}


@dataclass(frozen=True)
class Settings:
    """The whole validated configuration. `notes` are start-up messages (ignored keys, aliases)."""

    batch: BatchPolicy
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    zero: ZeroPolicy = field(default_factory=ZeroPolicy)
    optimizer: OptimizerSpec | None = None
    scheduler: SchedulerSpec | None = None
    gradient_clipping: float = 0.0  # 0 = no clipping
    gradient_reduce: GradientReducePolicy = field(default_factory=GradientReducePolicy)
    steps_per_print: int | None = None
    wall_clock_breakdown: bool = False
    comms_logger: CommsLoggerPolicy = field(default_factory=CommsLoggerPolicy)
    # the enabled monitor sections, in DeepSpeed's names ("tensorboard", "csv_monitor", "wandb",
    # "comet"), each with its keys as written: ((section, ((key, value), ...)), ...)
    monitors: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    aio: AioPolicy = field(default_factory=AioPolicy)
    runtime: RuntimePolicy = field(default_factory=RuntimePolicy)
    activations: ActivationOffloadPolicy = field(default_factory=ActivationOffloadPolicy)
    raw: Mapping[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
