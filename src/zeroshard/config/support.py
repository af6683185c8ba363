"""What zeroshard has not built yet, and what it reads but ignores. One table each.

When a feature lands, remove its row from `GAPS` (or move the optimizer / scheduler
name to `BUILT_OPTIMIZERS` / `BUILT_SCHEDULERS` in `names.py`). Nothing else in the
config layer needs to change.

Rules:
* A gap whose key is set to a value that would take effect at the chosen stage
  raises `NotSupportedYetError` (all gaps of a config in one message).
* A key that cannot take effect at the chosen stage (stage-3 knobs, `offload_param`
  and ZeRO++ at stage 1/2, offload at stage 0) is not an error: DeepSpeed ignores it
  too, and users' stage-2 configs often carry stage-3 keys. It becomes a note
  "ignored at stage N: ...".
* Monitors, profilers, autotuning, DeepSpeed's checkpoint engine and activation
  checkpointing API, logging knobs: accepted, because they never change what is
  trained. When one is switched on, a note says zeroshard ignores it. Refusing
  them would make users edit working configs for no gain in correctness.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable

from zeroshard.config.fields import shown
from zeroshard.config.foreign import inert_notes, refusals
from zeroshard.config.names import BUILT_OPTIMIZERS, BUILT_SCHEDULERS
from zeroshard.config.schema import RootConfig
from zeroshard.policies import (
    MONITOR_LIBRARIES, ONEBIT_KINDS, ONEBIT_SHARDED, ConfigError, NotSupportedYetError, onebit_notes,
)

ALL_STAGES = frozenset({0, 1, 2, 3})
ZERO_STAGES = frozenset({1, 2, 3})


def version() -> str:
    try:
        return metadata.version("zeroshard")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "(development)"


@dataclass(frozen=True)
class Gap:
    """A setting zeroshard accepts in the schema but has not built."""

    path: str
    value: Callable[[RootConfig], Any]  # the offending value, or None when off / default
    fix: str  # what to set instead
    stages: frozenset[int] = ALL_STAGES  # stages at which the key takes effect


def _device(block: Any) -> str | None:
    return block.device if block is not None and block.device != "none" else None


def _when(flag: bool, value: Any = True) -> Any:
    return value if flag else None


def _enabled(block: Any) -> Any:
    return block if block is not None and block.enabled else None


_DTYPE_NAMES = {  # DeepSpeed's DtypeEnum spellings
    "fp32": ("fp32", "float32", "float", "torch.float32"), "fp16": ("fp16", "float16", "half", "torch.float16"),
    "bf16": ("bf16", "bfloat16", "torch.bfloat16"), "int8": ("int8", "torch.int8"),
}


def _grad_accum_other(c: RootConfig) -> str | None:
    """`data_types.grad_accum_dtype` when it differs from the model's dtype (the same dtype is
    what zeroshard, and DeepSpeed by default, accumulate in). DeepSpeed refuses a different one
    at stage 0 ("unsupported mix"); at stages 1-3 it accumulates in it, which zeroshard builds for
    fp32 (stage 1: a full fp32 accumulator, stages/accumulated_gradients.py; stages 2-3: fp32
    shard accumulators) and not for a 16-bit type other than the model's."""
    name = c.data_types.grad_accum_dtype if c.data_types else None
    if name is None:
        return None
    dtype = next((k for k, names in _DTYPE_NAMES.items() if name in names), None)
    if dtype is None:
        raise ConfigError(f"data_types.grad_accum_dtype = {name!r}: expected fp32, fp16 or bf16")
    model = "fp16" if _enabled(c.fp16) else "bf16" if _enabled(c.bf16) else "fp32"
    if dtype == model or (dtype == "fp32" and c.stage in (1, 2, 3)):
        return None
    if c.stage == 0:
        raise ConfigError(f"data_types.grad_accum_dtype = {name!r} with a {model} model at stage 0: DeepSpeed "
                          "refuses this mix too (NotImplementedError); remove it, or use ZeRO stage 1-3")
    return name


def _unbuilt(block: Any, built: tuple[str, ...], spelling: Callable[[str], str] = str) -> str | None:
    """The `type` of an optimizer / scheduler block when zeroshard has not built it."""
    return block.type if block is not None and spelling(block.type) not in built else None


