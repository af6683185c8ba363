"""Pydantic models of a DeepSpeed 0.19.8 config, every section except `zero_optimization`.

DeepSpeed reads the top level and the `aio`, `checkpoint` and
`activation_checkpointing` blocks loosely and ignores unknown keys there; these
models forbid unknown keys everywhere, so a typo is an error, not a silent
default. Defaults are DeepSpeed's, except `gradient_clipping` (None here: the
loader turns "absent" into zeroshard's 0 and says so in a note). A knob the engine
runs on takes its default from its policy (`zeroshard.policies`), declared there once.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, create_model, field_validator
from pydantic_core import PydanticCustomError

from zeroshard.config.fields import (
    Bool, Int, NonNegInt, NonNegReal, PosInt, PosReal, Section, Text, check_free_params,
)
from zeroshard.config.foreign import ROOT_FIELDS
from zeroshard.config.suggest import did_you_mean
from zeroshard.config.names import KNOWN_OPTIMIZERS, KNOWN_SCHEDULERS
from zeroshard.config.zero_schema import ZeroConfig
from zeroshard.policies import (
    ActivationOffloadPolicy, AioPolicy, CommsLoggerPolicy, LossScalePolicy, RuntimePolicy, Stage3Policy, ZeroPolicy,
)

ReduceDtype = Literal["fp32", "fp16", "bf16"]

# The value kind of each optimizer / scheduler parameter zeroshard's builders read (the
# builders own which keys each type accepts; this only keeps a wrong type from reaching
# torch as a TypeError). Keys not listed pass through unchecked.
OPTIMIZER_PARAM_KINDS = {
    "lr": "number", "eps": "number", "weight_decay": "number", "momentum": "number", "dampening": "number",
    "lr_decay": "number", "initial_accumulator_value": "number", "betas": "pair",
    "amsgrad": "bool", "nesterov": "bool", "bias_correction": "bool", "adam_w_mode": "bool",
    "torch_adam": "bool",
}
SCHEDULER_PARAM_KINDS = {
    "warmup_min_lr": "numbers", "warmup_max_lr": "numbers", "warmup_min_ratio": "number",
    "cos_min_ratio": "number", "warmup_num_steps": "posint", "total_num_steps": "posint",
    "last_batch_iteration": "int", "warmup_type": "text",
    "cycle_min_lr": "numbers", "cycle_max_lr": "numbers", "decay_lr_rate": "number", "decay_mom_rate": "number",
    "cycle_first_step_size": "number", "cycle_second_step_size": "number", "cycle_first_stair_count": "int",
    "cycle_second_stair_count": "int", "decay_step_size": "number", "cycle_momentum": "bool",
    "cycle_min_mom": "numbers", "cycle_max_mom": "numbers", "lr_range_test_min_lr": "numbers",
    "lr_range_test_step_size": "posint", "lr_range_test_step_rate": "number", "lr_range_test_staircase": "bool",
}


def _known_type(what: str, name: str, key: str, known) -> str:
    if key not in known:
        raise PydanticCustomError("zs_value", f"unknown {what} type{{hint}}", {"hint": did_you_mean(key, known)})
    return name


_SCALE, _AIO, _RUNTIME, _S3 = LossScalePolicy(), AioPolicy(), RuntimePolicy(), Stage3Policy()


class FP16Config(Section):
    enabled: Bool = False
    auto_cast: Bool = False
    loss_scale: NonNegReal = _SCALE.static_scale
    initial_scale_power: NonNegInt = _SCALE.initial_scale_power
    loss_scale_window: PosInt = _SCALE.loss_scale_window
    hysteresis: PosInt = _SCALE.hysteresis
    consecutive_hysteresis: Bool = _SCALE.consecutive_hysteresis
    min_loss_scale: PosReal = _SCALE.min_loss_scale
    fp16_master_weights_and_grads: Bool = False


class BF16Config(Section):
    enabled: Bool = False
    immediate_grad_update: Bool = False
    check_grad_overflow: Bool = True
    bf16_master_weights_and_grads: Bool = False
    bf16_optimizer_states: Bool = False


class OptimizerConfig(Section):
    type: Text
    params: dict[str, Any] = Field(default_factory=dict)
    legacy_fusion: Bool = False

    @field_validator("type")
    @classmethod
    def _known(cls, name: str) -> str:
        return _known_type("optimizer", name, name.lower(), KNOWN_OPTIMIZERS)

    @field_validator("params")
    @classmethod
    def _no_max_grad_norm(cls, params: dict[str, Any]) -> dict[str, Any]:
        if "max_grad_norm" in params:
            raise PydanticCustomError(
                "zs_rule", "max_grad_norm is not an optimizer parameter; "
                "use the top-level gradient_clipping instead (DeepSpeed refuses it too)")
        return check_free_params(params, OPTIMIZER_PARAM_KINDS)


class SchedulerConfig(Section):
    type: Text
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("type")
    @classmethod
    def _known(cls, name: str) -> str:
        return _known_type("scheduler", name, name, KNOWN_SCHEDULERS)

    @field_validator("params")
    @classmethod
    def _param_types(cls, params: dict[str, Any]) -> dict[str, Any]:
        return check_free_params(params, SCHEDULER_PARAM_KINDS)


class CommsLoggerConfig(Section):
    """Only `enabled` takes effect; the other keys are DeepSpeed's and accepted."""

    enabled: Bool = CommsLoggerPolicy.enabled
    verbose: Bool = False
    prof_all: Bool = True
    debug: Bool = False
    prof_ops: list[str] = Field(default_factory=list)


