"""Map a validated RootConfig onto the frozen policies the engine runs on.

Settings hold the *effective* settings: blocks that cannot take effect at the
chosen stage (offload_param, ZeRO++ and stage-3 knobs below stage 3, any offload
at stage 0) map to their defaults; they stay visible in `Settings.raw`, and
`support.check_support` has already noted them.
"""

from __future__ import annotations

import dataclasses

from typing import Any

from zeroshard.config.schema import RootConfig
from zeroshard.config.support import MONITORS
from zeroshard.config.zero_schema import OffloadOptimizerConfig, OffloadParamConfig, ZeroConfig
from zeroshard.policies import (
    ActivationOffloadPolicy, AioPolicy, BatchPolicy, CommsLoggerPolicy, ConfigError, GradientReducePolicy,
    LossScalePolicy, NotSupportedYetError, OffloadDevice, OffloadPolicy,
    OptimizerSpec, Precision, PrecisionPolicy, RuntimePolicy, SchedulerSpec, Settings, Stage,
    Stage3Policy, ZeroPlusPlusPolicy, ZeroPolicy,
)


def precision_policy(config: RootConfig) -> PrecisionPolicy:
    fp16 = config.fp16 is not None and config.fp16.enabled
    bf16 = config.bf16 is not None and config.bf16.enabled
    if fp16 and bf16:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable at most one of them")
    comm = Precision(config.communication_data_type) if config.communication_data_type else None
    # a 16-bit model's gradients accumulated in fp32 (stages 1-3; support.py refuses the others)
    accum = Precision.FP32 if (fp16 or bf16) and config.stage in (1, 2, 3) and _fp32_accum(config) else None
    if fp16:
        scale = _same_named(LossScalePolicy, config.fp16, static_scale=config.fp16.loss_scale)
        return PrecisionPolicy(compute=Precision.FP16, reduce=comm or Precision.FP16, loss_scale=scale,
                               grad_accum=accum)
    if bf16:
        return PrecisionPolicy(compute=Precision.BF16, reduce=comm or Precision.BF16, grad_accum=accum)
    autocast = config.torch_autocast is not None and config.torch_autocast.enabled
    fp16_autocast = autocast and autocast_dtype(config.torch_autocast.dtype) == "float16"
    return PrecisionPolicy(compute=Precision.FP32, reduce=comm or Precision.FP32,
                           loss_scale=TORCH_GRAD_SCALER if fp16_autocast else None)


# DeepSpeed's loss scaling for torch_autocast in float16 at every stage: torch.amp.GradScaler()
TORCH_GRAD_SCALER = LossScalePolicy(rule="torch")


def _fp32_accum(config: RootConfig) -> bool:
    name = config.data_types.grad_accum_dtype if config.data_types else None
    return name in ("fp32", "float32", "float", "torch.float32")


def gradient_reduce_policy(config: RootConfig) -> tuple[GradientReducePolicy, list[str]]:
    """`gradient_allreduce_op`, `prescale_gradients`, `gradient_predivide_factor` as DeepSpeed 0.19.8
    applies them, refusing what it refuses (runtime/config.py _do_error_check; the asserts of
    zero/stage_1_and_2.py and stage3.py with reduce_scatter), with a note where one has no effect."""
    zero, f = config.zero, config.gradient_predivide_factor
    average = config.gradient_allreduce_op == "mean"
    scaled = [text for text, on in (("prescale_gradients = true", config.prescale_gradients),
                                    (f"gradient_predivide_factor = {f:g}", f != 1.0)) if on]
    if not average and zero.stage == 3:
        raise ConfigError('gradient_allreduce_op = "sum" is not supported with ZeRO stage 3 (DeepSpeed refuses it '
                          'too); use "mean", or stage 0-2')
    if average and scaled and zero.stage in (2, 3) and zero.reduce_scatter:
        raise ConfigError(f"{', '.join(scaled)}: not supported at ZeRO stage {zero.stage} with "
                          "zero_optimization.reduce_scatter (DeepSpeed 0.19.8 refuses it too); set "
                          "zero_optimization.reduce_scatter to false, or remove it")
    if scaled and not average:
        return GradientReducePolicy(average=False), [f"ignored: {', '.join(scaled)} with gradient_allreduce_op "
                                                     '"sum" (DeepSpeed ignores them then too)']
    if scaled and zero.stage == 1 and zero.reduce_scatter:  # DeepSpeed's reduce-scatter divides first, always
        notes = [f"ignored: gradient_predivide_factor = {f:g} at stage 1 with reduce_scatter (DeepSpeed divides "
                 "by the world size before its reduce-scatter and ignores it, and so does zeroshard)"] if f != 1 else []
        return GradientReducePolicy(prescale=True), notes
    notes = ([f"ignored: gradient_predivide_factor = {f:g} with prescale_gradients = true (DeepSpeed divides by "
              "the world size before the sum then, ignoring it, and so does zeroshard)"]
             if config.prescale_gradients and f != 1 else [])
    return GradientReducePolicy(average=average, prescale=config.prescale_gradients, predivide_factor=f), notes


