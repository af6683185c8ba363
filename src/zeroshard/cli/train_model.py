"""`zeroshard train --model`: what the name means, the model it builds, and its loss.

    mini | small | tiny | 50m    zeroshard's own GPT presets (also spelt gpt-mini, ...)
    hf:PATH/config.json          a transformers causal LM built from the config (no download)

`--lora R` adds peft LoRA adapters of rank R; only they are trained. `check_model` runs in
the launching process so a bad name or config fails before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from zeroshard.models import GPT_PRESETS, build_gpt
from zeroshard.models.hf import (
    GPT_LORA_TARGETS,
    ModelSpecError,
    apply_lora,
    build_causal_lm,
    context_length,
    gather_unit_classes,
    load_causal_lm_config,
)

__all__ = ["ModelSpecError", "TrainModel", "build_model", "check_model", "model_choices"]


def model_choices() -> str:
    return "|".join(sorted(GPT_PRESETS)) + "|hf:PATH/config.json"


@dataclass
class TrainModel:
    module: nn.Module
    label: str  # for the summary: "GPT mini", "LlamaForCausalLM (hf:cfg.json) + LoRA r=8"
    vocab_size: int
    context: int | None  # longest sequence, when known
    unit_classes: list[str]  # stage-3 gather units
    is_hf: bool

    def loss(self, engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy of the (x, y) windows through the engine."""
        if not self.is_hf:
            return engine(x, y)[1]
        # logits against our own shifted targets: the model's `labels=` would shift again
        logits = engine(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def _preset(spec: str) -> str | None:
    name = spec[4:] if spec.startswith("gpt-") else spec
    return name if name in GPT_PRESETS else None


def check_model(spec: str, seq_len: int, lora: int) -> str | None:
    """A one-line problem with `--model`/`--seq-len`/`--lora`, or None (no weights built)."""
    try:
        if spec.startswith("hf:"):
            config = load_causal_lm_config(spec[3:])
            context = context_length(config)
        elif _preset(spec):
            context = GPT_PRESETS[_preset(spec)].block_size
        else:
            return f"--model {spec}: unknown; choose {model_choices()}"
        if lora:
            if lora < 1:
                return f"--lora {lora}: the adapter rank must be at least 1"
            try:
                import peft  # noqa: F401
            except ImportError:
                return "--lora needs the 'peft' package: pip install 'zeroshard[hf]'"
    except ModelSpecError as exc:
        return str(exc)
    if context is not None and seq_len > context:
        return f"--seq-len {seq_len} exceeds the model's context ({context} positions)"
    return None


def build_model(spec: str, lora: int = 0) -> TrainModel:
    """The model `spec` names, with LoRA adapters when `lora` > 0 (weights from torch's RNG)."""
    if spec.startswith("hf:"):
        config = load_causal_lm_config(spec[3:])
        module = build_causal_lm(config)
        label = f"{type(module).__name__} ({spec})"
        vocab, context, is_hf = config.vocab_size, context_length(config), True
        targets = None
    else:
        preset = _preset(spec)
        if preset is None:
            raise ModelSpecError(f"--model {spec}: unknown; choose {model_choices()}")
        module = build_gpt(preset)
        label, vocab, context, is_hf = f"GPT {preset}", module.config.vocab_size, module.config.block_size, False
        targets = GPT_LORA_TARGETS
    units = gather_unit_classes(module) if is_hf else ["Block"]
    if lora:
        module = apply_lora(module, lora, targets=targets)
        label += f" + LoRA r={lora}"
    return TrainModel(module, label, vocab, context, units, is_hf)
