"""`zeroshard train --model`: what the name means, the model it builds, and its loss.

    mini | small | tiny | 50m    zeroshard's own GPT presets (also spelt gpt-mini, ...)
    hf:PATH/config.json          a transformers causal LM built from the config (no download)

`--lora R` adds peft LoRA adapters of rank R; only they are trained. `check_model` runs in
the launching process so a bad name or config fails before any rank starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from zeroshard.models.presets import GPT_PRESETS, model_choices
from zeroshard.models.hf import (
    GPT_LORA_TARGETS, ModelSpecError, apply_lora, build_causal_lm, context_length, gather_unit_classes,
    load_causal_lm_config,
)

if TYPE_CHECKING:  # torch only where a model is built: the launcher's checks run without it (~1.5 s)
    import torch
    from torch import nn

__all__ = ["ModelSpecError", "TrainModel", "build_model", "check_model", "default_seq_len", "model_choices",
           "model_shape"]


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
        import torch.nn.functional as F

        if not self.is_hf:
            return engine(x, y)[1]
        # logits against our own shifted targets: the model's `labels=` would shift again
        logits = engine(input_ids=x).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1))


def _resolve(spec: str):
    """(its transformers config, None) for hf:PATH, (None, the preset's name) for a GPT preset;
    ModelSpecError for anything else."""
    if spec.startswith("hf:"):
        return load_causal_lm_config(spec[3:]), None
    name = spec[4:] if spec.startswith("gpt-") else spec
    if name not in GPT_PRESETS:
        raise ModelSpecError(f"--model {spec}: unknown; choose {model_choices()}")
    return None, name


def check_model(spec: str, seq_len: int, lora: int) -> str | None:
    """A one-line problem with `--model`/`--seq-len`/`--lora`, or None (no weights built)."""
    try:
        config, preset = _resolve(spec)
        context = context_length(config) if preset is None else GPT_PRESETS[preset].block_size
        if lora is not None:
            if lora < 1:
                return (f"--lora {lora}: the adapter rank must be at least 1 (leave out --lora to train every "
                        "parameter)")
            try:
                import peft  # noqa: F401
            except ImportError:
                return "--lora needs the 'peft' package: pip install 'zeroshard[hf]'"
    except ModelSpecError as exc:
        return str(exc)
    if context is not None and seq_len > context:
        return f"--seq-len {seq_len} exceeds the model's context ({context} positions)"
    return None


def model_shape(spec: str) -> dict[str, int] | None:
    """hidden, heads, layers, vocab and context of the model `spec` names (no weights built), or None."""
    try:
        c, preset = _resolve(spec)
        if preset is None:
            values = {"hidden": getattr(c, "hidden_size", None), "heads": getattr(c, "num_attention_heads", None),
                      "layers": getattr(c, "num_hidden_layers", None), "vocab": getattr(c, "vocab_size", None),
                      "context": context_length(c)}
        else:
            c = GPT_PRESETS[preset]
            values = {"hidden": c.n_embd, "heads": c.n_head, "layers": c.n_layer, "vocab": c.vocab_size,
                      "context": c.block_size}
    except ModelSpecError:
        return None
    return values if all(isinstance(values[k], int) for k in ("hidden", "heads", "layers", "vocab")) else None


def default_seq_len(spec: str, wanted: int = 64) -> int:
    """`wanted`, or the model's context when that is shorter (`tiny` covers 16 positions)."""
    shape = model_shape(spec)
    context = shape.get("context") if shape else None
    return min(wanted, context) if isinstance(context, int) and context > 0 else wanted


def build_model(spec: str, lora: int = 0) -> TrainModel:
    """The model `spec` names, with LoRA adapters when `lora` > 0 (weights from torch's RNG)."""
    from zeroshard.models import build_gpt

    config, preset = _resolve(spec)
    if preset is None:
        module = build_causal_lm(config)
        label = f"{type(module).__name__} ({spec})"
        vocab, context, is_hf = config.vocab_size, context_length(config), True
        targets = None
    else:
        module = build_gpt(preset)
        label, vocab, context, is_hf = f"GPT {preset}", module.config.vocab_size, module.config.block_size, False
        targets = GPT_LORA_TARGETS
    units = gather_unit_classes(module) if is_hf else ["Block"]
    if lora:
        module = apply_lora(module, lora, targets=targets)
        label += f" + LoRA r={lora}"
    return TrainModel(module, label, vocab, context, units, is_hf)
