"""Durable file writing: a streaming safetensors writer, fsync, atomic small files, sha256.

The safetensors file is written by hand (an 8-byte header length, a JSON header, then
the raw bytes of each tensor in header order) so that tensors are produced and
written one at a time (peak memory ~ one tensor), hashed while they are written
(sha256 runs on a helper thread, overlapping the disk), and fsynced before the
caller records the file as done. `safetensors.safe_open` reads the result.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import select
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from zeroshard.checkpoint.format import FORMAT, dtype_code, rank_file
from zeroshard.policies import CheckpointError

CHUNK = 64 << 20  # bytes per write call (and per hash update)


@dataclass(frozen=True)
class Entry:
    """A tensor to write: its key, shape and dtype up front, its data produced on demand."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class Written:
    bytes: int
    sha256: str


WRITE_STALL_S = 60.0  # a file that takes no byte for this long (EAGAIN, or 0 written) is an error


def _write(f, data) -> None:
    """The one place bytes reach a file (tests replace it to simulate a full disk).

    Writes all of `data`: a raw write may take fewer bytes than asked (os.write and
    unbuffered FileIO return the count; a non-blocking descriptor returns None for EAGAIN),
    so the rest is written again until none is left. A write that makes no progress for
    WRITE_STALL_S seconds raises OSError instead of looping, or of truncating silently."""
    view = memoryview(data).cast("B")
    stalled_since: float | None = None
    while len(view):
        n = f.write(view)
        if n is None or n <= 0:  # EAGAIN (non-blocking) or no progress: wait, then retry
            now = time.monotonic()
            stalled_since = now if stalled_since is None else stalled_since
            if now - stalled_since > WRITE_STALL_S or (n is not None and n < 0):
                raise OSError(errno.EIO, f"write made no progress for {now - stalled_since:.0f} s "
                                         f"({len(view)} bytes left)")
            if n is None:
                select.select([], [f.fileno()], [], 1.0)
            else:
                time.sleep(0.01)
            continue
        stalled_since = None
        view = view[n:]


def header_bytes(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for e in entries:
        header[e.key] = {"dtype": dtype_code(e.dtype), "shape": list(e.shape),
                         "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _as_bytes(t: torch.Tensor, e: Entry) -> memoryview:
    if tuple(t.shape) != e.shape or t.dtype != e.dtype:
        raise CheckpointError(f"{e.key}: produced {tuple(t.shape)} {t.dtype}, planned {e.shape} {e.dtype}")
    return memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(path: str, entries: list[Entry], metadata: dict[str, str] | None = None) -> Written:
    """Write `entries` to `path`, fsync it, and return its size and sha256."""
    sha = hashlib.sha256()
    total = 0
    with ThreadPoolExecutor(1, thread_name_prefix="zeroshard-sha256") as hasher:
        try:
            with open(path, "wb", buffering=0) as f:
                head = header_bytes(entries, metadata)
                sha.update(head)
                _write(f, head)
                total += len(head)
                for e in entries:
                    data = _as_bytes(e.produce(), e)
                    pending = []
                    for lo in range(0, len(data), CHUNK):
                        chunk = data[lo : lo + CHUNK]
                        pending.append(hasher.submit(sha.update, chunk))
                        _write(f, chunk)
                        total += len(chunk)
                    for p in pending:  # `data` must outlive its hashing
                        p.result()
                os.fsync(f.fileno())
        except OSError as exc:
            raise write_error(path, exc) from None
    return Written(total, sha.hexdigest())


def write_rank_files(tmp: str, rank: int, values: list[Entry], states: list[Entry], json_states: str) -> dict:
    """`rank`'s model (values) and optim (states) files in `tmp`: meta.json's `files` entries for them."""
    files = {}
    for entries, field in ((values, "value"), (states, "optim")):
        name = rank_file(rank, field)
        metadata = {"format": "pt", "zeroshard": FORMAT, "rank": str(rank)}
        if field == "optim":
            metadata["json_states"] = json_states
        written = write_safetensors(os.path.join(tmp, name), entries, metadata)
        files[name] = {"rank": rank, "bytes": written.bytes, "sha256": written.sha256}
    return files


def write_small(path: str, data: bytes) -> None:
    """Write a small file atomically: a temporary beside it, fsync, rename, fsync the directory."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            _write(f, data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise write_error(path, exc) from None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class WriteError(CheckpointError):
    """A file could not be written; `reason` is the system's word for why."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def write_error(path: str, exc: OSError) -> WriteError:
    if exc.errno == errno.ENOSPC:
        return WriteError(f"{path}: no space left on the device while writing the checkpoint; "
                          "free space or save elsewhere (the previous checkpoint is intact)", "no space left on the device")
    reason = str(exc.strerror or exc)
    return WriteError(f"{path}: cannot write ({reason}); the previous checkpoint is intact", reason)


def sha256_of(path: str) -> str:
    """sha256 of a file, hashing each chunk on a helper thread while the next one is read."""
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1, thread_name_prefix="zeroshard-sha256") as hasher:
        pending = None
        while block := f.read(CHUNK):
            if pending is not None:
                pending.result()
            pending = hasher.submit(sha.update, block)
        if pending is not None:
            pending.result()
    return sha.hexdigest()


def total_bytes(entries: Iterable[Entry]) -> int:
    return sum(e.nbytes for e in entries)
