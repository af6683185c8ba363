"""How many parameters LoRA adds, from a model's shape and the modules it targets.

LoRA (Hu et al. 2021) adds to a targeted linear map W (in -> out) two trainable
matrices A (r x in) and B (out x r): r * (in + out) parameters per targeted module,
while W itself stays frozen. peft's `LoraConfig(target_modules=...)` selects modules by
name: a module is targeted when its name equals a target or ends with "." + target
(`"all-linear"`: every linear layer except the output head). Without targets, peft's
default for the architecture is used (`TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING`
when peft is importable, else the same table for the common types, `DEFAULT_TARGETS`).

Three sources, as in `model_size.py`:
* a transformers config.json: counted analytically for llama-style decoders (llama,
  mistral, qwen2) and gpt2, otherwise on the meta device with transformers;
* an `nn.Module` (built on the meta device): every Linear / transformers Conv1D /
  Embedding whose name matches;
* a bare count (`--params 7B`): a llama-style decoder of the inferred shape (multi-head
  attention, projections h x h, MLP of 3 matrices h x 8h/3), flagged as inferred.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from zeroshard.policies import ConfigError

from zeroshard.estimate.model_size import ANALYTIC_MODEL_TYPES, ModelShape, meta_model

__all__ = ["LoraCount", "DEFAULT_TARGETS", "add_adapters", "default_targets", "lora_from_hf_config",
           "lora_from_module", "lora_from_shape", "parse_targets"]

# peft 0.21's defaults for the common types (used only when peft is not importable).
DEFAULT_TARGETS = {
    "llama": ["q_proj", "v_proj"], "mistral": ["q_proj", "v_proj"], "mixtral": ["q_proj", "v_proj"],
    "qwen2": ["q_proj", "v_proj"], "gemma": ["q_proj", "v_proj"], "gemma2": ["q_proj", "v_proj"],
    "opt": ["q_proj", "v_proj"], "gpt2": ["c_attn"], "gpt_neox": ["query_key_value"],
    "falcon": ["query_key_value"], "bloom": ["query_key_value"], "phi": ["q_proj", "v_proj"],
}
ALL_LINEAR = "all-linear"
OUTPUT_HEADS = ("lm_head", "embed_out", "output")


@dataclass(frozen=True)
class LoraCount:
    """Adapter parameters: in total, per targeted module name (summed over layers), and
    the largest per-layer share (adapters of one gather unit)."""

    r: int
    targets: tuple[str, ...]
    params: int
    per_target: tuple[tuple[str, int], ...]
    modules: int  # targeted modules (all layers)
    how: str  # where the targets came from and how the modules were counted

    def describe(self) -> str:
        parts = ", ".join(f"{t} {n:,}" for t, n in self.per_target)
        return f"LoRA r={self.r} on {', '.join(self.targets)}: {self.modules} modules ({parts}; {self.how})"


def parse_targets(text: str | None) -> list[str] | None:
    if text is None:
        return None
    out = [t.strip() for t in text.split(",") if t.strip()]
    if not out:
        raise ConfigError("--lora-targets is empty: give module names such as q_proj,v_proj (or all-linear)")
    return out


def default_targets(model_type: str | None) -> tuple[list[str] | None, str]:
    """(targets, where from): peft's mapping when peft is importable, else DEFAULT_TARGETS;
    None when neither knows the type (then "all-linear", as zeroshard's `apply_lora` does)."""
    try:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping
        source = "peft's default for"
    except ImportError:  # peft is optional
        mapping, source = DEFAULT_TARGETS, "peft 0.21's default (peft not installed) for"
    if model_type and model_type in mapping:
        return list(mapping[model_type]), f"{source} {model_type}"
    return None, f"no peft default for {model_type or 'this model'}: all-linear"


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def _count(modules: Sequence[tuple[str, int, int, bool]], r: int, targets: list[str] | None,
           model_type: str | None, how: str) -> LoraCount:
    """modules: (qualified name, in, out, is_linear) of every module LoRA can adapt
    (linear layers, transformers' Conv1D, and embeddings, which only a name targets)."""
    if r < 1:
        raise ConfigError(f"--lora {r}: the adapter rank must be at least 1")
    origin = "given"
    if targets is None:
        targets, origin = default_targets(model_type)
        targets = targets or [ALL_LINEAR]
    per: dict[str, int] = {}
    taken: set[str] = set()
    for t in targets:
        if t == ALL_LINEAR:
            chosen = [m for m in modules if m[3] and m[0].rsplit(".", 1)[-1] not in OUTPUT_HEADS]
        else:
            chosen = [m for m in modules if _matches(m[0], t)]
        if not chosen:
            leaves = sorted({m[0].rsplit(".", 1)[-1] for m in modules if m[3]})
            raise ConfigError(f"--lora-targets {t!r}: the model ({model_type or 'module'}) has no module named "
                              f"{t!r}; its linear modules are: {', '.join(leaves)}")
        new = [m for m in chosen if m[0] not in taken]  # a module named by two targets is adapted once
        taken.update(m[0] for m in new)
        per[t] = sum(r * (i + o) for _, i, o, _ in new)
    return LoraCount(r=r, targets=tuple(targets), params=sum(per.values()), per_target=tuple(per.items()),
                     modules=len(taken), how=f"targets {origin}; {how}")


def _llama_modules(c: dict) -> list[tuple[str, int, int, bool]]:
    h, L = c["hidden_size"], c["num_hidden_layers"]
    a = c["num_attention_heads"]
    kv = c.get("num_key_value_heads") or a
    d = c.get("head_dim") or h // a
    inter = c["intermediate_size"]
    out = []
    for i in range(L):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj", h, a * d), (f"{p}.self_attn.k_proj", h, kv * d),
                (f"{p}.self_attn.v_proj", h, kv * d), (f"{p}.self_attn.o_proj", a * d, h),
                (f"{p}.mlp.gate_proj", h, inter), (f"{p}.mlp.up_proj", h, inter), (f"{p}.mlp.down_proj", inter, h)]
    return [("model.embed_tokens", c["vocab_size"], h, False)] + [m + (True,) for m in out] + \
        [("lm_head", h, c["vocab_size"], True)]


