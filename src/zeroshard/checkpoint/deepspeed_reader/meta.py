"""A DeepSpeed checkpoint described in the keys of zeroshard's meta.json."""

from __future__ import annotations

import os
from typing import Any

import torch

from zeroshard.checkpoint.deepspeed_reader.files import DS_KEYS, FORMAT, HYPER, scaler_fields


def describe(ckpt, sd: dict[str, Any], names: list[str], first: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's description in the keys of zeroshard's meta.json (what load_checkpoint,
    export and inspect read): counters, names and shapes, the optimizer's class, states and
    hyper-parameters, the scheduler, the loss scaler, the client's own keys and the files."""
    state, param_groups, _ = ckpt.base_state(first)
    kinds: dict[str, str] = {}
    for s in state.values():
        for k, v in s.items():
            kinds[k] = "elementwise" if torch.is_tensor(v) and v.dim() > 0 else "scalar"
    cfg = ckpt.config
    opt_cfg = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), dict) else None
    opt_class = None
    if opt_cfg:
        kind = str(opt_cfg.get("type", "")).lower()
        params = opt_cfg.get("params") or {}
        if kind in ("adam", "adamw"):
            opt_class = "AdamW" if kind == "adamw" or params.get("adam_w_mode", True) else "Adam"
        else:
            opt_class = str(opt_cfg.get("type"))
    elif kinds.keys() >= {"exp_avg", "exp_avg_sq"}:
        opt_class = "Adam"  # a client optimizer: its class is not recorded, its states are Adam's
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k in HYPER}
              for g in param_groups]
    gas = int(cfg.get("gradient_accumulation_steps") or 1) if isinstance(cfg, dict) else 1
    global_steps = int(sd.get("global_steps") or 0)
    sched = sd.get("lr_scheduler")
    sched_cfg = cfg.get("scheduler") if isinstance(cfg.get("scheduler"), dict) else None
    scaler = first.get("loss_scaler")
    client = {k: v for k, v in sd.items() if k not in DS_KEYS}
    files = {name: {"rank": r, "bytes": os.path.getsize(ckpt.path_of(name)), "sha256": None}
             for r, name in [*sorted(ckpt.optim_files.items()), *sorted(ckpt.model_files.items())]}
    return {
        "format": FORMAT, "tag": os.path.basename(os.path.normpath(ckpt.dir)),
        "deepspeed_version": str(sd.get("ds_version")), "world_size": ckpt.world_size, "stage": ckpt.stage,
        "dp_world_size": int(sd.get("dp_world_size") or ckpt.world_size),  # stage 0: 1 copy (world_size 1) of a run on more
        "compute_dtype": str(ckpt.compute_dtype),
        "global_steps": global_steps, "micro_steps": global_steps * gas,
        "skipped_steps": int(sd.get("skipped_steps") or 0),
        "global_samples": sd.get("global_samples"),
        "names": names, "tensors": ckpt.tensors, "tied": ckpt.tied,
        "optimizer": {"class": opt_class, "states": kinds, "param_groups": groups},
        "lr_scheduler": None if sched is None else {
            "class": (sched_cfg or {}).get("type"), "state": sched},
        "loss_scaler": scaler_fields(scaler),
        "config": cfg, "client_state": client, "files": files, "rng": [],
        "model_class": None, "model_config": None,
    }
