"""What a DeepSpeed 0.1x checkpoint folder looks like: its file names, the keys DeepSpeed
writes beside the client's, and where a tag folder is (a save_dir with `latest`, the tag
folder itself, or `save_dir/tag`; a Trainer `checkpoint-N/` is a save_dir)."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from zeroshard.checkpoint.deepspeed_reader import safe_load

FORMAT = "deepspeed"
MODEL_FILE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
UNSUPPORTED_FILE = re.compile(r"^(layer_\d+[-_]|expert_\d+_|expp_rank_\d+_)")
OPTIM_FILE = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")

# keys DeepSpeed itself writes in the model-states file; every other key is the client's
DS_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "universal_checkpoint_info", "num_experts", "csr_tensor_module_names",
})
ADAM_FAMILY = frozenset({"Adam", "AdamW", "FusedAdam", "DeepSpeedCPUAdam", "ZenFlowCPUAdam"})
HYPER = ("lr", "betas", "eps", "weight_decay", "amsgrad", "maximize", "initial_lr", "momentum", "dampening",
          "nesterov")


def _has_ds_files(d: str) -> bool:
    try:
        names = os.listdir(d)
    except OSError:
        return False
    return any(MODEL_FILE.match(n) or OPTIM_FILE.match(n) for n in names)


def find_deepspeed_tag(path: str | os.PathLike, tag: str | None = None) -> str | None:
    """The tag directory of a DeepSpeed checkpoint at `path` (a save_dir with `latest`, a
    tag directory itself, or `path/tag`), or None when `path` is not one."""
    path = os.fspath(path)
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "meta.json")):
        return None
    if tag is not None:
        d = os.path.join(path, str(tag))
        return d if _has_ds_files(d) else None
    if _has_ds_files(path):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest, encoding="utf-8", errors="replace") as f:
            name = f.read().strip()
        d = os.path.join(path, name)
        if name and _has_ds_files(d):
            return d
    return None


def is_deepspeed_checkpoint(path: str | os.PathLike, tag: str | None = None) -> bool:
    return find_deepspeed_tag(path, tag) is not None


def scaler_fields(scaler: Any) -> dict[str, Any] | None:
    """DeepSpeed's LossScaler / DynamicLossScaler attributes, as plain values."""
    if scaler is None:
        return None
    if isinstance(scaler, safe_load.Record):
        fields = {k: (v.item() if torch.is_tensor(v) and v.numel() == 1 else v) for k, v in scaler.fields.items()
                  if isinstance(v, (int, float, bool, str)) or (torch.is_tensor(v) and v.numel() == 1)}
        fields["class"] = scaler.type_name.rsplit(".", 1)[1]
        return fields
    if isinstance(scaler, (int, float)):
        return {"class": "LossScaler", "cur_scale": float(scaler)}
    return None
