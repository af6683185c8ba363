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
import contextlib
import fcntl
import logging
import os
import shutil
import socket
import threading
from dataclasses import dataclass

import torch

from zeroshard.offload.aio import Handle, IOEngine, align_up, aligned_empty, self_test
from zeroshard.offload.read_ahead import WRITE_BUFFERS, ReadAhead
from zeroshard.offload.nvme_disk import PREFIX, aio_settings, check_path, check_space, sweep_stale
from zeroshard.offload.tiers import Home, Tier
from zeroshard.partition.flat_bucket import placeholder
from zeroshard.policies import AioPolicy, NvmeError

log = logging.getLogger("zeroshard")

_SELFTESTS: dict[str, tuple[float, float]] = {}  # folder's device -> (write, read) GB/s, once per process


@dataclass(frozen=True)
class Region:
    """Bytes [offset, offset + nbytes) of the tier's file; nbytes is ALIGN-rounded."""

    offset: int
    nbytes: int


class NvmeTier(Tier):
    """Shards in one file per process under `nvme_path`. `place` writes a tensor and returns its
    placeholder; `read`/`write` are the asynchronous moves; `fetch`/`store` the synchronous ones."""

    name = "nvme"

    def __init__(self, nvme_path: str | None, aio: AioPolicy, purpose: str, rank: int = 0,
                 read_ahead: tuple[int, int] = (0, 0)) -> None:
        """`read_ahead` = (buffers, elements per buffer): `fetch` reads that many shards ahead,
        following the order of earlier fetches, into a pool of that many host buffers."""
        super().__init__(torch.device("cpu"))
        root = check_path(nvme_path)
        self.removed_stale = sweep_stale(root)
        name = f"{PREFIX}{socket.gethostname()}-{os.getpid()}-r{rank}-{purpose}"
        self.folder = os.path.join(root, name)
        try:
            # made under a name the sweep ignores, locked, then renamed: a folder the other ranks'
            # sweeps can see always holds a lock that a live process keeps
            making = os.path.join(root, f".making-{name}")
            os.makedirs(making, exist_ok=True)
            self._lock_fd = os.open(os.path.join(making, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(making, self.folder)
        except OSError as exc:
            raise NvmeError(f"cannot create the run folder {self.folder}: {exc.strerror or exc}; check nvme_path") from exc
        settings, self.aio_lines = aio_settings(aio)
        self.io = IOEngine(self.folder, settings)
        self.path = self.io.open("shards.bin")
        self._end = 0
        self._regions: dict[int, tuple[Region, torch.Tensor]] = {}  # id(placeholder) -> (region, placeholder)
        self._closed = False
        self._lock = threading.Lock()
        self.ahead = ReadAhead(self, *read_ahead) if read_ahead[0] > 0 else None
        self.startup_lines: list[str] = []
        atexit.register(self.close)

    # -- start-up --------------------------------------------------------------------------------
    def self_test_line(self, nbytes: int = 32 << 20) -> str:
        """The start-up line of this folder's disk speed through the engine, measured once per process."""
        key = str(os.stat(self.folder).st_dev) + self.io.mode
        if key not in _SELFTESTS:
            _SELFTESTS[key] = self_test(self.io, nbytes)
        write_gbs, read_gbs = _SELFTESTS[key]
        return (f"nvme self-test: write {write_gbs:.2f} GB/s, read {read_gbs:.2f} GB/s"
                + ("" if self.io.direct else " (buffered: reads may come from the page cache)"))

    def describe(self) -> str:
        return f"nvme ({self.folder}; {self.io.describe()})"

    def prepare(self, need: int, sharers: int, ledger=None) -> list[str]:
        """Before any shard is placed: check the space for `need` bytes per process, run the
        self-test, count the read-ahead pool in `ledger`; the start-up lines (also kept in
        `startup_lines`)."""
        space = check_space(self.folder, need, sharers)
        lines = [f"nvme tier ({self.folder.rsplit('-', 1)[-1]}): {self.describe()}; {space}"
                 + (f"; removed {len(self.removed_stale)} stale run folder(s)" if self.removed_stale else ""),
                 self.self_test_line()]
        if self.ahead is not None:
            self.ahead.ledger = ledger
            lines.append(f"nvme parameter read-ahead: {self.ahead.count} host buffer(s) (offload_param.buffer_count) "
                         f"of up to {self.ahead.numel:,} elements (buffer_size); shards are read ahead of their gather "
                         "in the order gathers came in earlier passes; larger shards are read when gathered; "
                         f"updated shards are written behind through {WRITE_BUFFERS} more such buffer(s), and a read "
                         "of a shard whose write is still running is served from the buffer holding it; "
                         "max_in_cpu: no cache beyond these buffers")
        self.startup_lines = lines + [f"  {line}" for line in self.aio_lines]
        return self.startup_lines

    @property
    def bytes_on_disk(self) -> int:
        return self._end

    # -- storage ---------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> Region:
        with self._lock:
            region = Region(self._end, align_up(max(nbytes, 1)))
            self._end += region.nbytes
            # the file covers every region whole, so aligned (O_DIRECT) reads of a region never
            # run past its end; the unwritten tail of a region reads as zeros (a sparse extent)
            self.io.truncate(self.path, self._end)
        return region

    def region_of(self, home: torch.Tensor) -> Region | None:
        entry = self._regions.get(id(home))
        return entry[0] if entry is not None and entry[1] is home else None

    def write(self, region: Region, t: torch.Tensor) -> Handle:
        if t.nbytes > region.nbytes:
            raise ValueError("nvme tier: tensor larger than its region")
        return self.io.write(self.path, t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1),
                             region.offset)

    def read(self, region: Region, t: torch.Tensor) -> Handle:
        if t.nbytes > region.nbytes:
            raise ValueError("nvme tier: tensor larger than its region")
        if not t.is_contiguous():
            raise ValueError("nvme tier: reads go into contiguous buffers")
        return self.io.read(self.path, t.view(-1), region.offset)

    def wait(self, handle: Handle) -> int:
        return handle.wait()

    # -- the Tier interface ----------------------------------------------------------------------
    def place(self, tensor: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """Write `tensor` to a new region; return its placeholder (the file holds the values).
        A placeholder of this tier is in place already and comes back as it is."""
        if self.region_of(tensor) is not None:
            return tensor
        t = tensor.detach().to("cpu").contiguous()
        region = self.allocate(t.nbytes)
        self.wait(self.write(region, t))
        home = placeholder(t.shape, t.dtype)
        self._regions[id(home)] = (region, home)
        return home

    def home(self, tensor: torch.Tensor, copy: bool = False) -> "NvmeHome":
        """`tensor`'s values written to a new region of the file; its home reads and writes them."""
        return NvmeHome(self, self.place(tensor))

    def placed(self) -> list[tuple[int, Region, torch.Tensor]]:
        """(key, region, placeholder) of every shard placed on this tier."""
        return [(key, region, home) for key, (region, home) in self._regions.items()]

    def region_by_key(self, key: int) -> Region | None:
        entry = self._regions.get(key)
        return entry[0] if entry is not None else None

    def fetch(self, home: torch.Tensor, device: torch.device, stream=None) -> torch.Tensor:
        """A fresh tensor with `home`'s values (from the read-ahead pool when it was predicted)."""
        region = self.region_of(home)
        if region is None:
            return super().fetch(home, device, stream)
        if self.ahead is not None:
            out = self.ahead.fetch(home, region)
        else:
            out = torch.empty(home.shape, dtype=home.dtype)
            self.wait(self.read(region, out))
        return out if torch.device(device).type == "cpu" else out.to(device, non_blocking=False)

    def store(self, home: torch.Tensor, work: torch.Tensor) -> None:
        region = self.region_of(home)
        if region is None:  # an ordinary tensor (e.g. a device shard) takes the values by copy
            super().store(home, work)
            return
        work = work.detach().to("cpu")
        if self.ahead is not None and self.ahead.store(home, region, work):
            return  # written behind; until it lands, reads of it are served from its buffer
        self.wait(self.write(region, work.to(dtype=home.dtype).contiguous()))

    def same_memory(self, device: torch.device) -> bool:
        return False

    def close(self) -> None:
        """Stop the I/O threads and remove this run's folder (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.ahead is not None:
                self.ahead.drop_all()
            self.io.close()
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.close(self._lock_fd)
        with contextlib.suppress(Exception):  # pragma: no cover - interpreter shutting down
            atexit.unregister(self.close)


class NvmeHome(Home):
    """A shard in a region of the tier's file; `tensor` is its placeholder."""

    def read(self) -> torch.Tensor:
        return self.tier.fetch(self.tensor, torch.device("cpu"))

    def write(self, value: torch.Tensor, asynchronous: bool = False) -> None:
        self.tier.store(self.tensor, value)


__all__ = ["NvmeHome", "NvmeTier", "Region", "aio_settings", "aligned_empty", "check_path", "check_space",
           "placeholder", "sweep_stale"]