def _gpt2_modules(c: dict) -> list[tuple[str, int, int, bool]]:
    h, L = c["n_embd"], c["n_layer"]
    inner = c.get("n_inner") or 4 * h
    out = []
    for i in range(L):
        p = f"transformer.h.{i}"
        out += [(f"{p}.attn.c_attn", h, 3 * h), (f"{p}.attn.c_proj", h, h), (f"{p}.mlp.c_fc", h, inner),
                (f"{p}.mlp.c_proj", inner, h)]
    return [("transformer.wte", c["vocab_size"], h, False)] + [m + (True,) for m in out] + \
        [("lm_head", h, c["vocab_size"], True)]


def _module_table(model) -> list[tuple[str, int, int, bool]]:
    """(name, in, out, is_linear) of the Linear, transformers Conv1D and Embedding modules."""
    import torch.nn as nn

    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out.append((name, m.in_features, m.out_features, True))
        elif isinstance(m, nn.Embedding):
            out.append((name, m.num_embeddings, m.embedding_dim, False))
        elif type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
            i, o = m.weight.shape  # transformers' Conv1D stores (in, out)
            out.append((name, int(i), int(o), True))
    return out


def lora_from_module(model, r: int, targets: list[str] | None = None) -> LoraCount:
    """Count on a module (built on the meta device): its transformers `model_type`, if any,
    picks peft's default targets."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return _count(_module_table(model), r, targets, model_type, "modules counted on the meta device")


def lora_from_hf_config(cfg: dict, r: int, targets: list[str] | None = None) -> LoraCount:
    mt = cfg.get("model_type")
    if mt in ANALYTIC_MODEL_TYPES:
        try:
            modules = _gpt2_modules(cfg) if mt == "gpt2" else _llama_modules(cfg)
        except KeyError as e:
            raise ConfigError(f"model config (model_type {mt!r}) lacks the key {e.args[0]!r}") from None
        return _count(modules, r, targets, mt, "analytic count of the config")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError(f"--lora on model_type {mt!r} needs transformers to find its modules "
                          "(analytic: llama, mistral, qwen2, gpt2): pip install 'transformers>=4.40,<6'") from None
    return lora_from_module(meta_model(cfg), r, targets)


def lora_from_shape(shape: ModelShape, r: int, targets: list[str] | None = None) -> LoraCount:
    """A bare count: a llama-style decoder of `shape` (MHA, h x h projections, MLP 3 x h x 8h/3)."""
    cfg = {"model_type": "llama", "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
           "num_attention_heads": shape.heads, "intermediate_size": (8 * shape.hidden) // 3, "vocab_size": shape.vocab}
    return _count(_llama_modules(cfg), r, targets, "llama", "llama-style modules assumed for a bare count")


def add_adapters(shape: ModelShape, adapters: int, note: str) -> ModelShape:
    """`shape` with `adapters` trainable parameters added to it; its own parameters become
    the frozen base. The largest gather unit grows by its share of the adapters."""
    if adapters <= 0:
        raise ConfigError(f"trainable adapter parameters must be positive, got {adapters}")
    params = shape.params + adapters
    unit = shape.largest_unit + -(-shape.largest_unit * adapters // shape.params)
    return replace(shape, params=params, trainable=adapters, largest_unit=unit, source=f"{shape.source}; {note}")
