"""Process group and device: one validated object, created once by `setup_topology`.

Uses the default process group when one exists (a user or a test made it), else
creates it from torchrun's environment, else runs as a single process (world 1).
It remembers whether it created the group, and only then destroys it.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from zeroshard.policies import CommError

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Topology:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str  # "gloo", "nccl" or "none" (single process, no group)
    owns_group: bool
    # zeroshard's collectives run on `group`: the default group when zeroshard created it (with
    # comm_timeout_s), else a group of all ranks made here with comm_timeout_s, so a dead or
    # stuck peer is reported within it even where the backend blocks inside the call (gloo's
    # reduce-scatter), whatever timeout the user's own group has (30 minutes by default)
    group: Any = None

    @property
    def distributed(self) -> bool:
        return self.backend != "none"

    def destroy(self) -> None:
        """Destroy the default group, but only if this topology created it; else only the
        group of its own that it made."""
        if self.owns_group and dist.is_initialized():
            dist.destroy_process_group()
            _created.clear()
        else:
            self.release_group()

    def release_group(self) -> None:
        """Destroy the group this topology made for itself on a user's default group."""
        if self.group is not None and dist.is_initialized() and self.group in _own_groups:
            _own_groups.remove(self.group)
            dist.destroy_process_group(self.group)


_created: list[bool] = []  # non-empty while a group zeroshard created is alive
_own_groups: list[Any] = []  # groups made on a user's default group, until released

# Modules torch imports lazily on first use (building any torch.optim optimizer imports
# torch._dynamo). Imported after the process group exists, they keep a reference to it that
# destroy_process_group() does not drop: its gloo threads then live on into interpreter
# shutdown, where their destruction sometimes aborts the process ("terminate called without
# an active exception", SIGABRT) after training succeeded. Imported first, they hold nothing.
_IMPORT_BEFORE_GROUP = ("torch._dynamo",)


def _import_lazy_torch_modules() -> None:
    for name in _IMPORT_BEFORE_GROUP:
        try:
            importlib.import_module(name)
        except ImportError:  # a torch build without it has nothing to capture the group either
            pass


def _destroy_at_exit() -> None:
    """The group zeroshard created is destroyed before interpreter shutdown even when the
    script never called `engine.close()`."""
    if _created and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _created.clear()
    _own_groups.clear()


def world_size_hint() -> int:
    """World size before any group exists: the live group's, else torchrun's, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _device_for(local_rank: int, backend: str) -> torch.device:
    if backend == "nccl" or (backend == "none" and torch.cuda.is_available()):
        torch.cuda.set_device(local_rank % max(torch.cuda.device_count(), 1))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def setup_topology(timeout_s: float) -> Topology:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    owns = False
    if not dist.is_initialized():
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and missing:
            raise CommError(
                f"WORLD_SIZE={os.environ['WORLD_SIZE']} but {', '.join(missing)} not set: "
                "launch with `torchrun` (or `zeroshard launch`), which sets all of them."
            )
        if missing:
            device = _device_for(local_rank, "none")
            return Topology(0, 1, 0, 1, device, "none", False)
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = _device_for(local_rank, backend)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        _import_lazy_torch_modules()
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        atexit.unregister(_destroy_at_exit)  # once, however many groups a process makes in turn
        atexit.register(_destroy_at_exit)
        _created[:] = [True]
        owns = True
    backend = dist.get_backend()
    device = _device_for(local_rank, "nccl" if "nccl" in str(backend) else "gloo")
    group = None
    if not owns:  # a collective: every rank of the user's group makes it at the same point
        group = dist.new_group(timeout=datetime.timedelta(seconds=timeout_s))
        _own_groups.append(group)
    return Topology(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        local_world_size=min(local_world, dist.get_world_size()),
        device=device,
        backend=str(backend),
        owns_group=owns,
        group=group,
    )