_Z = "zero_optimization."
GAPS: tuple[Gap, ...] = (
    Gap(_Z + "zenflow", lambda c: _when(c.zero.zenflow is not None, "{...}"), "nothing (remove the block)",
        ZERO_STAGES),
    Gap("fp16.fp16_master_weights_and_grads",
        lambda c: _when(bool(_enabled(c.fp16) and c.fp16.fp16_master_weights_and_grads)), "false"),
    Gap("bf16.bf16_master_weights_and_grads",
        lambda c: _when(bool(_enabled(c.bf16) and c.bf16.bf16_master_weights_and_grads)), "false"),
    Gap("bf16.bf16_optimizer_states",
        lambda c: _when(bool(_enabled(c.bf16) and c.bf16.bf16_optimizer_states)), "false"),
    Gap("data_types.grad_accum_dtype", lambda c: _grad_accum_other(c), "null, fp32 or the model's dtype",
        frozenset({1, 2, 3})),
    Gap("managed_gradient_accumulation", lambda c: _when(not c.managed_gradient_accumulation, False), "true"),
    Gap("activation_checkpointing.partition_activations",
        lambda c: _when(bool(c.activation_checkpointing and c.activation_checkpointing.partition_activations)),
        "false"),
    Gap("compile.deepcompile", lambda c: _when(bool(c.compile and c.compile.deepcompile)),
        "false (DeepCompile's graph passes are DeepSpeed's; engine.compile() compiles each unit in place)"),
    Gap("compile.autoep_non_moe", lambda c: _when(bool(c.compile and c.compile.autoep_non_moe)),
        "false (zeroshard has no AutoEP layers; engine.compile() compiles each unit in place)"),
    Gap("optimizer.type", lambda c: _unbuilt(c.optimizer, BUILT_OPTIMIZERS, str.lower),
        "one of " + ", ".join(BUILT_OPTIMIZERS)),
    Gap("scheduler.type", lambda c: _unbuilt(c.scheduler, BUILT_SCHEDULERS), "one of " + ", ".join(BUILT_SCHEDULERS)),
)

# zero_optimization keys that take effect only at stage 3 (DeepSpeed ignores them below it).
STAGE3_ONLY_KEYS = (
    "prefetch_bucket_size", "param_persistence_threshold", "model_persistence_threshold",
    "max_live_parameters", "max_reuse_distance", "gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params", "allgather_sequential",
    "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "leaf_module", "sub_group_size",
    "offload_param", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
)


MONITORS = ("tensorboard", "csv_monitor", "wandb", "comet")


def check_monitor_libraries(config: RootConfig) -> None:
    """A monitor section enabled without its library: one error when the config loads (before
    any rank starts under `zeroshard train` / `launch`), not a crash at the first step."""
    for name in MONITORS:
        section = getattr(config, name)
        module, package = MONITOR_LIBRARIES.get(name, (None, None))
        if section is not None and section.enabled and module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{name}.enabled is true but the {package!r} package is not installed: "
                              f"pip install {package} (or pip install 'zeroshard[monitor]'), or disable {name}")


# zero_optimization keys that stage 0 (all-reduced gradients, whole parameters) never reads.
ZERO_ONLY_KEYS = ("reduce_scatter", "allgather_bucket_size", "allgather_partitions", "contiguous_gradients",
                  "use_multi_rank_bucket_allreduce", "round_robin_gradients", "compute_grad_norm")


def _zeropp_in_use(c: RootConfig) -> list[str]:
    """The ZeRO++ keys set to a value that turns something on."""
    z = c.zero
    on = [(z.zero_quantized_weights, "zero_quantized_weights = true"),
          (z.zero_quantized_nontrainable_weights, "zero_quantized_nontrainable_weights = true"),
          (z.zero_quantized_gradients, "zero_quantized_gradients = true"),
          (z.zero_hpz_partition_size > 1, f"zero_hpz_partition_size = {z.zero_hpz_partition_size}")]
    return [_Z + text for hit, text in on if hit]


def _onebit(config: RootConfig) -> list[str]:
    """The 1-bit family (optim/onebit.py) at stage 0 only, as DeepSpeed ("1bit-Adam is not compatible
    with ZeRO"); the notes for its keys that have no effect here."""
    kind = config.optimizer.type.lower() if config.optimizer is not None else ""
    if kind not in ONEBIT_KINDS:
        return []
    if config.stage != 0:
        raise ConfigError(f"optimizer {config.optimizer.type} at zero_optimization.stage {config.stage}: "
                          + ONEBIT_SHARDED)
    return onebit_notes(config.optimizer.type, dict(config.optimizer.params))


def check_support(config: RootConfig) -> list[str]:
    """Raise NotSupportedYetError for every unbuilt feature in use; return "ignored at stage" notes."""
    stage = config.stage
    errors: list[str] = []
    ignored: list[str] = []
    for gap in GAPS:
        value = gap.value(config)
        if value is None:
            continue
        if stage not in gap.stages:
            ignored.append(f"{gap.path} = {shown(value)}")
            continue
        errors.append(f"{gap.path} = {shown(value)}: not supported yet by zeroshard {version()}; "
                      f"remove it or set it to {gap.fix}")
    errors += refusals(config, version())
    if errors:
        raise NotSupportedYetError("\n".join(errors))
    notes = _onebit(config)
    check_monitor_libraries(config)
    zeropp = _zeropp_in_use(config)
    if zeropp and stage != 3:
        raise ConfigError(
            f"{', '.join(zeropp)}: ZeRO++ (qwZ, hpZ, qgZ) works on stage 3's parameter gathers and gradient "
            f"reduce-scatter, but zero_optimization.stage is {stage}; set stage 3, or remove these keys")
    for name, lowest in (("offload_optimizer", 1), ("offload_param", 3)):  # host offload is built
        device = _device(getattr(config.zero, name))
        if device and stage < lowest and f"{_Z}{name}." not in " ".join(ignored):
            ignored.append(f"{_Z}{name}.device = {shown(device)}")
    if stage < 3 and config.zero_optimization is not None:
        set_keys = config.zero_optimization.model_fields_set
        already = " ".join(ignored)
        ignored += [_Z + key for key in STAGE3_ONLY_KEYS + (ZERO_ONLY_KEYS if stage == 0 else ())
                    if key in set_keys and _Z + key not in already]
    if not ignored:
        return notes
    return notes + [f"ignored at stage {stage}: " + ", ".join(ignored)
            + " (they take effect only at a higher stage; DeepSpeed ignores them too)"]


