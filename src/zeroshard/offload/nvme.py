"""The NVMe tier (ZeRO-Infinity): shards live in files under `nvme_path`, moved to and from
host buffers by the thread-pool I/O engine of `zeroshard.offload.aio`.

Each process gets its own run folder `nvme_path/zeroshard-<host>-<pid>-<purpose>` holding a
`.lock` it keeps `flock`ed while alive. At start every sibling folder whose lock can be taken
belongs to a run that died without cleaning up, and is removed. The folder is removed by
`close()` and, as a fallback, at interpreter exit.

A shard placed on this tier is represented in memory by a *placeholder*: a tensor with the
shard's shape and dtype whose storage is one element expanded to that shape (shape and numel
queries work, a read gives NaN, an in-place write raises). Its bytes are in a region of the
tier's file; `read`/`write` move them between the file and a host buffer asynchronously.

Nothing here knows about stages, buckets or optimizers.
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import socket
import threading
from dataclasses import dataclass

import torch

from zeroshard.offload.aio import ALIGN, AioSettings, Handle, IOEngine, align_up, aligned_empty, self_test
from zeroshard.offload.tiers import Tier
from zeroshard.policies import AioPolicy, NvmeError, NvmeSpaceError

log = logging.getLogger("zeroshard")

PREFIX = "zeroshard-"
_SELFTESTS: dict[str, tuple[float, float]] = {}  # folder's device -> (write, read) GB/s, once per process


def aio_settings(policy: AioPolicy) -> tuple[AioSettings, list[str]]:
    """The I/O engine's settings from DeepSpeed's `aio` block, and one line per key saying what
    it became (libaio's knobs have no one-to-one meaning for a thread pool)."""
    threads = max(1, min(64, policy.queue_depth * policy.intra_op_parallelism))
    lines = [
        f"aio.block_size={policy.block_size}: each request is cut into pieces of this many bytes",
        f"aio.queue_depth={policy.queue_depth} x aio.intra_op_parallelism={policy.intra_op_parallelism}: "
        f"{threads} I/O thread(s), each with one positioned read/write in flight (so up to {threads} "
        "requests are outstanding, as libaio's queue would hold)",
        f"aio.single_submit={str(policy.single_submit).lower()}: "
        + ("the pieces of a request run one after another" if policy.single_submit
           else "the pieces of a request are submitted together"),
        f"aio.overlap_events={str(policy.overlap_events).lower()}: "
        + ("requests run in the background; callers wait only when they need the data" if policy.overlap_events
           else "every request is waited for as it is submitted (no overlap)"),
    ]
    if policy.use_gds:
        lines.append("aio.use_gds=true: ignored, GPUDirect Storage needs a GPU and cuFile; host buffers are used")
    block = align_up(max(policy.block_size, ALIGN))
    return AioSettings(block_size=block, threads=threads, single_submit=policy.single_submit,
                       overlap=policy.overlap_events), lines


def _lock_is_stale(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, ".lock"), os.O_RDWR)
    except OSError:
        return True  # no lock file: a run that died while creating its folder
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False  # a live process holds it
    finally:
        os.close(fd)


