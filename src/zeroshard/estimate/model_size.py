"""How big the model is: parameter count, largest gather unit, transformer shape.

Three sources: a number (`7B`), a Hugging Face `config.json` (counted analytically
for llama/mistral/qwen2/gpt2-style decoders, or on the meta device with
`transformers` when installed; weights are never read), or a `module:callable`
that builds an `nn.Module` (instantiated under `torch.device("meta")`).
"""

from __future__ import annotations

import importlib
import json
import math
import os
from dataclasses import dataclass, replace

from zeroshard.policies import ConfigError

from zeroshard.estimate.byte_units import parse_count

__all__ = [
    "ModelShape", "shape_from_params", "shape_from_hf_config", "shape_from_callable",
    "count_hf_config", "build_on_meta", "load_config", "ANALYTIC_MODEL_TYPES", "KAPLAN_ASPECT_RATIO", "DEFAULT_VOCAB",
]

# Kaplan et al. 2020 ("Scaling Laws", sec. 3.1): loss is flat for d_model / n_layer in
# ~[50, 200]; GPT-3 and LLaMA sit near 128. Used only to guess a shape from a bare count.
KAPLAN_ASPECT_RATIO = 128
DEFAULT_VOCAB = 32_000  # LLaMA / Mistral tokenizer
DEFAULT_HEAD_DIM = 128


