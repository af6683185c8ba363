"""DeepSpeed's top-level keys beyond zeroshard's own schema.

DeepSpeed 0.19.8 (`runtime/config.py`) reads the top level loosely: a key it does not know
is ignored, and so is a dotted key such as `"zero_optimization.reduce_bucket_size"` (TRL's
`prepare_deepspeed` writes those for every ZeRO-3 reference and reward model; DeepSpeed
reads only the nested block). zeroshard loads both too, each with one note naming the key
(and the known key it is probably a typo of). Inside a block an unknown key stays an error,
as in DeepSpeed's pydantic models.

Blocks of DeepSpeed features zeroshard does not build are typed here (the same keys as
DeepSpeed's models, unknown keys inside them errors where DeepSpeed's are) and judged by
`FEATURES`: a block that is off or inert loads with a note saying it does nothing; one that
switches its feature on is one refusal naming the feature. Keys DeepSpeed 0.19 removed
(`sparse_attention`, `elasticity`, `curriculum_learning`...) are refused by `normalize`, as
DeepSpeed refuses them, even when disabled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from zeroshard.config.fields import Bool, Int, NonNegInt, PosInt, Section, Text, shown
from zeroshard.config.suggest import closest
from zeroshard.config.validation import key_homes


class HybridEngineConfig(Section):
    """`hybrid_engine` (DeepSpeed-Chat): `runtime/config.py` HybridEngineConfig, same keys and defaults."""

    enabled: Bool = False
    max_out_tokens: PosInt = 512
    inference_tp_size: Int = 1
    release_inference_cache: Bool = False
    pin_parameters: Bool = True
    tp_gather_partition_size: Int = 8
    enable_cuda_graph: Bool = False


class TensorParallelConfig(Section):
    """`tensor_parallel` (AutoTP training): `runtime/tensor_parallel/config.py` TPTrainingConfig.
    `autotp_size` 0 (DeepSpeed's default) or 1 is no tensor parallelism (the engine builds it
    only for sizes above 1); OpenRLHF writes `{"autotp_size": 1}` into every config."""

    autotp_size: NonNegInt = 0
    dtype: Any = None
    tp_overlap_comm: Bool = False
    vocab_parallel_lm_head: Bool | None = None
    vocab_parallel_ce_backend: Literal["torch", "liger"] = "torch"
    tensor_parallel: dict[str, Any] | None = None
    tp: dict[str, Any] | None = None  # DeepSpeed's alias of tensor_parallel
    injection_policy_tuple: Any = None
    partition_config: dict[str, Any] | None = None
    preset_model: Text | None = None
    keep_module_on_host: Bool = False
    replace_with_kernel_inject: Bool = False
    kernel_inject: Bool | None = None  # DeepSpeed's alias of replace_with_kernel_inject


# Fields RootConfig adds for these keys: name -> (type, default). Blocks DeepSpeed reads with
# `dict.get` (no unknown-key check) are plain mappings here too.
ROOT_FIELDS: dict[str, tuple[Any, Any]] = {
    "hybrid_engine": (HybridEngineConfig | None, None),
    "tensor_parallel": (TensorParallelConfig | None, None),
    "data_efficiency": (dict[str, Any] | None, None),
    "pipeline": (dict[str, Any] | None, None),
    "expert_parallel": (dict[str, Any] | None, None),
    "weight_quantization": (dict[str, Any] | None, None),
    "timers": (dict[str, Any] | None, None),
    "datastates_ckpt": (Any, None),
    "sequence_parallel_size": (PosInt | None, None),
    "seq_parallel_communication_data_type": (Text | None, None),
    "disable_python_gc": (Any, None),
    "use_data_before_expert_parallelism": (Bool | None, None),
    "vocabulary_size": (Any, None),
}


def triage_top_level(data: dict[str, Any], known: tuple[str, ...], root: type[Section], notes: list[str]) -> None:
    """Remove the top-level keys DeepSpeed would ignore (unknown or dotted), one note each."""
    dotted = [key for key in data if key not in known and "." in key]
    for key in dotted:
        del data[key]
    if dotted:
        notes.append(
            "ignored: dotted top-level key(s) " + ", ".join(repr(k) for k in dotted) + ": DeepSpeed reads only "
            "the nested blocks and ignores these too (TRL's prepare_deepspeed writes them), so they change "
            "nothing; to set one, write it inside its block")
    for key in [k for k in data if k not in known]:
        value = data.pop(key)
        text = f"ignored: unknown top-level key {key!r}"
        homes = [h for h in key_homes(root, key) if h != "the top level"]
        match = None if key.startswith("_") else closest(key, known, cutoff=0.75)
        if 0 < len(homes) <= 3:
            text += f" (it belongs in {' or '.join(homes)}; DeepSpeed ignores it here too)"
        elif match is not None:
            text += f"; did you mean {match!r}? (DeepSpeed ignores unknown top-level keys too)"
        else:
            text += f" = {shown(value, 40)} (DeepSpeed ignores unknown top-level keys too)"
        notes.append(text)


def _truthy(value: Any) -> bool:
    """DeepSpeed tests these flags for truth as given; a string spelling false is read as false."""
    if isinstance(value, str):
        return value.strip().lower() not in ("", "false", "no", "off", "0")
    return bool(value)


def _enabled_paths(node: Any, path: str) -> list[str]:
    """Dotted paths of every `enabled` key set true below `node`."""
    if not isinstance(node, dict):
        return []
    found = [f"{path}.enabled = {shown(node['enabled'])}"] if _truthy(node.get("enabled")) else []
    for key, value in node.items():
        found += _enabled_paths(value, f"{path}.{key}")
    return found


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 1


@dataclass(frozen=True)
class Feature:
    """A DeepSpeed top-level key zeroshard does not build: `on` gives the settings that switch
    the feature on ("path = value" strings; empty when inert)."""

    key: str
    what: str  # the feature, as DeepSpeed names it
    on: Callable[[Any], list[str]]
    fix: str
    inert: str  # why the block does nothing when off, for the note


def _hybrid(block: HybridEngineConfig) -> list[str]:
    """Only tensor-parallel inference is refused: `engine.generate()` is served (engine.generation)."""
    return [f"hybrid_engine.inference_tp_size = {block.inference_tp_size}"] if block.enabled and \
        block.inference_tp_size > 1 else []


HYBRID_NOTE = ("hybrid_engine.enabled: engine.generate() runs the model's generate with each stage-3 unit gathered "
               "once for all tokens (engine.generation) and everything released after it; max_out_tokens, "
               "pin_parameters, tp_gather_partition_size, release_inference_cache and enable_cuda_graph have no "
               "effect (DeepSpeed's inference kernels and caches are not built)")


def _expert(block: dict[str, Any]) -> list[str]:
    size = block.get("autoep_size", 1)
    return ([f"expert_parallel.enabled = {shown(block['enabled'])}"] if _truthy(block.get("enabled")) else []) + (
        [f"expert_parallel.autoep_size = {shown(size)}"] if _positive(size) else [])


def _weights(block: dict[str, Any]) -> list[str]:
    return [f"weight_quantization.{k} = {shown(block[k], 40)}" for k in ("quantized_initialization", "post_init_quant")
            if block.get(k)]


FEATURES: tuple[Feature, ...] = (
    Feature("hybrid_engine", "tensor-parallel inference in DeepSpeed-Chat's hybrid engine",
            _hybrid, "set inference_tp_size to 1 (engine.generate() is served without it)", "enabled is false"),
    Feature("tensor_parallel", "tensor parallelism (DeepSpeed AutoTP): it shards over data parallelism only",
            lambda b: [f"tensor_parallel.autotp_size = {b.autotp_size}"] if b.autotp_size > 1 else [],
            "set autotp_size to 1 (or 0) or remove the block", "autotp_size 0/1 is no tensor parallelism"),
    Feature("data_efficiency", "DeepSpeed's data efficiency library (curriculum learning, random-LTD: they "
            "work through DeepSpeed's own data loader and layers)",
            lambda b: _enabled_paths(b, "data_efficiency"), 'set every "enabled" in it to false or remove the block',
            "nothing in it is enabled"),
    Feature("expert_parallel", "expert parallelism (DeepSpeed AutoEP)", _expert,
            'set "enabled": false and autoep_size 1, or remove the block', "it is not enabled"),
    Feature("sequence_parallel_size", "sequence parallelism (DeepSpeed Ulysses)",
            lambda v: [f"sequence_parallel_size = {v}"] if v > 1 else [], "set it to 1 or remove it", "it is 1"),
    Feature("weight_quantization", "quantized weight initialization (ZeRO-Inference)", _weights,
            "remove quantized_initialization / post_init_quant", "it quantizes nothing"),
    Feature("pipeline", "pipeline parallelism", lambda b: [], "",
            "DeepSpeed reads it only for a PipelineModule, which zeroshard does not build"),
    Feature("timers", "DeepSpeed's throughput timer", lambda b: [], "",
            "zeroshard's step line and wall_clock_breakdown report time instead"),
    Feature("datastates_ckpt", "the DataStates checkpoint engine", lambda b: [], "",
            "zeroshard writes its own checkpoints"),
    Feature("seq_parallel_communication_data_type", "sequence-parallel communication", lambda b: [], "",
            "there is no sequence parallelism"),
    Feature("disable_python_gc", "DeepSpeed's garbage-collection control", lambda b: [], "",
            "it changes no result; call gc yourself if you need to"),
    Feature("use_data_before_expert_parallelism", "expert-parallel group order", lambda b: [], "",
            "there is no expert parallelism"),
    Feature("vocabulary_size", "DeepSpeed's tensor-core alignment warning", lambda b: [], "",
            "DeepSpeed only warns with it"),
)


def refusals(config: Any, version: str) -> list[str]:
    """One line per feature switched on: what it is, that zeroshard does not build it, the fix."""
    lines = []
    for feature in FEATURES:
        value = getattr(config, feature.key)
        on = feature.on(value) if value is not None else []
        if on:
            lines.append(f"{', '.join(on)}: zeroshard {version} does not build {feature.what}; {feature.fix}")
    return lines


def inert_notes(config: Any) -> list[str]:
    """A note per block of these features that is present but does nothing."""
    return [HYBRID_NOTE if feature.key == "hybrid_engine" and getattr(config, feature.key).enabled else
            f"ignored: {feature.key} ({feature.inert})" for feature in FEATURES
            if getattr(config, feature.key) is not None and feature.key in config.model_fields_set]