def _same_named(policy: type, block: Any, **given: Any) -> Any:
    """`policy` (a dataclass) with the value of every field `block` has under the same name, then `given`."""
    same = {f.name: getattr(block, f.name) for f in dataclasses.fields(policy) if f.name in type(block).model_fields}
    return policy(**{**same, **given})


def _offload(block: OffloadParamConfig | OffloadOptimizerConfig | None, default: OffloadPolicy) -> OffloadPolicy:
    if block is None:
        return default
    return _same_named(OffloadPolicy, block, device=OffloadDevice(block.device))


def zero_policy(zero: ZeroConfig) -> ZeroPolicy:
    stage, default = zero.stage, ZeroPolicy()
    zeropp = ZeroPlusPlusPolicy(
        quantized_weights=zero.zero_quantized_weights, quantized_gradients=zero.zero_quantized_gradients,
        quantized_nontrainable_weights=zero.zero_quantized_nontrainable_weights,
        hpz_partition_size=max(1, zero.zero_hpz_partition_size))
    units = tuple(zero.leaf_module.classes) if zero.leaf_module else ()
    return _same_named(
        ZeroPolicy, zero, stage=Stage(stage),
        overlap_comm=default.overlap_comm if zero.overlap_comm is None else zero.overlap_comm,
        offload_optimizer=_offload(zero.offload_optimizer if stage >= 1 else None, default.offload_optimizer),
        offload_param=_offload(zero.offload_param if stage == 3 else None, default.offload_param),
        stage3=_same_named(Stage3Policy, zero, unit_classes=units) if stage == 3 else Stage3Policy(),
        zeropp=zeropp if stage == 3 else ZeroPlusPlusPolicy(),
    )


def _with_runtime_stage3(zero: ZeroPolicy, runtime) -> ZeroPolicy:
    """The `zeroshard` block's stage-3 unit knobs join the stage-3 policy."""
    if zero.stage != Stage.PARAMETERS or runtime is None:
        return zero
    classes = tuple(runtime.stage3_unit_classes or ()) or zero.stage3.unit_classes
    stage3 = dataclasses.replace(zero.stage3, unit_classes=classes, min_unit_params=runtime.stage3_min_unit_params)
    return dataclasses.replace(zero, stage3=stage3)


def activation_policy(config: RootConfig) -> ActivationOffloadPolicy:
    """`activation_checkpointing.cpu_checkpointing` (DeepSpeed's host variant) and
    `zeroshard.activation_offload` (cpu or nvme) into one policy; contradictions are errors."""
    cpu = bool(config.activation_checkpointing and config.activation_checkpointing.cpu_checkpointing)
    block = config.zeroshard.activation_offload if config.zeroshard is not None else None
    if block is None or "device" not in block.model_fields_set:
        if block is not None and block.nvme_path:
            raise ConfigError("zeroshard.activation_offload.nvme_path is set but device is not: add "
                              '"device": "nvme" (or remove nvme_path)')
        if cpu:
            return ActivationOffloadPolicy(device=OffloadDevice.CPU, why="activation_checkpointing.cpu_checkpointing")
        return ActivationOffloadPolicy()
    device = OffloadDevice(block.device)
    key = "zeroshard.activation_offload.device"
    if device == OffloadDevice.NONE and cpu:
        raise ConfigError(f'{key} = "none" contradicts activation_checkpointing.cpu_checkpointing = true; '
                          'remove one of them (or set device "cpu" / "nvme")')
    if device != OffloadDevice.NVME and block.nvme_path:
        raise ConfigError(f'zeroshard.activation_offload.nvme_path is set but {key} = "{device.value}"; '
                          'set device "nvme" to write checkpointed activations there, or remove nvme_path')
    if device != OffloadDevice.NVME:
        return ActivationOffloadPolicy(device=device, buffer_count=block.buffer_count, why=key)
    path, why = block.nvme_path, key
    if not path:  # the run's NVMe folder, when the optimizer or parameters already use one
        zero = config.zero
        for name, off in (("offload_param", zero.offload_param), ("offload_optimizer", zero.offload_optimizer)):
            if off is not None and off.device == "nvme" and off.nvme_path:
                path, why = off.nvme_path, f"{key} (nvme_path from zero_optimization.{name}.nvme_path)"
                break
    if not path:
        raise ConfigError(f'{key} = "nvme" needs a folder: set zeroshard.activation_offload.nvme_path to a '
                          "directory on a fast local drive (or use offload_optimizer/offload_param nvme with "
                          'an nvme_path, which it then shares), or choose device "cpu"')
    if block.buffer_count < 2:
        raise ConfigError(f"zeroshard.activation_offload.buffer_count = {block.buffer_count}: the NVMe variant "
                          "needs at least 2 host buffers (one being written or read, one being used)")
    return ActivationOffloadPolicy(device=device, nvme_path=path, buffer_count=block.buffer_count, why=why)


