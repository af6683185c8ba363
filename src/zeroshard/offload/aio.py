"""Asynchronous file I/O in Python + torch: a pool of threads doing positioned reads and
writes (`os.preadv` / `os.pwritev`, which release the GIL) into page-aligned host buffers.

Nothing to compile. `O_DIRECT` is used where the filesystem accepts it (probed once per
folder: open with O_DIRECT and write one aligned block) and buffered I/O otherwise; which one
runs is reported. A request is cut into pieces of MAX_PIECE (a smaller request is one piece,
never under `block_size`), each a task of the pool; the kernel splits a piece into the disk's
own request size and queues those together, as for `dd bs=64M`. With synchronous
syscalls the number of requests in flight at once is the thread count, so the pool has
`queue_depth x intra_op_parallelism` threads (DeepSpeed's aio knobs, mapped). Large pieces
matter on a virtual disk: there each request costs the host a fixed overhead, and writes of
64 MiB pieces measured 0.16-0.21 GB/s against 0.05-0.08 GB/s for 1 MiB pieces on the same
path in the same run (bench/bench_nvme.py --io-only --sweep, bench/RESULTS.md, issue 24).
Short reads and writes are retried from where they stopped; ENOSPC becomes a
`NvmeSpaceError` naming the folder and what to do.

Nothing here knows about stages, buckets or optimizers.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import torch

from zeroshard.policies import NvmeError, NvmeSpaceError

ALIGN = 4096  # O_DIRECT needs buffer address, file offset and length aligned to the logical block
MAX_PIECE = 64 << 20  # the largest piece one thread moves in one syscall
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def aligned_empty(nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """An uninitialised 1-D tensor of `nbytes` (rounded up to ALIGN) whose data starts on a
    page boundary, as O_DIRECT needs. The allocation is ALIGN bytes larger than asked."""
    nbytes = align_up(max(nbytes, 1))
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % ALIGN
    out = raw[skip: skip + nbytes]
    return out.view(dtype) if dtype != torch.uint8 else out


def _view(t: torch.Tensor, start: int, length: int):
    """A writable buffer object over bytes [start, start + length) of contiguous tensor `t`."""
    return (ctypes.c_char * length).from_address(t.data_ptr() + start)


@dataclass(frozen=True)
class AioSettings:
    """What the engine uses, from the `aio` block (see `from_policy`)."""

    block_size: int = 1 << 20
    threads: int = 8
    single_submit: bool = False
    overlap: bool = True


def piece_size(nbytes: int, settings: AioSettings) -> int:
    """Bytes per piece of an `nbytes` request: the whole request up to MAX_PIECE (larger ones
    are cut into MAX_PIECE pieces that the threads move at once), never under `block_size`."""
    return max(settings.block_size, min(MAX_PIECE, align_up(max(nbytes, 1))))


def probe_direct(folder: str) -> tuple[bool, str]:
    """Can files in `folder` be opened with O_DIRECT and written with an aligned block?"""
    if not _O_DIRECT:
        return False, "buffered I/O (this OS has no O_DIRECT)"
    path = os.path.join(folder, ".zeroshard-odirect-probe")
    fd = -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _O_DIRECT, 0o600)
        buf = aligned_empty(ALIGN)
        buf.zero_()
        if os.pwritev(fd, [_view(buf, 0, ALIGN)], 0) != ALIGN:
            return False, "buffered I/O (O_DIRECT short write on this filesystem)"
        return True, "O_DIRECT (page cache bypassed)"
    except OSError as exc:
        return False, f"buffered I/O (O_DIRECT refused here: {exc.strerror or exc})"
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)


class Handle:
    """An asynchronous request: `wait()` blocks until every piece is done and raises the first
    error (ENOSPC as NvmeSpaceError). `done()` never blocks."""

    def __init__(self, futures: list[Future], nbytes: int, what: str) -> None:
        self._futures, self.nbytes, self.what = futures, nbytes, what
        self.wait_s = 0.0

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def wait(self) -> int:
        started = time.perf_counter()
        error = None
        for f in self._futures:
            exc = f.exception()
            error = error or exc
        self._futures = []
        self.wait_s = time.perf_counter() - started
        if error is not None:
            raise error
        return self.nbytes


DONE = Handle([], 0, "nothing")


def after(first: list[Handle], then: Callable[[], list[Handle]], nbytes: int, what: str) -> Handle:
    """A request that starts once `first` are done, without the caller waiting for them:
    `then()` runs on a thread of its own when they are, and the handle is done when the
    requests it started are (an error of either is raised by `wait`)."""
    done: Future = Future()
    pending = list(first)

    def run() -> None:
        try:
            for h in pending:
                h.wait()
            for h in then():
                h.wait()
            done.set_result(None)
        except BaseException as exc:  # handed to whoever waits
            done.set_exception(exc)

    threading.Thread(target=run, name="zeroshard-aio-after", daemon=True).start()
    return Handle([done], nbytes, what)


class IOEngine:
    """A thread pool doing positioned I/O on files of one folder."""

    def __init__(self, folder: str, settings: AioSettings) -> None:
        self.folder, self.settings = folder, settings
        self.direct, self.mode = probe_direct(folder)
        self._pool = ThreadPoolExecutor(max_workers=settings.threads, thread_name_prefix="zeroshard-aio")
        self._fds: dict[str, tuple[int, int]] = {}  # path -> (buffered fd, direct fd or -1)
        self._lock = threading.Lock()
        self.bytes_read = self.bytes_written = 0

    def describe(self) -> str:
        s = self.settings
        return (f"{self.mode}, {s.threads} I/O thread(s), pieces of {s.block_size // 1024} KiB to "
                f"{max(s.block_size, MAX_PIECE) >> 20} MiB (a request up to that is one piece)"
                + (", single submit" if s.single_submit else "") + ("" if s.overlap else ", no overlap"))

    def open(self, name: str) -> str:
        path = os.path.join(self.folder, name)
        with self._lock:
            if path not in self._fds:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
                    dfd = os.open(path, os.O_RDWR | _O_DIRECT) if self.direct else -1
                except OSError as exc:
                    raise NvmeError(f"cannot open {path}: {exc.strerror or exc}; check that nvme_path is a "
                                    "writable directory") from exc
                self._fds[path] = (fd, dfd)
        return path

    def _fd(self, path: str, t: torch.Tensor, offset: int) -> tuple[int, int]:
        """(fd for this request, buffered fd): O_DIRECT when buffer, offset and length allow."""
        fd, dfd = self._fds[path]
        if dfd >= 0 and t.data_ptr() % ALIGN == 0 and t.nbytes % ALIGN == 0 and offset % ALIGN == 0:
            return dfd, fd
        return fd, fd

    def write(self, path: str, t: torch.Tensor, offset: int) -> Handle:
        return self._submit(path, t, offset, write=True)

    def read(self, path: str, t: torch.Tensor, offset: int) -> Handle:
        return self._submit(path, t, offset, write=False)

    def _submit(self, path: str, t: torch.Tensor, offset: int, write: bool) -> Handle:
        if not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError("aio: the buffer must be a contiguous CPU tensor")
        nbytes = t.nbytes
        fd = self._fd(path, t, offset)
        block = piece_size(nbytes, self.settings)
        pieces = [(s, min(block, nbytes - s)) for s in range(0, nbytes, block)]
        what = f"{'write' if write else 'read'} of {nbytes:,} bytes at {offset:,} in {path}"
        if self.settings.single_submit:  # one request at a time: the pieces run one after another
            futures = [self._pool.submit(self._serial, fd, t, offset, pieces, write, path)]
        else:
            futures = [self._pool.submit(self._piece, fd, t, offset, s, n, write, path) for s, n in pieces]
        with self._lock:  # requests may start on a chain's thread (`after`)
            if write:
                self.bytes_written += nbytes
            else:
                self.bytes_read += nbytes
        handle = Handle(futures, nbytes, what)
        if not self.settings.overlap:
            handle.wait()
        return handle

    def _serial(self, fd, t, offset, pieces, write, path) -> None:
        for s, n in pieces:
            self._piece(fd, t, offset, s, n, write, path)

    def _piece(self, fds: tuple[int, int], t: torch.Tensor, offset: int, start: int, length: int, write: bool,
               path: str) -> None:
        fd, buffered = fds
        done = 0
        while done < length:  # short transfers are retried from where they stopped
            if done and (offset + start + done) % ALIGN:
                fd = buffered  # an unaligned remainder cannot go through O_DIRECT
            buf = _view(t, start + done, length - done)
            try:
                n = (os.pwritev if write else os.preadv)(fd, [buf], offset + start + done)
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    raise NvmeSpaceError(
                        f"the disk under {self.folder} is full (ENOSPC while writing {path}); free space "
                        "there, or point offload_*.nvme_path at a larger drive. Checkpoints already saved "
                        "are untouched.") from exc
                raise NvmeError(f"{'write' if write else 'read'} failed in {path} at {offset + start + done}: "
                                f"{exc.strerror or exc}") from exc
            if n == 0:
                if write:
                    raise NvmeError(f"write made no progress in {path} at {offset + start + done}")
                raise NvmeError(f"read past the end of {path} at {offset + start + done}: the file is shorter "
                                "than zeroshard wrote it (was it truncated or removed while training?)")
            done += n

    def discard(self, path: str) -> None:
        """Close and delete one file of this engine (its requests must be finished)."""
        with self._lock:
            fds = self._fds.pop(path, None)
        if fds is not None:
            os.close(fds[0])
            if fds[1] >= 0:
                os.close(fds[1])
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def sync(self, path: str | None = None) -> None:
        """fsync one file of this engine, or all of them."""
        for fd, _ in ([self._fds[path]] if path is not None else self._fds.values()):
            os.fsync(fd)

    def truncate(self, path: str, nbytes: int) -> None:
        """Set the length of one file of this engine (a sparse extent where it grows)."""
        os.ftruncate(self._fds[path][0], nbytes)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for fd, dfd in self._fds.values():
            os.close(fd)
            if dfd >= 0:
                os.close(dfd)
        self._fds.clear()


def self_test(engine: IOEngine, nbytes: int = 64 << 20) -> tuple[float, float]:
    """Write then read `nbytes` through `engine` in a scratch file; (write, read) in GB/s.
    With buffered I/O the read comes mostly from the page cache and says little about the disk."""
    name = ".zeroshard-selftest"
    path = engine.open(name)
    buf = aligned_empty(nbytes)
    buf.fill_(7)
    try:
        started = time.perf_counter()
        engine.write(path, buf, 0).wait()
        engine.sync(path)
        write_s = time.perf_counter() - started
        started = time.perf_counter()
        engine.read(path, buf, 0).wait()
        read_s = time.perf_counter() - started
    finally:
        engine.discard(path)
    engine.bytes_read -= nbytes
    engine.bytes_written -= nbytes
    return nbytes / write_s / 1e9, nbytes / read_s / 1e9
