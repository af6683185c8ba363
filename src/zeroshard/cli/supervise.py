"""The launcher's side of a run: start torchrun, pass on stop signals, and say in one line how it ended.

    code = supervise(cmd, env, "zeroshard train", describe_stop=...)

- SIGINT, SIGTERM or SIGHUP to the launcher (or to its process group: torchrun runs in a
  session of its own, so a terminal's Ctrl-C reaches the launcher alone) is passed to
  torchrun once; torchrun stops its ranks. A second signal, or torchrun still alive 20 s
  later, kills torchrun, and its ranks follow (they get SIGTERM when their parent dies).
- When torchrun has exited, any process still carrying this run's channel in its
  environment (a rank) is waited for briefly, then killed: no rank outlives the launcher.
- The ranks leave clean errors, the stop's whereabouts and torchrun's failures in a
  channel directory (`ZEROSHARD_CHANNEL`); the launcher prints one line from them:
  a stop (exit 130/143), a clean error from the lowest rank (exit 2), or which rank
  crashed (its exit status; the rank's own traceback is above).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable

from zeroshard.cli import rank_guard
from zeroshard.cli.rank_main import COMMAND_ENV
from zeroshard.cli.torchrun_main import FAILURES, TORCHRUN_SIGNAL

__all__ = ["supervise"]

KILL_AFTER_S = 20.0
STRAGGLER_WAIT_S = 8.0


def supervise(cmd: list[str], env: dict[str, str], command: str,
              describe_stop: Callable[[], str] | None = None) -> int:
    channel = tempfile.mkdtemp(prefix="zeroshard-run-")
    env = {**env, rank_guard.CHANNEL_ENV: channel, COMMAND_ENV: command}
    got: list[int] = []
    try:
        proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    except OSError as exc:
        shutil.rmtree(channel, ignore_errors=True)
        print(f"{command}: cannot start torchrun: {exc}", file=sys.stderr)
        return 2

    def on_signal(signum, frame) -> None:
        if got:
            _kill(proc)
            return
        got.append(signum)
        _send(proc, signal.SIGTERM)  # torchrun stops its ranks with it (see torchrun_main)
        timer = threading.Timer(KILL_AFTER_S, _kill, args=(proc,))
        timer.daemon = True
        timer.start()

    previous = {sig: signal.signal(sig, on_signal) for sig in rank_guard.STOP_SIGNALS}
    try:
        code = proc.wait()
        _reap(channel)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    try:
        return _verdict(code, got, channel, command, describe_stop)
    finally:
        shutil.rmtree(channel, ignore_errors=True)


def _send(proc: subprocess.Popen, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signum)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        _send(proc, signal.SIGKILL)


def _verdict(code: int, got: list[int], channel: str, command: str,
             describe_stop: Callable[[], str] | None) -> int:
    if code == 0 and not got:
        return 0
    signum = got[0] if got else _read_json(channel, TORCHRUN_SIGNAL, {}).get("signal")
    if signum is None and code < 0:
        signum = -code  # torchrun itself was killed by a signal
    if signum is not None:
        print(_stop_line(command, int(signum), channel, describe_stop), file=sys.stderr, flush=True)
        return rank_guard.stop_code(int(signum))
    failures = _read_json(channel, FAILURES, [])  # in the order they happened
    crashed = [f for f in failures if f["exitcode"] not in (0, 2) and not _stopped_by_torchrun(f["exitcode"])]
    errors = sorted(name for name in os.listdir(channel) if name.startswith("error.rank"))
    if errors and not crashed:
        with open(os.path.join(channel, errors[0])) as fh:
            print(f"{command}: {fh.read().strip()}", file=sys.stderr, flush=True)
        return 2
    if crashed:
        first = crashed[0]
        how = (f"was killed by {_signal_name(-first['exitcode'])}" if first["exitcode"] < 0
               else f"exited with status {first['exitcode']}")
        print(f"{command}: rank {first['rank']} {how} (its own output is above); every rank has stopped",
              file=sys.stderr, flush=True)
        return first["exitcode"] if first["exitcode"] > 0 else 1
    if failures:
        first = failures[0]
        print(f"{command}: rank {first['rank']} exited with status {first['exitcode']}", file=sys.stderr, flush=True)
        return 1
    print(f"{command}: torchrun exited with status {code}", file=sys.stderr, flush=True)
    return code if code > 0 else 1


def _stopped_by_torchrun(exitcode: int) -> bool:
    """A rank torchrun stopped because another failed: killed by, or exiting on, a stop signal."""
    stops = {int(s) for s in rank_guard.STOP_SIGNALS}
    return -exitcode in stops or exitcode - 128 in stops


def _stop_line(command: str, signum: int, channel: str, describe_stop: Callable[[], str] | None) -> str:
    where = _read_text(channel, "stop")
    extra = describe_stop() if describe_stop is not None else ""
    parts = [f"stopped by {_signal_name(signum)}" + (f" {where}" if where else ""), "every rank has exited", extra]
    return f"{command}: " + "; ".join(part for part in parts if part)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _read_text(channel: str, name: str) -> str:
    try:
        with open(os.path.join(channel, name)) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def _read_json(channel: str, name: str, default):
    text = _read_text(channel, name)
    try:
        return json.loads(text) if text else default
    except ValueError:
        return default


def _reap(channel: str) -> None:
    """Wait for, then kill, any process of this run still alive after torchrun (Linux: /proc)."""
    deadline = time.monotonic() + STRAGGLER_WAIT_S
    while True:
        left = _carriers(channel)
        if not left:
            return
        if time.monotonic() > deadline:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            return
        time.sleep(0.1)


def _carriers(channel: str) -> list[int]:
    if not os.path.isdir("/proc"):
        return []
    marker = f"{rank_guard.CHANNEL_ENV}={channel}".encode()
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as fh:
                if marker in fh.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found
