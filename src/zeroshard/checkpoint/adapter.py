"""Adapter-only export in peft's format: `adapter_model.safetensors` + `adapter_config.json`.

A LoRA model's trainable parameters are its adapters (peft names them `...lora_A.<adapter>.weight`,
`...lora_B.<adapter>.weight`, and so on). Both paths here read only them:

* `export_adapter(ckpt, out)` (`zeroshard export --adapter-only`): from a checkpoint, tensor by
  tensor from the fp32 masters of the trainable buckets; the frozen base (stage-3 `value`
  shards, `module.*` entries) is never read, so peak memory is about one adapter tensor.
* `save_adapter(engine, out)`: online, from rank 0 (call it on every rank). Stages 0-2 hold
  the adapters whole on every rank; stage 3 all-gathers one trainable bucket at a time (a few
  MB for LoRA), never a frozen unit, so it needs no `stage3_gather_16bit_weights_on_model_save`.

Keys follow peft's `get_peft_model_state_dict`: the adapter name is removed
(`q_proj.lora_A.default.weight` -> `q_proj.lora_A.weight`; DoRA's magnitude vector also loses
`.weight`), so `PeftModel.from_pretrained(base, out)` loads the files.

`adapter_config.json` comes from the peft config recorded in the checkpoint's meta.json under
`PEFT_META_KEY` (what `peft_meta(module)` returns), else it is rebuilt from the tensors (rank
from `lora_A`'s shape, target modules from the names) with `lora_alpha` given by the caller,
since no tensor holds it.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch

from zeroshard.checkpoint.format import train_state_of
from zeroshard.checkpoint.exchange import agreed
from zeroshard.checkpoint.export import stream_entries, target_dtype, write_streamed
from zeroshard.checkpoint.files import Entry, write_safetensors, write_small
from zeroshard.checkpoint.reader import CheckpointReader
from zeroshard.policies import CheckpointError, Stage

__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "PEFT_META_KEY", "adapter_tensor_names", "export_adapter",
           "peft_key", "peft_meta", "save_adapter"]

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_META_KEY = "peft_config"  # meta.json: {"adapter_name": ..., "config": LoraConfig.to_dict()}
# peft's LoRA parameter names (lora_A/B, embeddings, DoRA's magnitude vector)
_LORA_PART = re.compile(r"\.(lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)\.([^.]+)(\.|$)")


def peft_meta(module: torch.nn.Module) -> dict[str, Any] | None:
    """The active adapter's peft config as JSON (for meta.json), or None for a non-peft model."""
    configs = getattr(module, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    name = getattr(module, "active_adapter", None)
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    if name not in configs:
        name = next(iter(configs))
    return {"adapter_name": name, "config": _json_config(configs[name])}


def _json_config(cfg) -> dict[str, Any]:
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(cfg)

    def safe(v):
        if isinstance(v, (set, frozenset)):
            return sorted(safe(x) for x in v)
        if isinstance(v, (list, tuple)):
            return [safe(x) for x in v]
        if isinstance(v, dict):
            return {str(k): safe(x) for k, x in v.items()}
        if hasattr(v, "value") and isinstance(getattr(v, "value"), str):  # peft's str enums
            return v.value
        if v is None or isinstance(v, (str, int, float, bool)):
            return v
        return str(v)
    return {k: safe(v) for k, v in d.items()}


def peft_key(name: str, adapter: str) -> str:
    """The key peft's `get_peft_model_state_dict` writes for the model key `name`."""
    if name.endswith(f".{adapter}"):
        return name[: -len(adapter) - 1]
    head, _, suffix = name.rpartition(".")
    head = re.sub(re.escape(f".{adapter}") + r"$", "", head)
    key = f"{head}.{suffix}"
    if ".lora_magnitude_vector" in key and key.endswith(".weight"):
        key = key[: -len(".weight")]  # DoRA: peft saves the magnitude without ".weight"
    return key


def adapter_tensor_names(names: list[str], trainable: dict[str, bool]) -> tuple[list[str], str | None, list[str]]:
    """(LoRA tensor names, adapter name, other trainable names) among `names`."""
    lora, others, adapters = [], [], set()
    for n in names:
        if not trainable.get(n):
            continue
        m = _LORA_PART.search(n)
        if m:
            lora.append(n)
            adapters.add(m.group(2))
        else:
            others.append(n)
    if len(adapters) > 1:
        raise CheckpointError(f"the checkpoint trains several adapters ({', '.join(sorted(adapters))}); "
                              "--adapter-only writes one adapter in peft's format")
    return lora, (next(iter(adapters)) if adapters else None), others


def _rebuilt_config(names: list[str], shapes: dict[str, tuple[int, ...]], adapter: str, lora_alpha: float | None,
                    model_class: str | None, where: str) -> dict[str, Any]:
    if lora_alpha is None:
        raise CheckpointError(f"{where}: the checkpoint does not record the adapter's peft config, and lora_alpha "
                              "(the scale of the update) is not in any tensor: pass --lora-alpha A "
                              "(`zeroshard train --lora R` uses 2R; peft's default is 8)")
    ranks: dict[str, int] = {}
    dora = False
    for n in names:
        m = _LORA_PART.search(n)
        module = n[: m.start()]
        if m.group(1) in ("lora_A", "lora_embedding_A"):
            ranks[module] = shapes[n][0]
        dora = dora or m.group(1) == "lora_magnitude_vector"
    if not ranks:
        raise CheckpointError(f"{where}: no lora_A tensor to read the adapter rank from")
    r = max(set(ranks.values()), key=list(ranks.values()).count)
    leaves = sorted({m.rsplit(".", 1)[-1] for m in ranks})
    pattern = {m.split("base_model.model.", 1)[-1]: v for m, v in ranks.items() if v != r}
    task = None
    if model_class and model_class.startswith("PeftModelFor"):
        task = {"PeftModelForCausalLM": "CAUSAL_LM", "PeftModelForSeq2SeqLM": "SEQ_2_SEQ_LM",
                "PeftModelForSequenceClassification": "SEQ_CLS", "PeftModelForTokenClassification": "TOKEN_CLS",
                "PeftModelForQuestionAnswering": "QUESTION_ANS",
                "PeftModelForFeatureExtraction": "FEATURE_EXTRACTION"}.get(model_class)
    return {"peft_type": "LORA", "task_type": task, "r": r, "lora_alpha": lora_alpha, "target_modules": leaves,
            "rank_pattern": pattern, "alpha_pattern": {}, "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "use_rslora": False, "use_dora": dora, "modules_to_save": None,
            "init_lora_weights": True, "inference_mode": True, "base_model_name_or_path": None}


def _write_adapter(out_dir: str, entries: list[Entry], config: dict[str, Any]) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, ADAPTER_WEIGHTS)
    write_safetensors(path + ".tmp", entries, {"format": "pt"})
    os.replace(path + ".tmp", path)
    write_small(os.path.join(out_dir, ADAPTER_CONFIG), json.dumps(config, indent=2).encode())
    return [ADAPTER_WEIGHTS, ADAPTER_CONFIG]


