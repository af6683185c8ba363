"""Bytes each device, host and NVMe drive holds for a model under a ZeRO strategy.

Model states follow Rajbhandari et al. 2019 ("ZeRO", sec. 3.1 and Table 1): with
Φ parameters, N data-parallel ranks and K optimizer bytes per parameter,

    stage 0: (2 + 2 + K) Φ      stage 2: 2Φ + (2 + K) Φ / N
    stage 1: 2Φ + 2Φ + KΦ / N   stage 3: (2 + 2 + K) Φ / N

for 16-bit parameters and gradients. K counts the fp32 master copy (4) plus the
optimizer's own states (Adam: 4 + 4), so Adam has K = 12 (the paper's value for mixed
precision). In fp32 training zeroshard's engine steps the fp32 parameter shard in place
(as FSDP and DDP + AdamW do), so K = 8 there (parameters 4 + gradients 4 + 8 = 16 bytes
per parameter at stage 0); `Strategy(separate_fp32_master=True)` gives DeepSpeed's
convention, which keeps a second fp32 copy also in fp32 training (K = 12). Offload (Ren et al. 2021,
"ZeRO-Offload") moves the optimizer states and an fp32 gradient partition to the
host; ZeRO-Infinity (Rajbhandari et al. 2021) moves them, or the parameters, to
NVMe. The rest of the peak: gathered stage-3 units, gradient buckets and
activations (see `activations.py`), which ZeRO does not shard.

Transient buffers (stages 0-2, as zeroshard's engine allocates them, validated in
`tests/test_estimate_validation.py`): the gradients of stages 0 and 1 are reduced in
place in their bucket buffers (no extra copy); stage 2 holds full buckets only while
they fill and reduce (`STAGE2_BUCKETS_IN_FLIGHT`, or all of them with overlap_comm
off); at the optimizer step, 16-bit training upcasts each sub-group's gradient shard to
fp32 (4 bytes x up to `sub_group_size` elements) and stages 1/2 publish buckets larger
than `allgather_bucket_size` through a staging buffer. `buffers` is the larger of the
backward and the step transients.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zeroshard.policies import ConfigError, OffloadDevice, Precision, Stage

from zeroshard.estimate.activations import ActivationEstimate
from zeroshard.estimate.model_size import ModelShape
from zeroshard.estimate.padding import BucketPlan, gather_chunks, shard_count_for_stage, sub_group_sums
from zeroshard.estimate.units import BYTES_PER_ELEMENT, FP32_BYTES, GIB

__all__ = [
    "Strategy", "MemoryEstimate", "estimate_memory", "model_states_per_device", "optimizer_bytes_per_param",
    "OPTIMIZER_STATE_BYTES", "MASTER_WEIGHT_BYTES", "CUDA_CONTEXT_BYTES", "DEVICE_USABLE_FRACTION",
    "HOST_USABLE_FRACTION", "device_budget", "host_budget", "shard", "STAGE2_BUCKETS_IN_FLIGHT",
]

# Optimizer states per parameter in fp32 bytes, beyond the master weights.
OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lion": 4, "sgd-momentum": 4, "adagrad": 4, "sgd": 0}
MASTER_WEIGHT_BYTES = FP32_BYTES  # fp32 copy of 16-bit parameters (mixed precision)
# Memory a device loses before the first tensor: CUDA context, cuBLAS workspace, NCCL
# channels (~0.5-1 GiB measured on A100/H100 with PyTorch 2.x).
CUDA_CONTEXT_BYTES = 1 * GIB
# Allocator fragmentation and short-lived temporaries: plan to fill at most this much.
DEVICE_USABLE_FRACTION = 0.90
# Host memory left for the OS, data loaders and page cache.
HOST_USABLE_FRACTION = 0.85
# Stage 2 with overlap_comm: full gradient buckets alive at once during backward (the
# engine lets 2 reductions run while the next bucket fills).
STAGE2_BUCKETS_IN_FLIGHT = 3


def device_budget(gpu_memory: int) -> int:
    return int(gpu_memory * DEVICE_USABLE_FRACTION) - CUDA_CONTEXT_BYTES


def host_budget(host_memory: int) -> int:
    return int(host_memory * HOST_USABLE_FRACTION)


def optimizer_bytes_per_param(optimizer: str, precision: Precision, separate_fp32_master: bool = False) -> int:
    """K: fp32 master copy + the optimizer's states. With 16-bit parameters the master is
    separate; in fp32 training zeroshard steps the parameter shard itself (no master bytes)
    unless `separate_fp32_master` (DeepSpeed's convention, which copies it anyway)."""
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ConfigError(f"unknown optimizer {optimizer!r}; known: {', '.join(OPTIMIZER_STATE_BYTES)}")
    master = 0 if (precision == Precision.FP32 and not separate_fp32_master) else MASTER_WEIGHT_BYTES
    return master + OPTIMIZER_STATE_BYTES[optimizer]


def shard(elements: int, n: int) -> int:
    """Elements a rank owns: flat buffers are padded to a multiple of n."""
    return math.ceil(elements / n)


@dataclass(frozen=True)
class Strategy:
    """One candidate configuration. Bucket sizes in elements, as in DeepSpeed."""

    stage: Stage = Stage.DATA_PARALLEL
    precision: Precision = Precision.BF16
    optimizer: str = "adam"
    optimizer_bytes: int | None = None  # K override; None: from optimizer + precision
    offload_optimizer: OffloadDevice = OffloadDevice.NONE
    offload_param: OffloadDevice = OffloadDevice.NONE
    quantized_weights: bool = False  # qwZ
    hpz_partition_size: int = 1  # hpZ
    quantized_gradients: bool = False  # qgZ
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000  # stages 1/2: larger buckets are published in chunks
    overlap_comm: bool = True
    compute_grad_norm: bool = True  # stages >= 1: one 1-element fp32 all-reduce per step
    separate_fp32_master: bool = False  # True: DeepSpeed's second fp32 copy in fp32 training (K = 12)
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    sub_group_size: int = 1_000_000_000
    optimizer_buffer_count: int = 4  # offload_optimizer.buffer_count (nvme)
    param_buffer_count: int = 5  # offload_param.buffer_count (nvme)
    param_buffer_size: int = 100_000_000  # offload_param.buffer_size (nvme)
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stage", Stage(self.stage))
        object.__setattr__(self, "precision", Precision(self.precision))
        object.__setattr__(self, "offload_optimizer", OffloadDevice(self.offload_optimizer))
        object.__setattr__(self, "offload_param", OffloadDevice(self.offload_param))
        if self.offload_param != OffloadDevice.NONE and self.stage != Stage.PARAMETERS:
            raise ConfigError("offload_param needs stage 3 (only stage 3 partitions parameters)")
        if self.offload_optimizer != OffloadDevice.NONE and self.stage == Stage.DATA_PARALLEL:
            raise ConfigError("offload_optimizer needs stage 1, 2 or 3")
        zpp = self.quantized_weights or self.quantized_gradients or self.hpz_partition_size > 1
        if zpp and self.stage != Stage.PARAMETERS:
            raise ConfigError("ZeRO++ (qwZ, hpZ, qgZ) applies to stage 3 only")
        if self.hpz_partition_size < 1:
            raise ConfigError(f"zero_hpz_partition_size must be >= 1, got {self.hpz_partition_size}")
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
            parts.append(f"opt→{self.offload_optimizer.value}")
        if self.offload_param != OffloadDevice.NONE:
            parts.append(f"param→{self.offload_param.value}")
        zpp = [n for n, on in (("qwZ", self.quantized_weights), ("hpZ", self.hpz_partition_size > 1),
                               ("qgZ", self.quantized_gradients)) if on]
        if zpp:
            parts.append("+".join(zpp))
        return " ".join(parts)


def model_states_per_device(params: int, n: int, stage: Stage | int, k: int = 12,
                            param_bytes: int = 2, grad_bytes: int = 2) -> int:
    """The ZeRO paper's per-device model-state bytes (Table 1), no offload, no padding."""
    stage = Stage(stage)
    p = param_bytes * params / (n if stage >= Stage.PARAMETERS else 1)
    g = grad_bytes * params / (n if stage >= Stage.GRADIENTS else 1)
    o = k * params / (n if stage >= Stage.OPTIMIZER_STATES else 1)
    return int(round(p + g + o))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device (one rank), per node for host and NVMe. `buffers` and
    `live_params` are transient peaks, `activations` the unsharded part."""

    params: int
    grads: int
    optimizer_states: int
    hpz_secondary: int
    live_params: int
    buffers: int
    activations: int
    host_per_rank: int
    nvme_per_rank: int
    gpus_per_node: int
    notes: tuple[str, ...] = field(default=())

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.optimizer_states

    @property
    def device_total(self) -> int:
        return self.model_states + self.hpz_secondary + self.live_params + self.buffers + self.activations

    @property
    def host_per_node(self) -> int:
        return self.host_per_rank * self.gpus_per_node

    @property
    def nvme_per_node(self) -> int:
        return self.nvme_per_rank * self.gpus_per_node

    def as_dict(self) -> dict:
        return {
            "params": self.params, "grads": self.grads, "optimizer_states": self.optimizer_states,
            "model_states": self.model_states, "hpz_secondary": self.hpz_secondary,
            "live_params": self.live_params, "buffers": self.buffers, "activations": self.activations,
            "device_total": self.device_total, "host_per_rank": self.host_per_rank,
            "host_per_node": self.host_per_node, "nvme_per_rank": self.nvme_per_rank,
            "nvme_per_node": self.nvme_per_node, "notes": list(self.notes),
        }


def estimate_memory(shape: ModelShape, strategy: Strategy, n: int, gpus_per_node: int = 1,
                    activations: ActivationEstimate | None = None, layout: BucketPlan | None = None) -> MemoryEstimate:
    """Per-device peak of `shape` trained with `strategy` on `n` data-parallel ranks.

    `layout` (from `padding.plan_layout` over the trainable parameter sizes) makes the
    figures exact for zeroshard's engine: full buffers are the padded buckets and each
    rank owns their shards. Without it the model is Φ elements split evenly."""
    if n < 1:
        raise ConfigError(f"data-parallel size must be >= 1, got {n}")
    s, phi = strategy, shape.params
    phi_t, frozen = shape.trainable_params, shape.frozen_params  # LoRA: adapters, frozen base
    st, k, pb, gb = s.stage, s.k, s.param_bytes, s.grad_bytes
    if layout is not None and layout.shard_count != shard_count_for_stage(st, n):
        raise ConfigError(f"layout is split {layout.shard_count} ways; stage {int(st)} on {n} ranks splits "
                          f"{shard_count_for_stage(st, n)} ways (plan it with plan_layout for this stage)")
    # Trainable elements of each full (unsharded) state, and of each sharded one.
    full = layout.padded_total if layout is not None else phi_t
    own = layout.shard_total if layout is not None else shard(phi_t, n)
    notes: list[str] = []
    host = nvme = 0

    # The frozen base has parameters only (compute dtype): whole at stages 0-2, sharded at 3.
    frozen_held = shard(frozen, n) if st >= Stage.PARAMETERS else frozen
    params = pb * ((own if st >= Stage.PARAMETERS else full) + frozen_held)
    grads = gb * (own if st >= Stage.GRADIENTS else full)
    opt = k * (own if st >= Stage.OPTIMIZER_STATES else full)
    if frozen:
        notes.append(f"frozen base {frozen:,} params: {pb} bytes each"
                     f"{', sharded' if st >= Stage.PARAMETERS else ', whole on every rank'}; "
                     f"{phi_t:,} trainable: {pb} + {gb} + {k} bytes each")

    if s.offload_optimizer != OffloadDevice.NONE:
        # ZeRO-Offload: the CPU optimizer steps an fp32 gradient partition in host memory;
        # from stage 2 gradients stream to it bucket by bucket and no device copy is kept.
        fp32_grads = FP32_BYTES * own
        if st >= Stage.GRADIENTS:
            grads = 0
        if s.offload_optimizer == OffloadDevice.CPU:
            host += opt + fp32_grads
        else:
            # ZeRO-Infinity swaps the fp32 gradient partition out with the states.
            nvme += opt + fp32_grads
            host += s.optimizer_buffer_count * FP32_BYTES * min(s.sub_group_size, own)
            notes.append("optimizer states and fp32 gradients on NVMe, stepped in sub-groups through pinned host buffers")
        opt = 0

    hpz = 0
    if st == Stage.PARAMETERS and s.hpz_partition_size > 1:
        # hpZ keeps a second copy of the parameters, sharded only within the node group.
        hpz = pb * shard(phi, s.hpz_partition_size)

    live = 0
    buffers = 0
    if st == Stage.PARAMETERS:
        # The unit being computed plus the one being prefetched, capped as DeepSpeed caps them.
        unit = shape.largest_unit
        in_flight = unit + min(s.prefetch_bucket_size, unit)
        live = pb * min(phi, max(unit, min(in_flight, s.max_live_parameters)))
        buffers = gb * shape.largest_unit_trainable  # the unit's full gradient, until its reduce-scatter
        if s.offload_param == OffloadDevice.CPU:
            host += params
            params = 0
        elif s.offload_param == OffloadDevice.NVME:
            nvme += params
            host += s.param_buffer_count * pb * min(s.param_buffer_size, own + frozen_held)
            params = 0
            notes.append("parameter shards on NVMe, fetched through pinned host buffers")
        notes.append("stage 3: small parameters kept whole (param_persistence_threshold) not counted")
    else:
        buffers = _stage012_buffers(s, phi_t, n, full, own, layout)

    return MemoryEstimate(params=params, grads=grads, optimizer_states=opt, hpz_secondary=hpz,
                          live_params=live, buffers=buffers,
                          activations=activations.total if activations else 0,
                          host_per_rank=host, nvme_per_rank=nvme, gpus_per_node=gpus_per_node,
                          notes=tuple(notes))


def _stage012_buffers(s: Strategy, phi: int, n: int, full: int, own: int, layout: BucketPlan | None) -> int:
    """Transient device bytes beyond the model states at stages 0-2 (see the module doc)."""
    st, pb, gb = s.stage, s.param_bytes, s.grad_bytes
    largest = layout.largest_padded if layout is not None else min(s.reduce_bucket_size, phi)
    backward = 0  # stages 0/1 reduce in place in the persistent gradient buckets
    if st == Stage.GRADIENTS:
        # overlap off: every full bucket exists at the end of backward, before the reductions
        backward = gb * (min(full, STAGE2_BUCKETS_IN_FLIGHT * largest) if s.overlap_comm else full)
    step = 0
    if s.offload_optimizer == OffloadDevice.NONE:
        if s.grad_bytes != FP32_BYTES:  # 16-bit gradient shards are upcast one sub-group at a time
            shards = layout.shards if layout is not None else None
            held = own if st >= Stage.OPTIMIZER_STATES else full  # stage 0 steps the whole gradient
            upcast = max(sub_group_sums(shards, s.sub_group_size)) if shards else min(s.sub_group_size, held)
            step += FP32_BYTES * upcast
    if st >= Stage.OPTIMIZER_STATES:  # publishing: buckets over allgather_bucket_size go through staging
        if layout is not None:
            staging = max((gather_chunks(sh, p, s.allgather_bucket_size, n)[1]
                           for sh, p in zip(layout.shards, layout.padded)), default=0)
        else:
            staging = gather_chunks(shard(largest, n), shard(largest, n) * n, s.allgather_bucket_size, n)[1]
        step += pb * staging
    return max(backward, step)