def runtime_policy(config: RootConfig) -> RuntimePolicy:
    """The `zeroshard` block; DeepSpeed's `fp16.auto_cast` (cast floating forward inputs to fp16,
    engine.forward's _cast_inputs_half) is zeroshard's `cast_forward_inputs`."""
    block = config.zeroshard
    policy = _same_named(RuntimePolicy, block) if block is not None else RuntimePolicy()
    if config.fp16 is not None and config.fp16.enabled and config.fp16.auto_cast:
        if block is not None and "cast_forward_inputs" in block.model_fields_set and not block.cast_forward_inputs:
            raise ConfigError("fp16.auto_cast = true asks to cast the forward inputs to fp16, but "
                              "zeroshard.cast_forward_inputs = false says not to; remove one of them")
        policy = dataclasses.replace(policy, cast_forward_inputs=True)
    if config.torch_autocast is not None and config.torch_autocast.enabled:
        check_autocast(config)
        policy = dataclasses.replace(policy, autocast=autocast_dtype(config.torch_autocast.dtype))
    return policy


# DeepSpeed's DtypeEnum spellings (deepspeed/runtime/config.py)
_AUTOCAST_NAMES = {**dict.fromkeys(("torch.bfloat16", "bf16", "bfloat16"), "bfloat16"),
                   **dict.fromkeys(("torch.float16", "fp16", "float16", "half"), "float16")}


def autocast_dtype(name: str | None) -> str:
    """`torch_autocast.dtype` as a torch dtype name; unset: "default", torch.autocast's default
    for the device (float16 on CUDA, bfloat16 on the CPU; api/surface.resolve_autocast), as
    DeepSpeed leaves it to torch."""
    if name is None:
        return "default"
    dtype = _AUTOCAST_NAMES.get(str(name))
    if dtype is None:
        raise ConfigError(f"torch_autocast.dtype = {name!r} is not a dtype autocast runs in: use \"bfloat16\" "
                          "(DeepSpeed also spells it \"bf16\" or \"torch.bfloat16\")")
    return dtype


def check_autocast(config: RootConfig) -> None:
    """torch_autocast in float16 scales the loss with torch's GradScaler over fp32 parameters; a
    16-bit model under it (the fp16 section's own scaler, or bf16 weights) is not built."""
    if config.torch_autocast is None or not config.torch_autocast.enabled:
        return
    if config.zero.zero_quantized_weights:
        raise ConfigError("torch_autocast with zero_optimization.zero_quantized_weights: DeepSpeed refuses this "
                          "pair (\"Cannot enable both torch autocast and zero quantized weights\"); disable one")
    if autocast_dtype(config.torch_autocast.dtype) != "float16":
        return
    model = "fp16" if config.fp16 is not None and config.fp16.enabled else (
        "bf16" if config.bf16 is not None and config.bf16.enabled else None)
    if model is not None:
        raise NotSupportedYetError(f"torch_autocast in float16 with {model}.enabled is not built: zeroshard serves "
                                   "it over fp32 parameters (DeepSpeed's GradScaler); disable the "
                                   f"{model} section, or set torch_autocast.dtype to \"bfloat16\"")


