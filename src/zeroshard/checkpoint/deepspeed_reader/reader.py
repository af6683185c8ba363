"""`DeepSpeedCheckpoint`: one tag of a folder DeepSpeed 0.1x wrote, read like zeroshard's own.

    ckpt/                                   (also: a Trainer `checkpoint-N/` folder)
      latest                                "global_step3"
      global_step3/
        mp_rank_00_model_states.pt          stages 0-2: module (compute dtype), param_shapes,
                                            counters, lr_scheduler, ds_config, client_state
        zero_pp_rank_{r}_mp_rank_00_model_states.pt      stage 3: one per rank
        [bf16_]zero_pp_rank_{r}_mp_rank_00_optim_states.pt  one per rank: its fp32 partition
                                                         and optimizer states

Only the rank files a read needs are open, one optimizer file at a time, memory-mapped:
loading holds at most one DeepSpeed rank's partition beyond what it fills.
"""

from __future__ import annotations

import math
import os
import re
from typing import Any

import torch

from zeroshard.checkpoint.deepspeed_reader import layout, safe_load, stage0
from zeroshard.checkpoint.deepspeed_reader.files import find_deepspeed_tag, scan
from zeroshard.checkpoint.deepspeed_reader.layout import Run
from zeroshard.checkpoint.deepspeed_reader.meta import describe
from zeroshard.checkpoint.deepspeed_reader.offloaded import FOLDER, Offloaded
from zeroshard.checkpoint.reader import TensorIndex
from zeroshard.policies import CheckpointError