def export_adapter(ckpt_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "fp32",
                   tag: str | None = None, lora_alpha: float | None = None) -> list[str]:
    """The checkpoint's LoRA adapter in peft's format; reads the trainable buckets only."""
    target = target_dtype(dtype)
    with CheckpointReader(ckpt_dir, tag) as reader:
        where = reader.meta_path
        trainable = {n: bool(reader.tensors[reader.canonical(n)].get("trainable")) for n in reader.meta["names"]}
        names = [n for n in reader.meta["names"] if reader.canonical(n) == n]  # tied aliases once
        lora, adapter, others = adapter_tensor_names(names, trainable)
        if not lora:
            n_train = sum(1 for n in names if trainable[n])
            raise CheckpointError(
                f"{reader.dir}: --adapter-only needs a checkpoint of a model with peft LoRA adapters, but no "
                f"trainable tensor is one (no '.lora_A.' / '.lora_B.' in {n_train} trainable of {len(names)} "
                "tensors): export the whole model without --adapter-only")
        if others:
            raise CheckpointError(
                f"{reader.dir}: trainable tensors that are not LoRA adapters ({', '.join(others[:3])}"
                f"{', ...' if len(others) > 3 else ''}) would be lost by --adapter-only (peft saves them as "
                "modules_to_save); use --exclude-frozen for every trainable tensor in the full format")
        shapes = {n: tuple(reader.tensors[n]["shape"]) for n in lora}
        recorded = reader.meta.get(PEFT_META_KEY)
        if recorded:
            config = dict(recorded["config"])
            if lora_alpha is not None and lora_alpha != config.get("lora_alpha"):
                raise CheckpointError(f"{where}: --lora-alpha {lora_alpha} differs from the recorded "
                                      f"lora_alpha {config.get('lora_alpha')}; leave it out")
        else:
            config = _rebuilt_config(lora, shapes, adapter, lora_alpha, reader.meta.get("model_class"), where)
        # Size and sha256 of the files holding master shards (the frozen shards share them; hashing
        # streams from disk, nothing is kept); optimizer files are not needed.
        reader.verify([f for f in reader.files if ".optim." not in f])
        entries = [Entry(peft_key(n, adapter), shapes[n], target, lambda n=n: reader.read(n).to(target).view(shapes[n]))
                   for n in lora]
        return _write_adapter(os.fspath(out_dir), entries, config)


def save_adapter(engine, save_dir: str | os.PathLike) -> list[str]:
    """Write the engine's LoRA adapter in peft's format from rank 0, in the compute dtype;
    call on every rank. Stage 3 gathers one trainable bucket at a time, no frozen unit."""
    ts = train_state_of(engine)
    with agreed(ts.comm, ts.device, "save_adapter"):
        meta = peft_meta(ts.module)
        sd = ts.module.state_dict(keep_vars=True)
        in_bucket = {id(p) for b in ts.buckets for p in b.params}
        trainable = {n: id(t) in in_bucket for n, t in sd.items()}
        names, adapter, others = adapter_tensor_names(list(sd), trainable)
        if meta is None or not names:
            raise CheckpointError("save_adapter needs a peft LoRA model (engine.module.peft_config) whose adapters "
                                  "train; this model has none: use save_16bit_model or save_checkpoint")
        if others:
            raise CheckpointError(f"trainable tensors that are not LoRA adapters ({', '.join(others[:3])}) would "
                                  "be lost by save_adapter; use save_checkpoint + `zeroshard export --exclude-frozen`")
    entries, finish = stream_entries(ts, [(n, sd[n]) for n in names], ts.buckets,
                                     gather=ts.settings.zero.stage == Stage.PARAMETERS,
                                     key=lambda n: peft_key(n, adapter))
    return write_streamed(ts, lambda: _write_adapter(os.fspath(save_dir), entries, meta["config"]), finish,
                          "save_adapter")