def build_notes(config: RootConfig) -> list[str]:
    notes: list[str] = gradient_reduce_policy(config)[1]
    if config.gradient_clipping is None:
        notes.append("gradient_clipping not set: zeroshard does not clip gradients (DeepSpeed 0.19 defaults "
                     "to 1.0; add \"gradient_clipping\": 1.0 to match it)")
    if config.torch_autocast is not None and config.torch_autocast.enabled:
        notes.append("torch_autocast: the forward runs under torch.autocast; parameters, gradients and their "
                     "reduction stay fp32 (DeepSpeed reduces the gradients of its lower_precision_safe_modules "
                     "in the autocast dtype at stages 1-2: zeroshard's are exact, at twice the bytes), so "
                     "torch_autocast.lower_precision_safe_modules has no effect")
        if autocast_dtype(config.torch_autocast.dtype) == "float16":
            notes.append("torch_autocast in float16: the loss is scaled as DeepSpeed does, with torch.amp.GradScaler's "
                         "defaults and rule; a step whose gradients overflow on any rank is skipped on every rank "
                         "(DeepSpeed's GradScaler at stages 1-3 looks only at its own rank's partition)")
    zero = config.zero
    if zero.stage in (1, 2) and zero.overlap_comm is None:
        notes.append("zero_optimization.overlap_comm not set: zeroshard overlaps gradient reduction with "
                     "backward at every stage (DeepSpeed's default is false at stages 1/2; results are the same)")
    if not zero.compute_grad_norm and (config.gradient_clipping or 0.0) > 0:
        notes.append(f"gradient_clipping = {config.gradient_clipping} has no effect: "
                     "zero_optimization.compute_grad_norm is false, so no gradient norm is computed")
    return notes


def build_settings(config: RootConfig, batch: BatchPolicy, raw: dict[str, Any], notes: list[str]) -> Settings:
    opt, sched = config.optimizer, config.scheduler  # "auto" params were dropped by normalize
    logger, runtime = config.comms_logger, config.zeroshard
    return Settings(
        batch=batch, precision=precision_policy(config), zero=_with_runtime_stage3(zero_policy(config.zero), runtime),
        optimizer=_optimizer_spec(config),
        scheduler=SchedulerSpec(type=sched.type, params=dict(sched.params)) if sched is not None else None,
        gradient_clipping=float(config.gradient_clipping or 0.0), steps_per_print=config.steps_per_print,
        gradient_reduce=gradient_reduce_policy(config)[0],
        wall_clock_breakdown=config.wall_clock_breakdown,
        comms_logger=CommsLoggerPolicy(enabled=logger.enabled) if logger is not None else CommsLoggerPolicy(),
        monitors=tuple((name, tuple(getattr(config, name).model_dump().items())) for name in MONITORS
                       if getattr(config, name) is not None and getattr(config, name).enabled),
        aio=_same_named(AioPolicy, config.aio) if config.aio is not None else AioPolicy(),
        runtime=runtime_policy(config),
        activations=activation_policy(config), raw=raw, notes=tuple(notes))


def _optimizer_spec(config: RootConfig) -> OptimizerSpec | None:
    """The `optimizer` section, refusing what DeepSpeed 0.19.8 refuses with Muon (stage3.py:
    "Muon and reduce scatter cannot be used together", and with qgZ's all-to-all group)."""
    opt, zero = config.optimizer, config.zero
    if opt is None:
        return None
    if opt.type.lower() == "muon" and zero.stage == 3:
        knob = ("zero_quantized_gradients" if zero.zero_quantized_gradients
                else "reduce_scatter" if zero.reduce_scatter else None)
        if knob:
            raise ConfigError(f"optimizer Muon at ZeRO stage 3 with zero_optimization.{knob} = true: DeepSpeed "
                              f"refuses this combination too; set zero_optimization.{knob} to false (reduce_scatter "
                              "defaults to true), or use stage 0-2")
    if opt.type.lower() == "muon" and zero.offload_optimizer is not None and zero.offload_optimizer.device == "nvme":
        raise NotSupportedYetError("optimizer Muon with offload_optimizer.device nvme is not built by zeroshard yet; "
                                   'use offload_optimizer.device "cpu" or "none"')
    return OptimizerSpec(type=opt.type.lower(), params=dict(opt.params))