class AioConfig(Section):
    spellings = ("thread_count",)

    block_size: PosInt = _AIO.block_size
    queue_depth: PosInt = _AIO.queue_depth
    intra_op_parallelism: PosInt = _AIO.intra_op_parallelism
    single_submit: Bool = _AIO.single_submit
    overlap_events: Bool = _AIO.overlap_events
    use_gds: Bool = _AIO.use_gds


class ParallelWriteConfig(Section):
    pipeline_stage: Bool = False


class CheckpointWriterConfig(Section):
    type: Text = "fast"
    decoupled: Bool = False
    io_buffer_size: PosInt = 64 * 1024 * 1024
    io_buffer_double: Bool = True
    show_statistics: Bool = False
    data_parallel: Any = None
    io_multiplier: PosInt = 1


class CheckpointConfig(Section):
    tag_validation: Text = "Warn"
    load_universal: Bool = False
    use_node_local_storage: Bool = False
    parallel_write: ParallelWriteConfig | None = None
    checkpoint_serialization: Bool = True
    writer: CheckpointWriterConfig | None = None


class ActivationCheckpointingConfig(Section):
    partition_activations: Bool = False
    number_checkpoints: NonNegInt | None = None
    contiguous_memory_optimization: Bool = False
    cpu_checkpointing: Bool = False
    profile: Bool = False
    synchronize_checkpoint_boundary: Bool = False


class TorchAutocastConfig(Section):
    enabled: Bool = False
    dtype: Text | None = None
    lower_precision_safe_modules: list[str] | None = None


class DataTypesConfig(Section):
    grad_accum_dtype: Text | None = None
    param_dtype: Text | None = None
    buffer_dtype: Text | None = None
    keep_in_fp32_modules: Any = "auto"


class TensorBoardConfig(Section):
    enabled: Bool = False
    output_path: Text = ""
    job_name: Text = "DeepSpeedJobName"


class CSVMonitorConfig(TensorBoardConfig):
    pass


class WandbConfig(Section):
    enabled: Bool = False
    group: Text | None = None
    team: Text | None = None
    project: Text = "deepspeed"


class CometConfig(Section):
    enabled: Bool = False
    samples_log_interval: PosInt = 100
    project: Text | None = None
    workspace: Text | None = None
    api_key: Text | None = None
    experiment_name: Text | None = None
    experiment_key: Text | None = None
    online: Bool | None = None
    mode: Text | None = None


class FlopsProfilerConfig(Section):
    enabled: Bool = False
    recompute_fwd_factor: NonNegReal = 0.0
    profile_step: PosInt = 1
    module_depth: Int = -1
    top_modules: PosInt = 1
    detailed: Bool = True
    output_file: Text | None = None


def _accepting(name: str, doc: str, keys: str, **checked: Any) -> type[Section]:
    """A Section with the `checked` fields ((type, default) pairs) and DeepSpeed's other `keys`,
    accepted with any value."""
    return create_model(name, __base__=Section, __doc__=doc, **checked, **{k: (Any, None) for k in keys.split()})


AutotuningConfig = _accepting(
    "AutotuningConfig", "Read only to note that zeroshard does not autotune; values are not checked.",
    "start_step end_step start_profile_step end_profile_step metric metric_path arg_mappings model_info "
    "model_info_path results_dir exps_dir overwrite fast tuner_type tuner_early_stopping tuner_num_trials mp_size "
    "max_train_batch_size min_train_batch_size max_train_micro_batch_size_per_gpu "
    "min_train_micro_batch_size_per_gpu num_tuning_micro_batch_sizes",
    enabled=(Bool, False))