_AC = ("number_checkpoints", "contiguous_memory_optimization", "profile", "synchronize_checkpoint_boundary")
_ZERO_NO_EFFECT = {  # key: value that differs from DeepSpeed's default and has no effect in zeroshard
    "legacy_stage1": True, "allgather_partitions": False, "elastic_checkpoint": True,
    "round_robin_gradients": True, "parameter_alignment": True,
    "use_multi_rank_bucket_allreduce": False, "load_from_fp32_weights": False,
}


_OFFLOAD_NO_EFFECT = (  # (block, key, why) for offload keys that switch nothing in zeroshard
    ("offload_param", "max_in_cpu", "zeroshard keeps no host cache of NVMe parameter shards beyond the read-ahead "
     "buffers (buffer_count x buffer_size)"),
    ("offload_optimizer", "fast_init", "zeroshard never writes zero states at start-up (a sub-group's states are "
     "made and written at its first step)"),
    *(("offload_optimizer", key, "zeroshard reads ahead and writes behind whenever buffer_count allows; the flag "
       "switches nothing") for key in ("pipeline", "pipeline_read", "pipeline_write")),
)


def _set_on(block: Any, key: str) -> bool:
    """`key` was written in an offload block that is in use."""
    return _device(block) is not None and key in block.model_fields_set


def _ignored_checks(c: RootConfig) -> list[tuple[bool, str]]:
    ac = c.activation_checkpointing
    checks = [
        (bool(c.autotuning and c.autotuning.enabled),
         "autotuning.enabled: zeroshard does not autotune (`zeroshard plan` suggests settings)"),
        (c.memory_breakdown, "memory_breakdown: zeroshard's memory ledger reports memory instead"),
        (c.dump_state, "dump_state: zeroshard prints its effective settings at start-up instead"),
        (c.dataloader_drop_last, "dataloader_drop_last: zeroshard builds no data loader"),
        (c.disable_allgather, "disable_allgather: zeroshard always all-gathers updated parameters"),
        (c.log_level is not None, "log_level: zeroshard uses Python logging; configure it there"),
        (c.checkpoint is not None and bool(c.checkpoint.model_fields_set),
         "checkpoint: zeroshard writes its own resharding checkpoints and reads DeepSpeed's, universal "
         "ones too, whatever load_universal says; DeepSpeed's checkpoint engine settings do not apply"),
        (bool(ac and any(getattr(ac, k) not in (False, None) for k in _AC)),
         "activation_checkpointing: " + ", ".join(_AC) + " have no effect in zeroshard's checkpoint function "
         "(zeroshard.checkpoint_activations / zeroshard.deepspeed.checkpointing); cpu_checkpointing does"),
        (bool(c.data_types and (c.data_types.param_dtype or c.data_types.buffer_dtype)),
         "data_types.param_dtype / buffer_dtype: zeroshard's precision comes from fp16 / bf16"),
        (bool(c.bf16 and c.bf16.immediate_grad_update), "bf16.immediate_grad_update: zeroshard reduces "
         "gradients at the accumulation boundary"),
        (bool(c.optimizer and c.optimizer.legacy_fusion), "optimizer.legacy_fusion: no effect in zeroshard"),
    ]
    zero = c.zero
    checks += [(getattr(zero, key) == value, f"zero_optimization.{key} = {shown(value)}: no effect in zeroshard")
               for key, value in _ZERO_NO_EFFECT.items()]
    checks += [(_set_on(block, key), f"zero_optimization.{name}.{key}: {why}") for name, key, why in _OFFLOAD_NO_EFFECT
               for block in (getattr(zero, name),) if c.stage >= (3 if name == "offload_param" else 1)]
    uses_nvme = "nvme" in (_device(zero.offload_optimizer), _device(zero.offload_param))
    checks.append((c.aio is not None and not uses_nvme, "aio: it configures NVMe offload only, unused here"))
    return checks


def ignored_notes(config: RootConfig) -> list[str]:
    """Notes for accepted keys that zeroshard does not act on."""
    return ["ignored: " + text for hit, text in _ignored_checks(config) if hit] + inert_notes(config)
