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
fp32 (4 bytes x up to `sub_group_size` elements); stages 1/2 publish buckets larger than
`allgather_bucket_size` in chunks gathered straight into place (no staging buffer).
`buffers` is the larger of the backward and the step transients.

Host offload (`offload_optimizer: cpu`, `offload_param: cpu`), as zeroshard's engine holds
it (validated on 2 gloo ranks in `tests/test_estimate_offload.py`, every tier and category
exact with the padded layout):

* the master and optimizer states of the offloaded shards sit on the host, the first
  `offload_ratio` of the bucket shards by elements (whole shards, DeepSpeed's
  `offload_optimizer.ratio`), the rest on the device;
* the gradient shard stays on the device in the compute dtype (2Φ/N from stage 2, the full
  2Φ at stage 1) and is copied to the host one sub-group at a time at the step (on CUDA
  through two pinned staging buffers of the largest sub-group, which the engine's ledger
  does not count); a 16-bit gradient is upcast to fp32 on the host for one sub-group at a
  time. DeepSpeed instead streams an fp32 gradient partition to the host during backward
  and keeps no device copy: `Strategy(grads_to_host=True)` gives that model;
* `offload_param: cpu` (stage 3) keeps the 16-bit parameter shards on the host;
* in fp32 the parameter shard is its own master only when it lives in the same memory as
  the optimizer states. On a GPU, offloading the optimizer alone puts a separate fp32 master
  on the host (K = 12 there for Adam), while with `offload_param` too the shard already is
  on the host (K = 8). On a CPU-only machine host and device are the same memory
  (`Strategy(host_is_device=True)`, zeroshard on gloo): K = 8 always, no staging buffers.