class DeepSpeedCheckpoint(TensorIndex):
    """One DeepSpeed tag. `meta` has the keys zeroshard's loaders read from `meta.json`
    (names, tensors, tied, optimizer, counters, lr_scheduler, loss_scaler, client_state),
    and `read(name, field, lo, hi)` returns elements [lo, hi) of a parameter's fp32 master
    ("value") or optimizer state ("optim.<state>"), as `CheckpointReader.read` does."""

    buckets: list = []  # no zeroshard bucket records: states load element by element

    def __init__(self, path: str | os.PathLike, tag: str | None = None) -> None:
        path = os.fspath(path)
        tag_dir = find_deepspeed_tag(path, tag)
        if tag_dir is None:
            if tag is not None and not os.path.isdir(os.path.join(path, str(tag))):
                raise CheckpointError(f"{os.path.join(path, str(tag))}: no such checkpoint tag in {path}")
            raise CheckpointError(f"{path}: not a DeepSpeed checkpoint (no *_model_states.pt or *_optim_states.pt "
                                  "files, and no 'latest' naming a directory that has them)")
        self.dir = tag_dir
        self.meta_path = tag_dir  # errors name the folder; there is no meta.json
        self._states: dict[int, Any] = {}  # rank -> its optimizer_state_dict (the file mapped, read on demand)
        self._fds: dict[int, tuple[int | None, list]] = {}  # rank -> (its file, open; where it is mapped)
        self._offloaded: Offloaded | None = None  # stage 3 sub-groups DeepSpeed swapped to NVMe
        self._scan()
        self.world_size = len(self.optim_files) or 1
        self._model = self._load_model_file(0)
        self._model_cache: dict[int, Any] = {0: self._model}
        self._build_meta()

    # -- files ------------------------------------------------------------------------------------
    def _scan(self) -> None:
        self.model_files, self.optim_files = scan(self.dir)

    def path_of(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def _load_model_file(self, rank: int) -> dict[str, Any]:
        if rank not in self.model_files:
            raise CheckpointError(f"{self.path_of(f'zero_pp_rank_{rank}_mp_rank_00_model_states.pt')}: missing rank file "
                                  f"(written by rank {rank} of {self.world_size}); the checkpoint is incomplete")
        sd = safe_load.load(self.path_of(self.model_files[rank]))
        if not isinstance(sd, dict) or "module" not in sd:
            raise CheckpointError(f"{self.path_of(self.model_files[rank])}: not a DeepSpeed model-states file "
                                  "(no 'module' entry)")
        return sd

    def _optim_file(self, rank: int) -> str:
        if self.stage == 0 and not self.optim_files:  # no ZeRO: the optimizer is in the model file
            return self.path_of(self.model_files[0])
        if rank not in self.optim_files:
            prefix = next(iter(self.optim_files.values()), "zero_pp_rank_0_mp_rank_00_optim_states.pt")
            name = re.sub(r"zero_pp_rank_\d+_", f"zero_pp_rank_{rank}_", prefix)
            raise CheckpointError(f"{self.path_of(name)}: missing rank file (written by rank {rank} of "
                                  f"{self.world_size}); the checkpoint is incomplete")
        return self.path_of(self.optim_files[rank])

    def _optim(self, rank: int) -> dict[str, Any]:
        """Rank `rank`'s `optimizer_state_dict`. Each file is opened once, memory-mapped, and
        stays open until close(): reading a parameter takes its ranges from every rank's file
        without opening any again. The bytes are read with pread (safe_load.read_into), so the
        mappings are never touched and add nothing to resident memory."""
        if rank not in self._states:
            path = self._optim_file(rank)
            if self.stage == 0 and not self.optim_files:
                opt = stage0.optimizer_dict(self._model, path, self._stage0_names)
            else:
                sd = safe_load.load(path)
                opt = sd.get("optimizer_state_dict") if isinstance(sd, dict) else None
                if not isinstance(opt, dict):
                    raise CheckpointError(f"{path}: not a DeepSpeed optimizer-states file (no 'optimizer_state_dict')")
            self._states[rank] = opt
            try:
                fd: int | None = os.open(path, os.O_RDONLY)
            except OSError:
                fd = None
            self._fds[rank] = (fd, safe_load.mapped_ranges(path))
        return self._states[rank]

    # -- the description ------------------------------------------------------------------------------
    def _build_meta(self) -> None:
        sd = self._model
        model_path = self.path_of(self.model_files[0])
        self.config = cfg = sd.get("ds_config") if isinstance(sd.get("ds_config"), dict) else {}
        self.world_size = self._saved_world_size(sd)
        if int(sd.get("mp_world_size") or 1) != 1:
            raise CheckpointError(f"{model_path}: saved with model parallel size {sd['mp_world_size']}; only data "
                                  "parallel ZeRO checkpoints are supported")
        zero = cfg.get("zero_optimization") or {}
        self.stage = stage = int(zero.get("stage", 0) if isinstance(zero, dict) else 0)
        module = sd["module"]
        if not isinstance(module, dict):
            raise CheckpointError(f"{model_path}: 'module' is not a state dict")
        if stage == 0 and not self.optim_files:  # no ZeRO: one copy of everything, in the model file
            self.world_size = 1
            groups = [dict(g) for g in stage0.parameter_groups(sd, model_path)]
            self._stage0_names = [n for g in groups for n in g]
        else:
            groups = sd.get("param_shapes")
        for r in range(self.world_size):  # one clear error for a missing rank, before any reading
            self._optim_file(r)
            if stage == 3 and r not in self.model_files:
                self._load_model_file(r)
        first = self._optim(0)
        file_stage = first.get("zero_stage")  # a ZeroStageEnum Record, a tensor or an int
        if file_stage is not None:
            file_stage = file_stage.value if isinstance(file_stage, safe_load.Record) else file_stage
            self.stage = int(file_stage.item() if torch.is_tensor(file_stage) else file_stage)
        fp16 = (cfg.get("fp16") or {}).get("enabled", False) if isinstance(cfg.get("fp16"), dict) else False
        bf16 = any((cfg.get(k) or {}).get("enabled", False) for k in ("bf16", "bfloat16") if isinstance(cfg.get(k), dict))
        self.compute_dtype = torch.float16 if fp16 else torch.bfloat16 if bf16 else torch.float32

        if not isinstance(groups, list):
            raise CheckpointError(f"{model_path}: no 'param_shapes' (written by DeepSpeed's ZeRO optimizer); "
                                  "cannot map the flat partitions to parameters")
        self.groups: list[list[tuple[str, tuple[int, ...]]]] = [
            [(n, tuple(int(d) for d in s)) for n, s in g.items()] for g in groups]
        self.frozen = {n: tuple(int(d) for d in s) for n, s in (sd.get("frozen_param_shapes") or {}).items()}
        self.tied = {str(a): str(c) for a, c in (sd.get("shared_params") or {}).items()}

        trainable = {n: s for g in self.groups for n, s in g}
        self.tensors: dict[str, dict[str, Any]] = {}
        names = []
        for name, t in module.items():
            names.append(name)
            if name in self.tied:
                continue
            shape = trainable.get(name, self.frozen.get(name))
            dtype = t.dtype if torch.is_tensor(t) else self.compute_dtype
            self.tensors[name] = {"shape": list(tuple(t.shape) if shape is None else shape), "dtype": str(dtype),
                                  "trainable": name in trainable}
        for name, shape in list(trainable.items()) + list(self.frozen.items()):  # a parameter missing from module
            if name not in self.tensors and name not in self.tied:
                names.append(name)
                self.tensors[name] = {"shape": list(shape), "dtype": str(self.compute_dtype),
                                      "trainable": name in trainable}
        self.where: dict[str, list[Run]] = {}
        self._group_of: dict[str, int] = {}
        self._map_partitions(first)
        self.meta = describe(self, sd, names, first)

    def _saved_world_size(self, sd: dict[str, Any]) -> int:
        """How many ranks' partitions the files hold."""
        return int(sd.get("dp_world_size") or len(self.optim_files) or 1)

    def _map_partitions(self, first: dict[str, Any]) -> None:
        world = self.world_size
        if self.stage == 0:  # each parameter its own flat tensor (index j of the torch optimizer's state)
            for j, (gi, name, shape) in enumerate((gi, n, s) for gi, g in enumerate(self.groups) for n, s in g):
                self.where[name] = [Run(0, j, 0, 0, math.prod(shape))]
                self._group_of[name] = gi
            self.partition_sizes = [sum(math.prod(s) for _, s in g) for g in self.groups]
            self._flat_key = stage0.VALUES
            return
        if self.stage == 3:
            sizes = [t.numel() for t in first.get("fp32_flat_groups", [])]
            if 0 in sizes and os.path.isdir(os.path.join(self.dir, FOLDER)):  # swapped to NVMe
                want = [sum(math.ceil(math.prod(s) / world) for _, s in g) for g in self.groups]
                swapped = [i for i, n in enumerate(sizes) if n == 0 and i < len(want) and want[i]]
                sizes = [want[i] if i in swapped else n for i, n in enumerate(sizes)]
                self._offloaded = Offloaded(self.dir, swapped, sizes)
            flat = [(n, s) for g in self.groups for n, s in g]
            runs = layout.stage3_runs([math.prod(s) for _, s in flat], world, sizes)
            _, param_groups, _ = self.base_state(first)
            group_of_flat = {int(i): gi for gi, g in enumerate(param_groups) for i in g.get("params", [])}
            for (name, _), r in zip(flat, runs):
                self.where[name] = r
                self._group_of[name] = group_of_flat.get(r[0].flat if r else 0, 0)  # sub-group -> param group
            self._flat_key = "fp32_flat_groups"
            return
        key = "single_partition_of_fp32_groups"
        if key not in first:
            raise CheckpointError(f"{self._optim_file(0)}: no {key!r}: not a ZeRO stage 1/2 optimizer file")
        n_groups = len(first[key])
        if n_groups != len(self.groups):
            raise CheckpointError(f"{self._optim_file(0)}: {n_groups} flat groups, but the model file lists "
                                  f"{len(self.groups)} parameter groups")
        lengths, paddings = [], []  # [rank][group]
        for r in range(world):
            opt = self._optim(r)
            parts = opt.get(key)
            if not isinstance(parts, list) or len(parts) != n_groups:
                raise CheckpointError(f"{self._optim_file(r)}: {key!r} differs in form from rank 0's")
            lengths.append([t.numel() for t in parts])
            paddings.append([int(p) for p in opt.get("group_paddings") or [0] * n_groups])
        self.partition_sizes = []
        for i, g in enumerate(self.groups):
            numels = [math.prod(s) for _, s in g]
            size = layout.partition_size([n[i] for n in lengths], [p[i] for p in paddings], sum(numels),
                                         f"{self.dir} (param group {i})")
            self.partition_sizes.append(size)
            for (name, _), runs in zip(g, layout.flat_group_runs(numels, size, flat=i)):
                self.where[name] = runs
                self._group_of[name] = i
        self._flat_key = key

    def base_state(self, opt: dict[str, Any]) -> tuple[dict[int, dict[str, Any]], list[dict], Any]:
        """(per flat tensor: its optimizer state, param groups, a shared step or None)."""
        if self.stage in (0, 3):
            base = opt.get("optimizer_state_dict") or {}
            return base.get("state", {}), base.get("param_groups", []), None
        base = opt.get("base_optimizer_state")
        if isinstance(base, dict):  # rigid: torch's state dict over the flat partitions
            return base.get("state", {}), base.get("param_groups", []), None
        if isinstance(base, list):  # elastic: padding-free states, one step
            return dict(enumerate(base)), [], opt.get("base_optimizer_state_step")
        return {}, [], None

    # -- the CheckpointReader interface ------------------------------------------------------------
    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return self.meta["files"]

    def verify(self, names: list[str] | None = None) -> None:
        """Each file (all, or `names`) complete: every zip record present with its CRC-32 right."""
        for name in self.files if names is None else names:
            safe_load.check_complete(self.path_of(name))

    def read(self, name: str, field: str = "value", lo: int = 0, hi: int | None = None) -> torch.Tensor:
        name = self.canonical(name)
        if name not in self.tensors:
            raise CheckpointError(f"{self.dir}: no tensor named {name!r}")
        hi = self.numel(name) if hi is None else hi
        if name in self.where:
            key = None if field == "value" else field[len("optim."):] if field.startswith("optim.") else field
            return self._read_runs(name, key, lo, hi)
        if field != "value":
            raise CheckpointError(f"{self.dir}: {name!r} has no saved {field!r} (it is not a trainable parameter "
                                  "in the checkpoint)")
        return self._read_whole(name, lo, hi)

    def _read_runs(self, name: str, key: str | None, lo: int, hi: int) -> torch.Tensor:
        parts = []
        for run, a, b in sorted(layout.overlapping(self.where[name], lo, hi), key=lambda x: x[0].rank):
            src = self._flat(run.rank, run.flat, key)
            s = run.start + (a - run.lo)
            if s + (b - a) > src.numel():
                raise CheckpointError(f"{self._optim_file(run.rank)}: flat tensor {run.flat} has {src.numel()} "
                                      f"elements, {name!r} needs [{s}, {s + b - a}): the file does not match the layout "
                                      "its model file describes")
            parts.append((a, run.rank, src[s : s + (b - a)]))
        if sum(p[2].numel() for p in parts) != hi - lo:
            raise CheckpointError(f"{self.dir}: the saved partitions of {name!r} do not cover elements [{lo}, {hi})")
        out = safe_load.fp32_buffer(hi - lo)
        for a, rank, src in parts:  # read from the file into place (a 16-bit source: through one buffer)
            dst = out[a - lo : a - lo + src.numel()]
            buf = dst if src.dtype == torch.float32 else torch.empty(src.numel(), dtype=src.dtype)
            safe_load.read_into(buf, src, *self._fds.get(rank, (None, [])))
            if buf is not dst:
                dst.copy_(buf)
        return out

    def _flat(self, rank: int, flat: int, key: str | None) -> torch.Tensor:
        if self._offloaded is not None and flat in self._offloaded.swapped:
            return self._offloaded.tensor(rank, flat, key)
        opt = self._optim(rank)
        if key is None:
            tensors = opt.get(self._flat_key)
            if not isinstance(tensors, list) or flat >= len(tensors):
                raise CheckpointError(f"{self._optim_file(rank)}: no {self._flat_key}[{flat}]")
            return tensors[flat]
        state, _, _ = self.base_state(opt)
        entry = state.get(flat) if isinstance(state, dict) else None
        if entry is None or key not in entry or not torch.is_tensor(entry[key]):
            raise CheckpointError(f"{self._optim_file(rank)}: no optimizer state {key!r} for flat group {flat}")
        return entry[key].reshape(-1)

    def _read_whole(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """A tensor DeepSpeed keeps outside the flat groups: a buffer, or a frozen parameter
        (stage 3: each rank's fragment; stages 0-2: whole, in the module)."""
        if self.stage == 3 and name in self.frozen:
            parts = []
            n = self.numel(name)
            part = math.ceil(n / self.world_size)
            for r in range(self.world_size):
                a, b = max(lo, r * part), min(hi, (r + 1) * part, n)
                if a < b:
                    frag = self._model_file(r).get("frozen_param_fragments", {}).get(name)
                    if frag is None:
                        raise CheckpointError(f"{self.path_of(self.model_files.get(r, '?'))}: no fragment of frozen "
                                              f"parameter {name!r}")
                    parts.append(frag.reshape(-1)[a - r * part : b - r * part].clone())
            return torch.cat(parts) if parts else torch.empty(0)
        frags = self._model.get("frozen_param_fragments") or {}
        t = frags.get(name) if name in frags else self._model["module"].get(name)
        if t is None or not torch.is_tensor(t) or t.numel() != self.numel(name):
            raise CheckpointError(f"{self.path_of(self.model_files[0])}: no saved value of {name!r}")
        return t.reshape(-1)[lo:hi].clone()

    def _model_file(self, rank: int) -> dict[str, Any]:
        if rank not in self._model_cache:
            if len(self._model_cache) > 1:
                self._model_cache = {0: self._model}
            self._model_cache[rank] = self._load_model_file(rank)
        return self._model_cache[rank]

    def scalars(self, name: str, field: str) -> list[torch.Tensor]:
        """The scalar state (Adam's `step`) of every DeepSpeed flat tensor holding part of `name`."""
        key = field[len("optim."):]
        runs = self.where.get(self.canonical(name), [])
        return [self._scalar(run.rank, run.flat, key) for run in runs]

    def _scalar(self, rank: int, flat: int, key: str) -> torch.Tensor:
        opt = self._optim(rank)
        state, _, shared = self.base_state(opt)
        value = (state.get(flat) or {}).get(key, shared if key == "step" else None)
        if value is None:
            raise CheckpointError(f"{self._optim_file(rank)}: no optimizer state {key!r} for flat group {flat}")
        return value.detach().clone() if torch.is_tensor(value) else torch.tensor(float(value))

    def any_scalar(self, group: int, field: str) -> torch.Tensor | None:
        for name, g in self._group_of.items():
            if g == group and self.where.get(name):
                run = self.where[name][0]
                return self._scalar(run.rank, run.flat, field[len("optim."):])
        return None

    def param_group_of(self, name: str) -> int | None:
        return self._group_of.get(self.canonical(name))

    def close(self) -> None:
        for fd, _ in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._states, self._fds = {}, {}
        self._model_cache = {}
