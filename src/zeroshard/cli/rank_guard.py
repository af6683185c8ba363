"""What a rank started by `zeroshard train` or `zeroshard launch` does about signals and errors.

Stdlib only, so it can be installed before torch is imported.

- SIGINT, SIGTERM and SIGHUP raise `StopRequested` in the main thread (no KeyboardInterrupt
  traceback); a watchdog thread ends a rank that has not exited 5 s later (stuck in a
  collective whose peer is gone) with `os._exit`, and ends it at once on a second signal.
- The rank asks the kernel for SIGTERM when its parent (torchrun) dies, so no rank outlives
  its launcher, whatever killed it.
- Clean errors and the stop line go to the launcher's channel (a directory named by
  `ZEROSHARD_CHANNEL`): the launcher prints one line, once, for the whole job. Without a
  launcher (your own torchrun) they go to stderr as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

__all__ = ["CHANNEL_ENV", "STOP_SIGNALS", "StopRequested", "channel", "die_with_parent", "finishing", "install",
           "report_error", "report_stop", "set_where", "stop_code", "write_channel"]

CHANNEL_ENV = "ZEROSHARD_CHANNEL"
GRACE_S = 5.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1

_where: Callable[[], str] = lambda: ""
_stopping: list[int] = []
_finished: list[int] = []  # the exit status, once the script has returned or failed
_installed = False


class StopRequested(BaseException):
    """A stop signal reached this rank. A BaseException, like KeyboardInterrupt, so that
    `except Exception` in user code does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_code(signum: int) -> int:
    """The shell's exit status for a process stopped by `signum` (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + int(signum)


def set_where(where: Callable[[], str]) -> None:
    """Tell the guard how to describe where training is ("at step 37 of 300"), for the stop line."""
    global _where
    _where = where


def install() -> None:
    """Install the handlers, the watchdog and the parent-death signal. Call first thing in a rank."""
    global _installed
    if not _installed:
        _installed = True
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write)  # written by the C-level handler, even while Python is blocked
        threading.Thread(target=_watchdog, args=(read,), name="zeroshard-stop-watchdog", daemon=True).start()
    for sig in STOP_SIGNALS:
        signal.signal(sig, _on_signal)
    die_with_parent()


def _watchdog(read: int) -> None:
    """End the process GRACE_S after a stop signal, or at once after a second one. Runs in
    its own thread: the main thread may be blocked in a collective whose peer is gone, where
    Python's own handler cannot run until the call returns."""
    first: int | None = None
    deadline = None
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([read], [], [], timeout)
        if not ready:
            os._exit(stop_code(first))
        data = os.read(read, 64)
        for signum in data:
            if signum not in STOP_SIGNALS:
                continue
            if first is not None:
                os._exit(stop_code(first))
            first, deadline = signum, time.monotonic() + GRACE_S


def die_with_parent() -> None:
    """Ask Linux to send SIGTERM to this process when its parent dies (a no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def finishing(status: int) -> None:
    """The script is over (returned, or failed and was reported) and the interpreter is shutting
    down (torch's exit handlers): a stop signal now ends the process quietly with `status`
    rather than raising inside those handlers (a traceback for a rank that already said why)."""
    _finished.append(status)


def _on_signal(signum: int, frame) -> None:
    if _finished:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(_finished[0])
    if _stopping:  # a second signal: the watchdog ends the process
        return
    _stopping.append(signum)
    if _rank() == 0:
        with contextlib.suppress(Exception):
            report_stop(_where())
    raise StopRequested(signum)


_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")  # torchrun's, mpirun's, srun's


def _rank() -> int:
    """This process's rank as its launcher numbered it (before zeroshard exported RANK, too)."""
    for name in _RANK_VARS:
        try:
            return int(os.environ[name])
        except (KeyError, ValueError):
            continue
    return 0


def channel() -> str | None:
    """The launcher's channel directory (`ZEROSHARD_CHANNEL`), or None without a launcher."""
    path = os.environ.get(CHANNEL_ENV)
    return path if path and os.path.isdir(path) else None


def write_channel(name: str, text: str) -> None:
    """File `name` of the channel holds `text` (written whole, then renamed into place)."""
    path = os.path.join(channel(), name)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)  # the launcher never reads half a line


def report_error(command: str, message: str) -> None:
    """A clean error found in this rank (a ZeroShardError: bad config, checkpoint, path):
    one line for the launcher to print once, or this rank's line on stderr."""
    line = " ".join(str(message).split())  # one line, whatever the message held
    if channel():
        write_channel(f"error.rank{_rank():05d}", line)
    else:
        rank = _rank()
        print(f"{command}{'' if rank == 0 else f' (rank {rank})'}: {line}", file=sys.stderr, flush=True)


def report_stop(where: str) -> None:
    """Rank 0's account of where the stop found training (may be empty)."""
    if channel():
        write_channel("stop", where)
    elif where:
        print(f"stopped {where}", file=sys.stderr, flush=True)