@dataclass(frozen=True)
class ModelShape:
    """Counts in elements. `largest_unit` is the biggest stage-3 gather unit (a block or
    an embedding); `largest_layer` is DeepSpeed's "largest layer" (one module's own
    parameters, no children), kept for comparing with its estimators."""

    params: int
    largest_unit: int
    largest_layer: int
    layers: int
    hidden: int
    heads: int
    vocab: int
    source: str
    shape_inferred: bool = False  # layers/hidden guessed from the count, not read
    # Trainable parameters (LoRA adapters, --trainable-params); None: all of `params` train.
    # The rest is the frozen base: compute-dtype bytes only, no gradient, no optimizer state.
    trainable: int | None = None

    def __post_init__(self) -> None:
        if self.params <= 0:
            raise ConfigError(f"model has no parameters ({self.params}); nothing to estimate")
        if self.trainable is not None and not 0 < self.trainable <= self.params:
            raise ConfigError(f"trainable parameters must be in (0, {self.params:,}], got {self.trainable:,}")

    @property
    def trainable_params(self) -> int:
        return self.params if self.trainable is None else self.trainable

    @property
    def frozen_params(self) -> int:
        return self.params - self.trainable_params

    @property
    def largest_unit_trainable(self) -> int:
        """Trainable elements of the largest gather unit (its gradient at stage 3): the
        trainable share of the model, spread evenly over the units."""
        if self.trainable is None:
            return self.largest_unit
        return -(-self.largest_unit * self.trainable // self.params)


def shape_from_params(count: str | int, layers: int | None = None, hidden: int | None = None,
                      heads: int | None = None, vocab: int | None = None) -> ModelShape:
    """A bare count. Missing shape fields are inferred: 12 * L * h^2 per decoder
    (Kaplan et al. 2020, eq. 2.1 without embeddings) with h = KAPLAN_ASPECT_RATIO * L."""
    params = parse_count(count)
    vocab = vocab or DEFAULT_VOCAB
    inferred = layers is None or hidden is None
    if hidden is None and layers is None:
        layers = max(1, round((params / (12 * KAPLAN_ASPECT_RATIO**2)) ** (1 / 3)))
    if hidden is None:
        hidden = max(64, int(math.sqrt(params / (12 * layers))) // 64 * 64)
    if layers is None:
        layers = max(1, round(params / (12 * hidden * hidden)))
    heads = heads or max(1, hidden // DEFAULT_HEAD_DIM)
    block = min(params, 12 * hidden * hidden)
    embedding = min(params, vocab * hidden)
    largest_layer = min(params, max(4 * hidden * hidden, embedding))  # an MLP matrix or the embedding
    return ModelShape(params=params, largest_unit=max(block, embedding), largest_layer=largest_layer,
                      layers=layers, hidden=hidden, heads=heads, vocab=vocab,
                      source=f"--params {count}", shape_inferred=inferred)


# ---------------------------------------------------------------- Hugging Face config.json

ANALYTIC_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2")


def load_config(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path!r} is not a readable JSON file: {e}") from None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        hint = ""
        if isinstance(cfg, dict) and ("zero_optimization" in cfg or "train_batch_size" in cfg):
            hint = " (it looks like a DeepSpeed config; pass the model's config.json)"
        raise ConfigError(f"{path!r} is not a Hugging Face model config: no 'model_type' key{hint}")
    return cfg


def _llama_counts(c: dict) -> tuple[int, int, int]:
    h, L, V = c["hidden_size"], c["num_hidden_layers"], c["vocab_size"]
    a = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or a
    d = c.get("head_dim") or h // a
    inter = c["intermediate_size"]
    qkv_bias = c.get("attention_bias", c["model_type"] == "qwen2")
    attn = h * a * d + 2 * h * kv * d + a * d * h + ((a * d + 2 * kv * d) if qkv_bias else 0)
    mlp = 3 * h * inter + (2 * inter + h if c.get("mlp_bias") else 0)
    block = attn + mlp + 2 * h  # two RMSNorm weights
    emb = V * h
    head = 0 if c.get("tie_word_embeddings", False) else V * h
    total = emb + L * block + h + head
    largest_layer = max(emb, mlp // 3 + (inter if c.get("mlp_bias") else 0))
    return total, max(block, emb), largest_layer


def _gpt2_counts(c: dict) -> tuple[int, int, int]:
    h, L, V = c["n_embd"], c["n_layer"], c["vocab_size"]
    inner = c.get("n_inner") or 4 * h
    P = c.get("n_positions", 1024)
    block = 2 * h + (h * 3 * h + 3 * h) + (h * h + h) + 2 * h + (h * inner + inner) + (inner * h + h)
    emb = V * h
    total = emb + P * h + L * block + 2 * h  # lm_head tied to wte
    return total, max(block, emb), max(emb, h * inner + inner)


def count_hf_config(cfg: dict) -> tuple[int, int, int]:
    """(params, largest unit, largest layer) without transformers, for ANALYTIC_MODEL_TYPES."""
    mt = cfg["model_type"]
    try:
        return (_gpt2_counts if mt == "gpt2" else _llama_counts)(cfg)
    except KeyError as e:
        raise ConfigError(f"model config (model_type {mt!r}) lacks the key {e.args[0]!r}") from None


def meta_model(cfg: dict):
    """A transformers model built from a config dict on the meta device (no memory, no download)."""
    import torch
    import transformers

    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(config)
        except ValueError:
            return transformers.AutoModel.from_config(config)


def shape_from_hf_config(path: str, use_transformers: bool | None = None) -> ModelShape:
    """Count a HF config. `use_transformers`: None = analytic when the type is known,
    else transformers on the meta device if installed."""
    cfg = load_config(path)
    mt = cfg["model_type"]
    if mt in ANALYTIC_MODEL_TYPES and use_transformers is not True:
        params, unit, layer = count_hf_config(cfg)
        how = "analytic count"
    else:
        try:
            import transformers  # noqa: F401
        except ImportError:
            raise ConfigError(
                f"model_type {mt!r} has no analytic count (known: {', '.join(ANALYTIC_MODEL_TYPES)}); "
                "install transformers to count it on the meta device: pip install 'transformers>=4.40,<6'"
            ) from None
        try:
            params, unit, layer = _count_module(meta_model(cfg))
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"transformers cannot build model_type {mt!r} from {path!r}: {e}") from None
        how = "transformers, meta device"
    g = cfg.get
    hidden = g("hidden_size") or g("n_embd") or g("d_model") or 0
    layers = g("num_hidden_layers") or g("n_layer") or g("num_layers") or 0
    heads = g("num_attention_heads") or g("n_head") or max(1, hidden // DEFAULT_HEAD_DIM)
    vocab = g("vocab_size") or DEFAULT_VOCAB
    if not hidden or not layers:
        raise ConfigError(f"{path!r}: cannot find hidden size and layer count (model_type {mt!r})")
    return ModelShape(params=params, largest_unit=unit, largest_layer=layer, layers=layers,
                      hidden=hidden, heads=heads, vocab=vocab, source=f"{path} ({mt}, {how})")


# ---------------------------------------------------------------- module:callable


def _count_module(model) -> tuple[int, int, int]:
    """(params, largest unit, largest layer); a Parameter shared by two modules counts once.

    Units follow stage 3's gather units: every element of an outermost ModuleList is one
    unit; the other parameters are grouped by their top-level child module."""
    import torch.nn as nn

    seen: set[int] = set()

    def numel(params) -> int:
        n = 0
        for p in params:
            if id(p) not in seen:
                seen.add(id(p))
                n += p.numel()
        return n

    units: list[int] = []

    def visit(mod: nn.Module) -> None:
        for child in mod.children():
            if isinstance(child, nn.ModuleList):
                units.extend(numel(el.parameters()) for el in child)
            elif any(isinstance(m, nn.ModuleList) for m in child.modules()):
                units.append(numel(child.parameters(recurse=False)))
                visit(child)
            else:
                units.append(numel(child.parameters()))

    visit(model)
    units.append(numel(model.parameters(recurse=False)))
    total = sum(units)
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, max(units), largest_layer


def build_on_meta(spec: str):
    """The nn.Module `package.module:callable` builds, on the meta device."""
    import torch
    import torch.nn as nn

    if ":" not in spec:
        raise ConfigError(f"--model {spec!r}: expected 'package.module:callable'")
    mod_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import {spec!r}: {e}") from None
    try:
        with torch.device("meta"):
            model = fn()
    except Exception as e:  # user code: report it, do not crash the CLI
        raise ConfigError(f"{spec!r} failed when called with no arguments: {type(e).__name__}: {e}") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model


def shape_from_callable(spec: str, layers: int | None = None, hidden: int | None = None,
                        heads: int | None = None, vocab: int | None = None) -> ModelShape:
    """`package.module:callable` returning an nn.Module (or an nn.Module class), built
    on the meta device: no memory, no weights."""
    model = build_on_meta(spec)
    params, unit, layer = _count_module(model)
    if params == 0:
        raise ConfigError(f"{spec!r} built a module with no parameters")
    cfg = getattr(model, "config", None)
    get = lambda k: getattr(cfg, k, None)  # None for every key without a config
    hidden = hidden or get("n_embd") or get("hidden_size")
    layers = layers or get("n_layer") or get("num_hidden_layers")
    heads = heads or get("n_head") or get("num_attention_heads")
    vocab = vocab or get("vocab_size")
    guess = shape_from_params(params, layers=layers, hidden=hidden, heads=heads, vocab=vocab)
    return replace(guess, largest_unit=unit, largest_layer=layer, source=f"{spec} (meta device)")
