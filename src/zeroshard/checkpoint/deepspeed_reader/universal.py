"""`UniversalCheckpoint`: a folder DeepSpeed's `ds_to_universal` wrote, read like any other.

    ckpt/
      latest_universal                    the output folder's name
      global_step3_universal/
        mp_rank_00_model_states.pt        copied from the source (stage 3: every rank's
                                          zero_pp_rank_{r}_mp_rank_00_model_states.pt)
        zero/optimizer_state.pt           the source's rank-0 optimizer dict without its
                                          partitions, plus `param_groups`
        zero/<parameter>/fp32.pt          the whole fp32 master: {"param": tensor, "cat_dim": 0}
                                          at stages 1-2, the flat tensor at stage 3
        zero/<parameter>/exp_avg.pt, exp_avg_sq.pt    Adam's states, in the same form
        zero/<parameter>/step.pt          stages 1-2: Adam's step (stage 3 keeps it per
                                          sub-group in optimizer_state.pt)

Read from DeepSpeed 0.18's checkpoint/ds_to_universal.py. Every parameter is whole, so the
reader sees one rank whose flat tensor j is parameter j (in `param_shapes` order), as for
stage 0; each read opens that parameter's file alone, memory-mapped.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from zeroshard.checkpoint.deepspeed_reader import safe_load
from zeroshard.checkpoint.deepspeed_reader.files import scan
from zeroshard.checkpoint.deepspeed_reader.layout import Run
from zeroshard.checkpoint.deepspeed_reader.reader import DeepSpeedCheckpoint
from zeroshard.policies import CheckpointError

OPTIMIZER_FILE = os.path.join("zero", "optimizer_state.pt")


class UniversalCheckpoint(DeepSpeedCheckpoint):
    """One universal tag: `read(name, field)` takes zero/<name>/<field>.pt."""

    def _scan(self) -> None:
        self.model_files, _ = scan(self.dir)
        self.optim_files = {}
        self._names: list[str] = []  # flat tensor j -> parameter name
        self._sub_group: dict[str, int] = {}  # stage 3: the sub-group whose state holds the parameter's step

    def _saved_world_size(self, sd: dict[str, Any]) -> int:
        return 1  # every parameter whole

    def _optim_file(self, rank: int) -> str:
        return self.path_of(OPTIMIZER_FILE)

    def _optim(self, rank: int) -> dict[str, Any]:
        if 0 not in self._states:
            path = self._optim_file(0)
            sd = safe_load.load(path)
            if not isinstance(sd, dict) or not isinstance(sd.get("param_groups"), list):
                raise CheckpointError(f"{path}: not a universal checkpoint's optimizer state (no 'param_groups')")
            self._states[0] = sd
        return self._states[0]

    def _map_partitions(self, first: dict[str, Any]) -> None:
        group_of_sub = {int(i): gi for gi, g in enumerate(first["param_groups"]) for i in g.get("params", [])}
        for gi, g in enumerate(self.groups):
            for name, shape in g:
                self.where[name] = [Run(0, len(self._names), 0, 0, math.prod(shape))]
                # stages 1-2: groups are the param groups; stage 3: sub-groups, mapped to theirs
                self._group_of[name] = group_of_sub.get(gi, 0) if self.stage == 3 else gi
                self._sub_group[name] = gi
                self._names.append(name)
        self.partition_sizes = [sum(math.prod(s) for _, s in g) for g in self.groups]
        missing = [n for n in self._names if not os.path.isfile(self._state_path(n, "fp32"))]
        if missing:
            raise CheckpointError(f"{self._state_path(missing[0], 'fp32')}: missing ({len(missing)} of "
                                  f"{len(self._names)} parameters have no fp32.pt); the universal checkpoint is incomplete")

    def _build_meta(self) -> None:
        super()._build_meta()
        # the files of the description (`inspect`, `verify`), beside the model files the base class
        # lists: the optimizer dict and every parameter's state files
        state_files = [OPTIMIZER_FILE]
        for name in self._names:
            folder = os.path.dirname(self._state_path(name, "fp32"))
            state_files += sorted(os.path.join("zero", name, f) for f in os.listdir(folder) if f.endswith(".pt"))
        for rel in state_files:
            self.meta["files"][rel] = {"rank": 0, "bytes": os.path.getsize(self.path_of(rel)), "sha256": None}
        self.meta["universal"] = True

    def base_state(self, opt: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[dict], Any]:
        """The first parameter's states stand for all (they are the same kinds), so describing
        the checkpoint opens one parameter's files, not every one."""
        state: dict[str, Any] = {}
        if self._names:
            folder = os.path.dirname(self._state_path(self._names[0], "fp32"))
            for f in sorted(os.listdir(folder)):
                key = f[: -len(".pt")]
                if f.endswith(".pt") and key != "fp32":
                    state[key] = self._load(self._names[0], key)
            if "step" not in state:
                step = self._saved_step(self._names[0])
                if step is not None:
                    state["step"] = step
        return {0: state}, opt.get("param_groups", []), None

    # -- reads -------------------------------------------------------------------------------------
    def _state_path(self, name: str, key: str) -> str:
        return self.path_of(os.path.join("zero", name, f"{key}.pt"))

    def _load(self, name: str, key: str) -> Any:
        path = self._state_path(name, key)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path}: missing; the universal checkpoint has no {key!r} for {name!r}")
        obj = safe_load.load(path)
        if isinstance(obj, dict):  # stages 1-2: {"param": tensor, "cat_dim": ..., ...}
            if "param" not in obj:
                raise CheckpointError(f"{path}: a dict without 'param': not a universal checkpoint's state file")
            obj = obj["param"]
        return obj

    def _flat(self, rank: int, flat: int, key: str | None) -> torch.Tensor:
        name = self._names[flat]
        t = self._load(name, "fp32" if key is None else key)
        if not torch.is_tensor(t) or t.numel() != self.numel(name):
            raise CheckpointError(f"{self._state_path(name, 'fp32' if key is None else key)}: "
                                  f"{getattr(t, 'numel', lambda: '?')()} elements, {name!r} has {self.numel(name)}: "
                                  "the file is not this parameter's")
        return t.reshape(-1)

    def _saved_step(self, name: str) -> Any:
        """Stage 3: the step of the parameter's sub-group, in optimizer_state.pt's torch state."""
        inner = self._optim(0).get("optimizer_state_dict")
        state = inner.get("state") if isinstance(inner, dict) else None
        entry = state.get(self._sub_group[name]) if isinstance(state, dict) else None
        return entry.get("step") if isinstance(entry, dict) else None

    def _scalar(self, rank: int, flat: int, key: str) -> torch.Tensor:
        name = self._names[flat]
        value = (self._load(name, key) if os.path.isfile(self._state_path(name, key))
                 else self._saved_step(name) if key == "step" else None)
        if value is None:
            raise CheckpointError(f"{self._state_path(name, key)}: missing; the universal checkpoint has no {key!r} "
                                  f"for {name!r}")
        return value.detach().clone().reshape(()) if torch.is_tensor(value) else torch.tensor(float(value))
