"""The `zero_optimization` block (DeepSpeed 0.19.8 `runtime/zero/config.py`, `offload_config.py`).

Field names are DeepSpeed's canonical ones (no `stage3_` prefix); the loader
rewrites the prefixed aliases and deprecated keys before validation.
Defaults are DeepSpeed's. A knob the engine runs on takes its default from its policy
(`zeroshard.policies`), where it is declared once; keys zeroshard accepts but does not
act on are declared here only.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from zeroshard.config.fields import Bool, NonNegInt, NonNegReal, PosInt, Real, Section, Text
from zeroshard.policies import Stage3Policy, ZeroPlusPlusPolicy, ZeroPolicy

OffloadDeviceName = Literal["none", "cpu", "nvme"]

_ZERO = ZeroPolicy()
_PARAM, _OPT, _S3, _ZPP = _ZERO.offload_param, _ZERO.offload_optimizer, Stage3Policy(), ZeroPlusPlusPolicy()

STAGE3_ALIASES: dict[str, str] = {
    "stage3_prefetch_bucket_size": "prefetch_bucket_size",
    "stage3_param_persistence_threshold": "param_persistence_threshold",
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "stage3_max_live_parameters": "max_live_parameters",
    "stage3_max_reuse_distance": "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save": "gather_16bit_weights_on_model_save",
    "stage3_module_granularity_threshold": "module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params": "use_all_reduce_for_fetch_params",
    "stage3_allgather_sequential": "allgather_sequential",
}
DEPRECATED_ZERO_KEYS = (
    "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "stage3_gather_fp16_weights_on_model_save",
)


class _OffloadBlock(Section):
    """An offload block (its subclasses declare `device` and `nvme_path`)."""

    @model_validator(mode="after")
    def _nvme(self) -> "_OffloadBlock":
        if self.device == "nvme" and not self.nvme_path:
            raise PydanticCustomError("zs_rule", "device 'nvme' needs nvme_path (a directory on the NVMe drive)")
        return self


class OffloadParamConfig(_OffloadBlock):
    """`offload_param`: where stage 3 keeps parameter shards."""

    device: OffloadDeviceName = _PARAM.device.value
    nvme_path: Text | None = _PARAM.nvme_path
    buffer_count: NonNegInt = _PARAM.buffer_count
    buffer_size: PosInt = _PARAM.buffer_size
    max_in_cpu: NonNegInt = 1_000_000_000  # no effect in zeroshard (a note says so)
    pin_memory: Bool = _PARAM.pin_memory


class OffloadOptimizerConfig(_OffloadBlock):
    """`offload_optimizer`: where optimizer states (and the optimizer step) live."""

    device: OffloadDeviceName = _OPT.device.value
    nvme_path: Text | None = _OPT.nvme_path
    buffer_count: NonNegInt = _OPT.buffer_count
    pin_memory: Bool = _OPT.pin_memory
    pipeline: Bool = False
    pipeline_read: Bool = False  # no effect (noted), as pipeline and pipeline_write
    pipeline_write: Bool = False
    fast_init: Bool = False  # no effect (noted)
    ratio: Real = Field(default=_OPT.ratio, ge=0.0, le=1.0)
    super_offload: Bool = False
    cpuadam_cores_perc: Real = Field(default=0.8, gt=0.0, le=1.0)


class ZenFlowConfig(Section):
    """`zenflow`: selective optimizer offload (read only to refuse it for now)."""

    topk_ratio: NonNegReal = 0.1
    select_strategy: Text = "auto"
    select_interval: Any = "auto"
    update_interval: Any = "auto"
    overlap_step: Bool = False
    offload: Bool = False
    auto_ratio: NonNegReal = 0.99
    full_warm_up_rounds: NonNegInt = 0
    steps_per_epoch: Any = None
    pt_reserved_cores_perc: NonNegReal = 0.5


class LeafModuleConfig(Section):
    """`leaf_module`: modules gathered as one unit under stage 3."""

    classes: list[str] = Field(default_factory=list)
    names: list[str] = Field(default_factory=list)
    name_suffixes: list[str] = Field(default_factory=list)


class ZeroConfig(Section):
    """`zero_optimization`."""

    spellings = tuple(STAGE3_ALIASES) + DEPRECATED_ZERO_KEYS + ("aio",)

    stage: NonNegInt = int(_ZERO.stage)
    contiguous_gradients: Bool = _ZERO.contiguous_gradients
    reduce_scatter: Bool = _ZERO.reduce_scatter
    reduce_bucket_size: PosInt = _ZERO.reduce_bucket_size
    use_multi_rank_bucket_allreduce: Bool = True
    allgather_partitions: Bool = True
    allgather_bucket_size: PosInt = _ZERO.allgather_bucket_size
    overlap_comm: Bool | None = None  # None: not written (a note says so); the policy's default applies
    compute_grad_norm: Bool = _ZERO.compute_grad_norm
    load_from_fp32_weights: Bool = True
    elastic_checkpoint: Bool = False
    offload_param: OffloadParamConfig | None = None
    offload_optimizer: OffloadOptimizerConfig | None = None
    zenflow: ZenFlowConfig | None = None
    sub_group_size: NonNegInt = _ZERO.sub_group_size
    # Stage 3 (0 prefetch means "no prefetch" in DeepSpeed, so it is allowed).
    prefetch_bucket_size: NonNegInt = _S3.prefetch_bucket_size
    param_persistence_threshold: NonNegInt = _S3.param_persistence_threshold
    model_persistence_threshold: NonNegInt = _S3.model_persistence_threshold
    max_live_parameters: NonNegInt = _S3.max_live_parameters
    max_reuse_distance: NonNegInt = _S3.max_reuse_distance
    gather_16bit_weights_on_model_save: Bool = _S3.gather_16bit_weights_on_model_save
    module_granularity_threshold: NonNegInt = 0
    use_all_reduce_for_fetch_params: Bool = False
    allgather_sequential: Bool = False
    memory_efficient_linear: Bool = _S3.memory_efficient_linear
    pipeline_loading_checkpoint: Bool = False
    override_module_apply: Bool = True
    log_trace_cache_warnings: Bool = False
    enable_sanity_checks: Bool = False
    save_muon_momentum_buffer_in_memory: Bool = False
    leaf_module: LeafModuleConfig | None = None
    # Stages 1/2.
    ignore_unused_parameters: Bool = _ZERO.ignore_unused_parameters
    legacy_stage1: Bool = False
    round_robin_gradients: Bool = False
    parameter_alignment: Bool = False
    # ZeRO++.
    zero_hpz_partition_size: NonNegInt = _ZPP.hpz_partition_size
    zero_quantized_weights: Bool = _ZPP.quantized_weights
    zero_quantized_nontrainable_weights: Bool = _ZPP.quantized_nontrainable_weights
    zero_quantized_gradients: Bool = _ZPP.quantized_gradients

    @field_validator("stage")
    @classmethod
    def _stage_range(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise PydanticCustomError("zs_value", "stage must be 0, 1, 2 or 3")
        return stage

    @field_validator("compute_grad_norm")
    @classmethod
    def _grad_norm_stage(cls, compute: bool, info: ValidationInfo) -> bool:
        stage = info.data.get("stage")
        if not compute and stage is not None and stage not in (1, 2):
            raise PydanticCustomError(
                "zs_value", "only allowed at stage 1 or 2 (this config has stage {stage}); "
                "clipping and the reported norm need it", {"stage": stage})
        return compute

    @model_validator(mode="after")
    def _partial_offload(self) -> "ZeroConfig":
        opt = self.offload_optimizer
        if opt is not None and opt.ratio < 1.0 and self.stage != 3:
            raise PydanticCustomError(
                "zs_rule",
                "offload_optimizer.ratio < 1 (partial offload) requires stage 3, as in DeepSpeed")
        return self
