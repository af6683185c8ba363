"""What a DeepSpeed 0.1x checkpoint folder looks like: its file names, the keys DeepSpeed
writes beside the client's, and where a tag folder is (a save_dir with `latest`, the tag
folder itself, or `save_dir/tag`; a Trainer `checkpoint-N/` is a save_dir)."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from zeroshard.checkpoint.deepspeed_reader import safe_load
from zeroshard.policies import CheckpointError

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
    "checkpoint_parallel_dimensions",  # DeepSpeed 0.19: {pp_degree, tp_degree}
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
    for pointer in ("latest", "latest_universal"):  # latest_universal: written by ds_to_universal
        latest = os.path.join(path, pointer)
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
    if isinstance(scaler, dict):  # stage 0: FP16_UnfusedOptimizer's own fields (runtime/fp16/unfused_optimizer.py)
        fields = {k: v for k, v in scaler.items() if isinstance(v, (int, float, bool))}
        fields["class"] = "DynamicLossScaler" if scaler.get("dynamic_loss_scale") else "LossScaler"
        return fields
    if isinstance(scaler, (int, float)):
        return {"class": "LossScaler", "cur_scale": float(scaler)}
    return None


def is_universal(tag_dir: str) -> bool:
    """A folder ds_to_universal wrote: zero/optimizer_state.pt and a folder per parameter."""
    return os.path.isfile(os.path.join(tag_dir, "zero", "optimizer_state.pt"))


def scan(tag_dir: str) -> tuple[dict[int, str], dict[int, str]]:
    """({rank: model-states file}, {rank: optimizer-states file}) of a tag folder; one clear
    error for what zeroshard does not read (MoE or pipeline files, model parallel ranks) and
    for a missing rank 0 model file."""
    models, optims = {}, {}
    names = sorted(os.listdir(tag_dir))
    for name in names:
        if UNSUPPORTED_FILE.match(name):
            raise CheckpointError(f"{os.path.join(tag_dir, name)}: mixture-of-experts and pipeline-parallel "
                                  "DeepSpeed checkpoints (files like this one) are not read; only data parallel "
                                  "ZeRO checkpoints are")
    for name in names:
        for pattern, into, rank_group, mp_group in ((MODEL_FILE, models, 1, 2), (OPTIM_FILE, optims, 2, 3)):
            m = pattern.match(name)
            if not m:
                continue
            if int(m.group(mp_group)) != 0:
                raise CheckpointError(f"{os.path.join(tag_dir, name)}: model (tensor) parallel checkpoints "
                                      "(mp_rank > 0) are not supported; only data parallel ZeRO checkpoints are")
            into[int(m.group(rank_group) or 0)] = name
    if not optims and os.path.isdir(os.path.join(tag_dir, "zero")) and not is_universal(tag_dir):
        raise CheckpointError(f"{os.path.join(tag_dir, 'zero', 'optimizer_state.pt')}: missing; this universal "
                              "checkpoint (ds_to_universal's output) is incomplete: run ds_to_universal again")
    if 0 not in models:
        raise CheckpointError(f"{tag_dir}: missing rank file mp_rank_00_model_states.pt (or "
                              "zero_pp_rank_0_mp_rank_00_model_states.pt): the checkpoint is incomplete")
    return models, optims