def sweep_stale(nvme_path: str) -> list[str]:
    """Remove the run folders under `nvme_path` that no live process holds."""
    removed = []
    try:
        names = os.listdir(nvme_path)
    except OSError:
        return removed
    for name in names:
        path = os.path.join(nvme_path, name)
        if name.startswith(PREFIX) and os.path.isdir(path) and _lock_is_stale(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def check_path(nvme_path: str | None) -> str:
    """`nvme_path` as an absolute directory this process can write, or one clear error."""
    if not nvme_path:
        raise NvmeError("offload device 'nvme' needs nvme_path: set offload_optimizer.nvme_path / "
                        "offload_param.nvme_path (or --nvme-path) to a directory on a fast local drive")
    path = os.path.abspath(os.path.expanduser(nvme_path))
    if not os.path.isdir(path):
        raise NvmeError(f"nvme_path {path!r} does not exist or is not a directory; create it (mkdir -p {path}) "
                        "or point nvme_path at an existing directory on the NVMe drive")
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeError(f"nvme_path {path!r} is not writable by this user; fix its permissions or choose "
                        "another directory")
    return path


def check_space(folder: str, need: int, sharers: int = 1) -> str:
    """Raise NvmeSpaceError unless the disk under `folder` has room for `need` bytes for each of
    `sharers` processes (the local ranks writing there) plus 1 GiB of slack; a line saying so."""
    free = shutil.disk_usage(folder).free
    total = need * max(1, sharers)
    slack = 1 << 30
    if total + slack > free:
        raise NvmeSpaceError(
            f"nvme_path {folder!r} has {free / 2**30:.2f} GiB free, but this run needs {total / 2**30:.2f} GiB "
            f"({need / 2**30:.2f} GiB x {sharers} local rank(s)) + 1 GiB slack; free space there, use a larger "
            "drive, or offload less (offload_optimizer.device: cpu, or a larger world size)")
    return (f"needs {total / 2**30:.2f} GiB on disk ({sharers} local rank(s)), {free / 2**30:.1f} GiB free")


@dataclass(frozen=True)
class Region:
    """Bytes [offset, offset + nbytes) of the tier's file; nbytes is ALIGN-rounded."""

    offset: int
    nbytes: int


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `shape` and `dtype` holding one element (NaN) expanded: no real storage."""
    fill = float("nan") if dtype.is_floating_point else 0
    return torch.full((), fill, dtype=dtype).expand(tuple(shape))


class NvmeTier(Tier):
    """Shards in one file per process under `nvme_path`. `place` writes a tensor and returns its
    placeholder; `read`/`write` are the asynchronous moves; `fetch`/`store` the synchronous ones."""

    name = "nvme"

    def __init__(self, nvme_path: str | None, aio: AioPolicy, purpose: str, rank: int = 0) -> None:
        super().__init__(torch.device("cpu"))
        root = check_path(nvme_path)
        self.removed_stale = sweep_stale(root)
        self.folder = os.path.join(root, f"{PREFIX}{socket.gethostname()}-{os.getpid()}-r{rank}-{purpose}")
        try:
            os.makedirs(self.folder, exist_ok=True)
            self._lock_fd = os.open(os.path.join(self.folder, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            raise NvmeError(f"cannot create the run folder {self.folder}: {exc.strerror or exc}; check nvme_path") from exc
        settings, self.aio_lines = aio_settings(aio)
        self.io = IOEngine(self.folder, settings)
        self.path = self.io.open("shards.bin")
        self._end = 0
        self._regions: dict[int, tuple[Region, torch.Tensor]] = {}  # id(placeholder) -> (region, placeholder)
        self._closed = False
        self._lock = threading.Lock()
        atexit.register(self.close)

    # -- start-up --------------------------------------------------------------------------------
    def self_test(self, nbytes: int = 32 << 20) -> tuple[float, float]:
        """Measured (write, read) GB/s of this folder's disk through the engine, once per process."""
        key = str(os.stat(self.folder).st_dev) + self.io.mode
        if key not in _SELFTESTS:
            _SELFTESTS[key] = self_test(self.io, nbytes)
        return _SELFTESTS[key]

    def describe(self) -> str:
        return f"nvme ({self.folder}; {self.io.describe()})"

    @property
    def bytes_on_disk(self) -> int:
        return self._end

    # -- storage ---------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Region:
        with self._lock:
            region = Region(self._end, align_up(max(nbytes, 1)))
            self._end += region.nbytes
        return region

    def region_of(self, home: torch.Tensor) -> Region | None:
        entry = self._regions.get(id(home))
        return entry[0] if entry is not None and entry[1] is home else None

    def write(self, region: Region, t: torch.Tensor) -> Handle:
        if t.numel() * t.element_size() > region.nbytes:
            raise ValueError("nvme tier: tensor larger than its region")
        return self.io.write(self.path, t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1),
                             region.offset)

    def read(self, region: Region, t: torch.Tensor) -> Handle:
        if t.numel() * t.element_size() > region.nbytes:
            raise ValueError("nvme tier: tensor larger than its region")
        if not t.is_contiguous():
            raise ValueError("nvme tier: reads go into contiguous buffers")
        return self.io.read(self.path, t.view(-1), region.offset)

    def wait(self, handle: Handle) -> int:
        return self.io.wait(handle)

    # -- the Tier interface ----------------------------------------------------------------------
    def place(self, tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """Write `tensor` to a new region; return its placeholder (the file holds the values)."""
        t = tensor.detach().to("cpu").contiguous()
        region = self.allocate(t.numel() * t.element_size())
        self.wait(self.write(region, t))
        home = placeholder(t.shape, t.dtype)
        self._regions[id(home)] = (region, home)
        return home

    def fetch(self, home: torch.Tensor, device: torch.device, stream=None) -> torch.Tensor:
        region = self.region_of(home)
        if region is None:
            return super().fetch(home, device, stream)
        out = torch.empty(home.shape, dtype=home.dtype)
        self.wait(self.read(region, out))
        return out if torch.device(device).type == "cpu" else out.to(device)

    def store(self, home: torch.Tensor, work: torch.Tensor) -> None:
        region = self.region_of(home)
        if region is None:  # an ordinary tensor (e.g. a device shard) takes the values by copy
            super().store(home, work)
            return
        self.wait(self.write(region, work.detach().to("cpu")))

    def same_memory(self, device: torch.device) -> bool:
        return False

    def close(self) -> None:
        """Stop the I/O threads and remove this run's folder (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.io.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            try:
                os.close(self._lock_fd)
            except OSError:
                pass
        try:
            atexit.unregister(self.close)
        except Exception:  # pragma: no cover - interpreter shutting down
            pass


__all__ = ["NvmeTier", "Region", "aio_settings", "aligned_empty", "check_path", "check_space", "placeholder",
           "sweep_stale"]