Activation offload (`Strategy(activation_offload=...)`, with activation checkpointing; zeroshard's
checkpoint function, `offload/activations.py`): the kept input of every checkpointed layer
(`ActivationEstimate.stored`) lives on the host (`cpu`: `host_activations`) or in NVMe files
(`nvme`: `nvme_activations`, part of `nvme_per_rank`, plus `activation_buffer_count` host staging
buffers of one layer's input in `host_buffers`). The device keeps the layer being recomputed:
its input, copied back, plus its recompute working set and the logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from zeroshard.partition.layout import shard_count_for
from zeroshard.policies import ConfigError, OffloadDevice, Precision, Stage

from zeroshard.estimate.activations import ActivationEstimate
from zeroshard.estimate.model_size import ModelShape
from zeroshard.estimate.padding import BucketPlan, offload_split, sub_group_sums
from zeroshard.estimate.byte_units import FP32_BYTES, GIB
from zeroshard.estimate.strategy import (  # noqa: F401  (Strategy and K are read here by the estimator's users)
    MASTER_WEIGHT_BYTES, OPTIMIZER_STATE_BYTES, Strategy, optimizer_bytes_per_param,
)

__all__ = [
    "Strategy", "MemoryEstimate", "estimate_memory", "model_states_per_device", "optimizer_bytes_per_param",
    "OPTIMIZER_STATE_BYTES", "MASTER_WEIGHT_BYTES", "CUDA_CONTEXT_BYTES", "DEVICE_USABLE_FRACTION",
    "HOST_USABLE_FRACTION", "device_budget", "host_budget", "shard", "STAGE2_BUCKETS_IN_FLIGHT", "engine_sub_group",
]

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


def shard(elements: int, n: int) -> int:
    """Elements a rank owns: flat buffers are padded to a multiple of n."""
    return math.ceil(elements / n)


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
    nvme_per_rank: int
    gpus_per_node: int
    notes: tuple[str, ...] = field(default=())
    # Host memory per rank, by category: at rest, and `host_buffers` (transient: the fp32 upcast
    # of a gradient sub-group, pinned staging on a GPU, NVMe swap buffers).
    host_params: int = 0
    host_grads: int = 0
    host_optimizer_states: int = 0
    host_buffers: int = 0
    # checkpointed activations offloaded (activation_offload): on the host, and in NVMe files
    # (the latter also counted in nvme_per_rank)
    host_activations: int = 0
    nvme_activations: int = 0

    @property
    def host_per_rank(self) -> int:
        return self.host_at_rest + self.host_buffers + self.host_activations

    @property
    def device_at_rest(self) -> int:
        """Device bytes of the model states between steps (what `memory_stats()['tier_device']` holds)."""
        return self.model_states + self.hpz_secondary

    @property
    def host_at_rest(self) -> int:
        """Host bytes between steps (what `memory_stats()['tier_host']` holds)."""
        return self.host_params + self.host_grads + self.host_optimizer_states

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
            "device_total": self.device_total, "device_at_rest": self.device_at_rest,
            "host_params": self.host_params, "host_grads": self.host_grads,
            "host_optimizer_states": self.host_optimizer_states, "host_buffers": self.host_buffers,
            "host_activations": self.host_activations, "nvme_activations": self.nvme_activations,
            "host_at_rest": self.host_at_rest, "host_per_rank": self.host_per_rank,
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
    if layout is not None and layout.shard_count != shard_count_for(st, n):
        raise ConfigError(f"layout is split {layout.shard_count} ways; stage {int(st)} on {n} ranks splits "
                          f"{shard_count_for(st, n)} ways (plan it with plan_layout for this stage)")
    # Trainable elements of each full (unsharded) state, and of each sharded one.
    full = layout.padded_total if layout is not None else phi_t
    own = layout.shard_total if layout is not None else shard(phi_t, n)
    notes: list[str] = []
    nvme = 0

    # The frozen base has parameters only (compute dtype): whole at stages 0-2, sharded at 3.
    frozen_held = shard(frozen, n) if st >= Stage.PARAMETERS else frozen
    params = pb * ((own if st >= Stage.PARAMETERS else full) + frozen_held)
    grads = gb * (own if st >= Stage.GRADIENTS else full)
    opt = s.k_on(host=False) * (own if st >= Stage.OPTIMIZER_STATES else full)
    if frozen:
        notes.append(f"frozen base {frozen:,} params: {pb} bytes each"
                     f"{', sharded' if st >= Stage.PARAMETERS else ', whole on every rank'}; "
                     f"{phi_t:,} trainable: {pb} + {gb} + {k} bytes each")

    host_params = host_grads = host_opt = host_buf = 0
    if s.offload_optimizer == OffloadDevice.CPU:
        # ZeRO-Offload as zeroshard's engine does it (module doc): masters and states of the
        # first `offload_ratio` of the shards on the host, the gradient shard on the device.
        host_shards = None
        if layout is not None:
            host_shards = [x for x, goes in zip(layout.shards, offload_split(layout.shards, s.offload_ratio)) if goes]
            host_elems = sum(host_shards)
        else:
            host_elems = own if s.offload_ratio >= 1.0 else int(round(s.offload_ratio * own))
        opt = s.k_on(host=False) * (own - host_elems)
        host_opt = s.k_on(host=True) * host_elems
        if s.grads_to_host:  # DeepSpeed: an fp32 partition streamed to the host, no device gradient
            host_grads = FP32_BYTES * own
            if st >= Stage.GRADIENTS:
                grads = 0
        elif host_elems:
            # The step, one sub-group at a time: the gradient shards on the host (CUDA: two pinned
            # staging buffers), 16-bit ones upcast to fp32 there.
            cap = engine_sub_group(s)
            sub = max(sub_group_sums(host_shards, cap)) if host_shards else min(cap, host_elems)
            if gb != FP32_BYTES:
                host_buf += FP32_BYTES * sub
            if not s.host_is_device:
                host_buf += 2 * gb * sub
        if s.precision == Precision.FP32 and host_elems and s.k_on(host=True) != s.k:
            notes.append(f"fp32 on a GPU: the optimizer offload keeps a separate fp32 master on the host "
                         f"(K = {s.k_on(host=True)} there); on a CPU-only machine (host is device) K = {s.k}")
    elif s.offload_optimizer == OffloadDevice.NVME:
        # ZeRO-Infinity (DeepSpeed's model of it): the fp32 gradient partition is swapped out with
        # the states, from stage 2 no device gradient is kept.
        if st >= Stage.GRADIENTS:
            grads = 0
        nvme += opt + FP32_BYTES * own
        host_buf += s.optimizer_buffer_count * FP32_BYTES * min(s.sub_group_size, own)
        notes.append("optimizer states and fp32 gradients on NVMe, stepped in sub-groups through pinned host buffers")
        opt = 0

    # hpZ keeps a second copy of the parameters, sharded only within the node group.
    hpz = pb * shard(phi, s.hpz_partition_size) if st == Stage.PARAMETERS and s.hpz_partition_size > 1 else 0

    live = buffers = 0
    if st == Stage.PARAMETERS:
        # The unit being computed plus the one being prefetched, capped as DeepSpeed caps them.
        unit = shape.largest_unit
        in_flight = unit + min(s.prefetch_bucket_size, unit)
        live = pb * min(phi, max(unit, min(in_flight, s.max_live_parameters)))
        # two units' full gradients: one reduce-scattering while the next one fills
        buffers = 2 * gb * shape.largest_unit_trainable
        if s.offload_param == OffloadDevice.CPU:
            host_params, params = params, 0
            if not s.host_is_device:  # gather_input: a device copy of the unit's shard, fetched from the host
                buffers += pb * shard(unit, n)
        elif s.offload_param == OffloadDevice.NVME:
            nvme += params
            host_buf += s.param_buffer_count * pb * min(s.param_buffer_size, own + frozen_held)
            params = 0
            notes.append("parameter shards on NVMe, fetched through pinned host buffers")
        notes.append("stage 3: small parameters kept whole (param_persistence_threshold) not counted")
    else:
        buffers = _stage012_buffers(s, phi_t, full, own, layout)

    device_act = activations.total if activations else 0
    host_act = nvme_act = 0
    if activations is not None and s.activation_offload != OffloadDevice.NONE:
        if not activations.checkpointing:
            raise ConfigError("activation offload needs the activations estimated with checkpointing "
                              "(activation_bytes(..., checkpointing=True))")
        # every layer's kept input leaves the device; the one being recomputed comes back
        moved = activations.stored
        device_act = activations.total - moved + activations.checkpoint_input
        if s.activation_offload == OffloadDevice.CPU:
            host_act = moved
            notes.append(f"checkpointed activations on the host: {moved:,} bytes")
        else:
            nvme_act = moved
            nvme += moved
            host_buf += s.activation_buffer_count * activations.checkpoint_input
            notes.append(f"checkpointed activations in NVMe files: {moved:,} bytes, through "
                         f"{s.activation_buffer_count} host staging buffer(s) of one layer's input")

    return MemoryEstimate(params=params, grads=grads, optimizer_states=opt, hpz_secondary=hpz,
                          live_params=live, buffers=buffers, activations=device_act,
                          nvme_per_rank=nvme, gpus_per_node=gpus_per_node, notes=tuple(notes),
                          host_params=host_params, host_grads=host_grads, host_optimizer_states=host_opt,
                          host_buffers=host_buf, host_activations=host_act, nvme_activations=nvme_act)


def engine_sub_group(s: Strategy) -> int:
    """Elements the engine steps at once: `sub_group_size`, never above `reduce_bucket_size`."""
    return min(s.sub_group_size, s.reduce_bucket_size)


def _stage012_buffers(s: Strategy, phi: int, full: int, own: int, layout: BucketPlan | None) -> int:
    """Transient device bytes beyond the model states at stages 0-2 (see the module doc)."""
    st, gb = s.stage, s.grad_bytes
    largest = layout.largest_padded if layout is not None else min(s.reduce_bucket_size, phi)
    backward = 0  # stages 0/1 reduce in place in the persistent gradient buckets
    if st == Stage.GRADIENTS:
        # overlap off: every full bucket exists at the end of backward, before the reductions
        backward = gb * (min(full, STAGE2_BUCKETS_IN_FLIGHT * largest) if s.overlap_comm else full)
    step = 0
    # where a device share steps, 16-bit gradient shards are upcast one sub-group at a time
    if (s.offload_optimizer == OffloadDevice.NONE or s.offload_ratio < 1.0) and gb != FP32_BYTES:
        shards = layout.shards if layout is not None else None
        held = own if st >= Stage.OPTIMIZER_STATES else full  # stage 0 steps the whole gradient
        upcast = max(sub_group_sums(shards, s.sub_group_size)) if shards else min(s.sub_group_size, held)
        step = FP32_BYTES * upcast
    # publishing (stages 1/2) gathers every bucket straight into place, chunked or not: no buffer
    return max(backward, step)
