"""One candidate configuration the estimator prices: stage, precision, optimizer, offload,
ZeRO++ and the knobs the figures depend on, with K (optimizer bytes per parameter).

The knobs' defaults are the policies' (`zeroshard.policies`), as a config that leaves
them out gets them.
"""

from __future__ import annotations

from dataclasses import dataclass

from zeroshard.policies import (
    ActivationOffloadPolicy, ConfigError, OffloadDevice, Precision, Stage, Stage3Policy, ZeroPolicy,
)

from zeroshard.estimate.byte_units import BYTES_PER_ELEMENT, FP32_BYTES

__all__ = ["Strategy", "optimizer_bytes_per_param", "OPTIMIZER_STATE_BYTES", "MASTER_WEIGHT_BYTES"]

_ZERO, _S3 = ZeroPolicy(), Stage3Policy()

# Optimizer states per parameter in fp32 bytes, beyond the master weights.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lion": 4, "sgd-momentum": 4, "adagrad": 4, "sgd": 0}
MASTER_WEIGHT_BYTES = FP32_BYTES  # fp32 copy of 16-bit parameters (mixed precision)


def optimizer_bytes_per_param(optimizer: str, precision: Precision, separate_fp32_master: bool = False) -> int:
    """K: fp32 master copy + the optimizer's states. With 16-bit parameters the master is
    separate; in fp32 training zeroshard steps the parameter shard itself (no master bytes)
    unless `separate_fp32_master` (DeepSpeed's convention, which copies it anyway)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ConfigError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_BYTES)}")
    master = 0 if (precision == Precision.FP32 and not separate_fp32_master) else MASTER_WEIGHT_BYTES
    return master + OPTIMIZER_STATE_BYTES[optimizer]


@dataclass(frozen=True)
class Strategy:
    """One candidate configuration. Bucket sizes in elements, as in DeepSpeed."""

    stage: Stage = Stage.DATA_PARALLEL
    precision: Precision = Precision.BF16
    optimizer: str = "adam"
    optimizer_bytes: int | None = None  # K override; None: from optimizer + precision
    offload_optimizer: OffloadDevice = _ZERO.offload_optimizer.device
    offload_param: OffloadDevice = _ZERO.offload_param.device
    quantized_weights: bool = _ZERO.zeropp.quantized_weights  # qwZ
    hpz_partition_size: int = _ZERO.zeropp.hpz_partition_size  # hpZ
    quantized_gradients: bool = _ZERO.zeropp.quantized_gradients  # qgZ
    reduce_bucket_size: int = _ZERO.reduce_bucket_size
    allgather_bucket_size: int = _ZERO.allgather_bucket_size  # stages 1/2: larger buckets are published in chunks
    overlap_comm: bool = _ZERO.overlap_comm
    compute_grad_norm: bool = _ZERO.compute_grad_norm  # stages >= 1: one 1-element fp32 all-reduce per step
    separate_fp32_master: bool = False  # True: DeepSpeed's second fp32 copy in fp32 training (K = 12)
    prefetch_bucket_size: int = _S3.prefetch_bucket_size
    max_live_parameters: int = _S3.max_live_parameters
    sub_group_size: int = _ZERO.sub_group_size
    optimizer_buffer_count: int = _ZERO.offload_optimizer.buffer_count  # offload_optimizer.buffer_count (nvme)
    param_buffer_count: int = _ZERO.offload_param.buffer_count  # offload_param.buffer_count (nvme)
    param_buffer_size: int = _ZERO.offload_param.buffer_size  # offload_param.buffer_size (nvme)
    activation_checkpointing: bool = False
    # where the checkpointed layer inputs wait for backward (activation_checkpointing.cpu_checkpointing
    # = cpu; zeroshard.activation_offload); needs activation_checkpointing
    activation_offload: OffloadDevice = OffloadDevice.NONE
    activation_buffer_count: int = ActivationOffloadPolicy.buffer_count  # nvme staging buffers
    offload_ratio: float = _ZERO.offload_optimizer.ratio  # share of the optimizer shards on the host
    # Where the estimate is for: False, a GPU with its own memory (separate fp32 host master in fp32
    # training, pinned gradient staging); True, a CPU-only machine where host and device are the
    # same memory (zeroshard on gloo: the shard stays its own master, no staging copies).
    host_is_device: bool = False
    # DeepSpeed's ZeRO-Offload: an fp32 gradient partition streamed to the host during backward,
    # no device gradient kept from stage 2. False: zeroshard's engine (gradient shard on the device).
    grads_to_host: bool = False

    def __post_init__(self) -> None:
        for name, kind in (("stage", Stage), ("precision", Precision), ("offload_optimizer", OffloadDevice),
                           ("offload_param", OffloadDevice), ("activation_offload", OffloadDevice)):
            object.__setattr__(self, name, kind(getattr(self, name)))
        if self.activation_offload != OffloadDevice.NONE and not self.activation_checkpointing:
            raise ConfigError("activation offload moves the inputs kept by activation checkpointing: set "
                              "activation_checkpointing=True, or activation_offload='none'")
        if self.activation_buffer_count < 1:
            raise ConfigError(f"activation_buffer_count must be >= 1, got {self.activation_buffer_count}")
        if self.offload_param != OffloadDevice.NONE and self.stage != Stage.PARAMETERS:
            raise ConfigError("offload_param needs stage 3 (only stage 3 partitions parameters)")
        if self.offload_optimizer != OffloadDevice.NONE and self.stage == Stage.DATA_PARALLEL:
            raise ConfigError("offload_optimizer needs stage 1, 2 or 3")
        if self.zeropp and self.stage != Stage.PARAMETERS:
            raise ConfigError("ZeRO++ (qwZ, hpZ, qgZ) applies to stage 3 only")
        if self.hpz_partition_size < 1:
            raise ConfigError(f"zero_hpz_partition_size must be >= 1, got {self.hpz_partition_size}")
        if not 0.0 <= self.offload_ratio <= 1.0:
            raise ConfigError(f"offload_optimizer.ratio must be in [0, 1], got {self.offload_ratio}")
        if self.offload_ratio < 1.0 and self.offload_optimizer != OffloadDevice.CPU:
            raise ConfigError("offload_optimizer.ratio needs offload_optimizer device cpu")
        if self.optimizer_bytes is not None and self.optimizer_bytes < 0:
            raise ConfigError(f"optimizer bytes per parameter must not be negative, got {self.optimizer_bytes}")
        for name in ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters",
                     "sub_group_size"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def k(self) -> int:
        if self.optimizer_bytes is not None:
            return self.optimizer_bytes
        return optimizer_bytes_per_param(self.optimizer, self.precision, self.separate_fp32_master)

    def k_on(self, host: bool) -> int:
        """K of the shards whose master and states live on the host (`host`) or the device.
        In fp32 the parameter shard is its own master only in the same memory: on a GPU an
        offloaded optimizer needs a separate fp32 host master unless `offload_param` put the
        shard on the host too; a device optimizer over host parameter shards needs one on the
        device. With `host_is_device` (CPU-only) every tier is the same memory: plain `k`."""
        if self.optimizer_bytes is not None or self.precision != Precision.FP32 or self.separate_fp32_master:
            return self.k
        params_on_host = self.stage == Stage.PARAMETERS and self.offload_param == OffloadDevice.CPU
        if self.host_is_device or host == params_on_host:
            return self.k
        return self.k + MASTER_WEIGHT_BYTES

    @property
    def param_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def grad_bytes(self) -> int:
        return BYTES_PER_ELEMENT[self.precision]

    @property
    def zeropp(self) -> bool:
        return self.quantized_weights or self.quantized_gradients or self.hpz_partition_size > 1

    def label(self) -> str:
        parts = [f"stage {int(self.stage)}"]
        if self.offload_optimizer != OffloadDevice.NONE:
            parts.append(f"opt→{self.offload_optimizer.value}"
                         + (f" {self.offload_ratio:.0%}" if self.offload_ratio < 1.0 else ""))
        if self.offload_param != OffloadDevice.NONE:
            parts.append(f"param→{self.offload_param.value}")
        if self.activation_offload != OffloadDevice.NONE:
            parts.append(f"act→{self.activation_offload.value}")
        zpp = [n for n, on in (("qwZ", self.quantized_weights), ("hpZ", self.hpz_partition_size > 1),
                               ("qgZ", self.quantized_gradients)) if on]
        if zpp:
            parts.append("+".join(zpp))
        return " ".join(parts)
