"""The NVMe tier's disk: run folders (one per process, `flock`ed while alive, swept when their
process died), checks of `nvme_path` and of the free space, and what DeepSpeed's `aio` block
becomes for the thread-pool I/O engine. Pure functions over paths; no tensors."""

from __future__ import annotations

import fcntl
import os
import shutil

from zeroshard.offload.aio import ALIGN, AioSettings, align_up
from zeroshard.policies import AioPolicy, NvmeError, NvmeSpaceError

PREFIX = "zeroshard-"


def aio_settings(policy: AioPolicy) -> tuple[AioSettings, list[str]]:
    """The I/O engine's settings from DeepSpeed's `aio` block, and one line per key saying what
    it became (libaio's knobs have no one-to-one meaning for a thread pool)."""
    threads = max(1, min(64, policy.queue_depth * policy.intra_op_parallelism))
    lines = [
        f"aio.block_size={policy.block_size}: the smallest piece; a request is moved in pieces of up to 64 MiB "
        "(a smaller request in one), so that few large requests reach the disk (the kernel queues their parts)",
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
    if os.path.exists(path) and not os.path.isdir(path):
        raise NvmeError(f"nvme_path {path!r} is a file, not a directory; point nvme_path at a directory on the "
                        "NVMe drive")
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        fix = (f"create it (mkdir -p {path})" if _creatable(parent)
               else f"choose a directory on a writable drive ({parent} cannot hold one)")
        raise NvmeError(f"nvme_path {path!r} does not exist; {fix}, or point nvme_path at an existing directory "
                        "on the NVMe drive")
    if not os.access(path, os.W_OK | os.X_OK):
        raise NvmeError(f"nvme_path {path!r} is not writable by this user; fix its permissions or choose "
                        "another directory")
    return path


def _creatable(parent: str) -> bool:
    """Whether `mkdir -p` under `parent` could work: its nearest existing folder is writable and
    not a kernel filesystem (/proc, /sys)."""
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent)
    real = os.path.realpath(parent or "/")
    if real == "/proc" or real.startswith(("/proc/", "/sys/")) or real == "/sys":
        return False
    return os.path.isdir(real) and os.access(real, os.W_OK | os.X_OK)


def check_space(folder: str, need: int, sharers: int = 1) -> str:
    """Raise NvmeSpaceError unless the disk under `folder` has room for `need` bytes for each of
    `sharers` processes (the local ranks writing there) plus 1 GiB of slack; a line saying so."""
    free = shutil.disk_usage(folder).free
    total = need * max(1, sharers)
    slack = 1 << 30
    if total + slack > free:
        raise NvmeSpaceError(
            f"nvme_path {folder!r} has {_size(free)} free, but this run needs {_size(total)} "
            f"({_size(need)} x {sharers} local rank(s)) + 1 GiB slack; free space there, use a larger "
            "drive, or offload less (offload_optimizer.device: cpu, or a larger world size)")
    return (f"needs {_size(total)} on disk ({sharers} local rank(s)), {_size(free)} free")


def _size(nbytes: int) -> str:
    """Bytes in the unit that shows them: 0.43 MiB, not 0.00 GiB."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"
