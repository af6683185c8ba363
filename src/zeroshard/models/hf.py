"""Hugging Face causal LMs built from a config file (no download), and LoRA adapters (peft).

`transformers` and `peft` are optional (`pip install 'zeroshard[hf]'`): they are imported
only inside these functions. Problems a user can fix raise `ModelSpecError` with a message
naming the file and what is wrong with it.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a model is built: the launcher checks a config without it
    from torch import nn

__all__ = ["ModelSpecError", "apply_lora", "build_causal_lm", "context_length", "gather_unit_classes",
           "load_causal_lm_config"]

GPT_LORA_TARGETS = ("c_attn", "c_proj", "c_fc")  # zeroshard.models.GPT's Linear layers (not the tied head)


class ModelSpecError(ValueError):
    """A model description that cannot give a trainable causal language model."""


def _import(name: str, extra: str = "hf"):
    try:
        return __import__(name)
    except ImportError:
        raise ModelSpecError(f"this needs the '{name}' package: pip install 'zeroshard[{extra}]'") from None


def load_causal_lm_config(path: str | os.PathLike):
    """The transformers config in `path` (a config.json, or a folder holding one), checked to
    describe a causal (left-to-right) language model that AutoModelForCausalLM can build."""
    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ModelSpecError(f"hf:{path}: no such config file")
    try:
        with open(file) as fh:
            raw = json.load(fh)
    except json.JSONDecodeError as exc:
        raise ModelSpecError(f"{file}: not valid JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelSpecError(f"cannot read {file}: {exc}") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else None
    if not model_type:
        raise ModelSpecError(f"{file}: no \"model_type\" key; is this a transformers config.json?")
    _import("transformers")
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    if model_type not in CONFIG_MAPPING_NAMES:
        raise ModelSpecError(f"{file}: model_type {model_type!r} is unknown to transformers "
                             f"(installed version may be too old)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelSpecError(f"{file}: model_type {model_type!r} is not a causal LM "
                             f"(AutoModelForCausalLM has no class for it)")
    config = AutoConfig.from_pretrained(file)
    if model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not getattr(config, "is_decoder", False):
        raise ModelSpecError(f"{file}: model_type {model_type!r} is an encoder (masked LM) config, not a "
                             f"causal LM; set \"is_decoder\": true to train it left to right")
    return config


def build_causal_lm(config) -> nn.Module:
    """AutoModelForCausalLM.from_config: random weights (torch's RNG), nothing downloaded."""
    from transformers import AutoModelForCausalLM

    config.use_cache = False  # training: no key/value cache
    return AutoModelForCausalLM.from_config(config)


def context_length(config) -> int | None:
    """The longest sequence the model's position embeddings cover, when it says."""
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def apply_lora(model: nn.Module, r: int, alpha: float | None = None, targets=None) -> nn.Module:
    """`model` with LoRA adapters of rank `r` (peft); only the adapters stay trainable.

    Targets: `targets` if given, else peft's defaults for a transformers model type (for
    Llama: q_proj and v_proj), else every Linear but the output head ("all-linear")."""
    _import("peft")
    from peft import LoraConfig, get_peft_model

    if r < 1:
        raise ModelSpecError(f"--lora {r}: the adapter rank must be at least 1")
    is_hf = hasattr(model, "config") and hasattr(model.config, "model_type")
    task = "CAUSAL_LM" if is_hf else None

    def config(target_modules):
        return LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r, lora_dropout=0.0,
                          target_modules=target_modules, task_type=task)

    if targets is not None:
        return get_peft_model(model, config(list(targets)))
    try:
        return get_peft_model(model, config(None))
    except ValueError:  # no peft default for this architecture
        return get_peft_model(model, config("all-linear"))


def gather_unit_classes(model: nn.Module) -> list[str]:
    """Names of the module classes that make good stage-3 gather units: the transformer
    layers transformers declares unsplittable (`_no_split_modules`), present in `model`."""
    declared: set[str] = set()
    for module in model.modules():
        declared.update(getattr(module, "_no_split_modules", None) or ())
    present = {type(m).__name__ for m in model.modules()}
    return sorted(declared & present)