CompileConfig = _accepting(
    "CompileConfig", "DeepSpeed 0.19.8's `compile` section; DeepCompile's own keys take effect only with "
    "deepcompile (refused); `enabled`/`backend`/`kwargs`: zeroshard compiles at initialize (docs/compile.md).",
    "free_activation free_activation_threshold offload_activation offload_activation_pin_memory offload_opt_states "
    "offload_parameters double_buffer symmetric_memory debug_log sync_before_reduce sync_after_reduce "
    "sync_before_allgather sync_after_allgather keep_int_input_tensors keep_all_input_tensors passes",
    enabled=(Bool, False), autoep_non_moe=(Bool, False), deepcompile=(Bool, False), backend=(Text | None, None),
    kwargs=(dict[str, Any] | None, None))


class ActivationOffloadConfig(Section):
    """`zeroshard.activation_offload`: where zeroshard's checkpoint function keeps the inputs of
    checkpointed segments until backward ("cpu" is DeepSpeed's cpu_checkpointing; "nvme" writes
    them to files under `nvme_path`)."""

    device: Literal["none", "cpu", "nvme"] = ActivationOffloadPolicy.device.value
    nvme_path: Text | None = ActivationOffloadPolicy.nvme_path
    buffer_count: PosInt = ActivationOffloadPolicy.buffer_count


class ZeroShardConfig(Section):
    """zeroshard's own block (`"zeroshard": {...}`); DeepSpeed would reject it, zeroshard reads it."""

    comm_timeout_s: PosReal = _RUNTIME.comm_timeout_s
    cast_forward_inputs: Bool = _RUNTIME.cast_forward_inputs
    stage3_unit_classes: list[Text] | None = None  # module class names that are gather units
    stage3_min_unit_params: PosInt = _S3.min_unit_params  # without unit classes: subtree size that makes a unit
    # step each optimizer sub-group as soon as its gradients are reduced, during backward
    # (stages 0-2; None: whenever no clipping or fp16 overflow check needs every gradient first)
    step_during_backward: Bool | None = _RUNTIME.step_during_backward
    # give glibc's free heap pages back after step 1 and when RSS grows (None: where the host holds training state)
    trim_host_memory: Bool | None = _RUNTIME.trim_host_memory
    activation_offload: ActivationOffloadConfig | None = None


# DeepSpeed's blocks of features zeroshard does not build (judged in foreign.py).
_ForeignBlocks = create_model("_ForeignBlocks", __base__=Section, **ROOT_FIELDS)


class RootConfig(_ForeignBlocks):
    """The whole file, after the loader's rewrites (aliases, legacy forms, "auto") and with the
    top-level keys DeepSpeed ignores removed (`foreign.triage_top_level`)."""

    spellings = ("bfloat16",)

    train_batch_size: PosInt | None = None
    train_micro_batch_size_per_gpu: PosInt | None = None
    gradient_accumulation_steps: PosInt | None = None
    managed_gradient_accumulation: Bool = True
    gradient_clipping: NonNegReal | None = None
    fp16: FP16Config | None = None
    bf16: BF16Config | None = None
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    zero_optimization: ZeroConfig | None = None
    allgather_size: PosInt = ZeroPolicy.allgather_bucket_size  # legacy, read only with "zero_optimization": true
    zero_allow_untested_optimizer: Bool = False
    zero_force_ds_cpu_optimizer: Bool = True
    communication_data_type: ReduceDtype | None = None
    prescale_gradients: Bool = False
    gradient_predivide_factor: PosReal = 1.0
    gradient_allreduce_op: Literal["mean", "sum"] = "mean"
    torch_autocast: TorchAutocastConfig | None = None
    data_types: DataTypesConfig | None = None
    steps_per_print: NonNegInt | None = None
    wall_clock_breakdown: Bool = False
    memory_breakdown: Bool = False
    comms_logger: CommsLoggerConfig | None = None
    checkpoint: CheckpointConfig | None = None
    aio: AioConfig | None = None
    activation_checkpointing: ActivationCheckpointingConfig | None = None
    tensorboard: TensorBoardConfig | None = None
    wandb: WandbConfig | None = None
    csv_monitor: CSVMonitorConfig | None = None
    comet: CometConfig | None = None
    flops_profiler: FlopsProfilerConfig | None = None
    autotuning: AutotuningConfig | None = None
    compile: CompileConfig | None = None
    dataloader_drop_last: Bool = False
    log_level: Text | None = None
    dump_state: Bool = False
    disable_allgather: Bool = False
    zeroshard: ZeroShardConfig | None = None

    @property
    def zero(self) -> ZeroConfig:
        return self.zero_optimization or ZeroConfig()

    @property
    def stage(self) -> int:
        return self.zero.stage
