"""Fault injection for tests, the one place production code reads a test hook (documented in
docs/reliability.md, "Fault injection"). `ZEROSHARD_FAULT=<point>:<argument>` arms one named
point; unset, every point is a no-op. Tests arm a child with `env.update(setting(point, arg))`.

    pause:<phase>       a checkpoint save stops at <phase> (prepared, rank_file, written, renamed,
                        latest), says so on stderr and waits PAUSE_S, for a test to kill it
    kill:<rank>:<step>  `zeroshard train`'s rank <rank> sends itself SIGKILL just before step
                        <step> (0-based), in torchrun's first attempt only
    hold:<rank>:<step>  `zeroshard train`'s rank <rank> stops just before step <step>, says so on
                        stderr and waits PAUSE_S (first attempt only), for a test to kill its node
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

from zeroshard.policies import ConfigError

__all__ = ["ENV", "HOLD", "KILL", "PAUSE", "PAUSE_S", "armed", "kill_hook", "pause", "setting"]

ENV = "ZEROSHARD_FAULT"
PAUSE, KILL, HOLD = "pause", "kill", "hold"
PAUSE_S = 120.0


def setting(point: str, argument: str) -> dict[str, str]:
    """The environment entry that arms `point` with `argument`."""
    return {ENV: f"{point}:{argument}"}


def armed(point: str) -> str | None:
    """`point`'s argument when ZEROSHARD_FAULT arms it, else None (the one read of the environment)."""
    name, _, argument = os.environ.get(ENV, "").partition(":")
    return argument if name == point else None


def pause(phase: str) -> None:
    """Point `pause`: let a test kill a checkpoint save at `phase`: announce it, then wait."""
    if armed(PAUSE) == phase:
        os.write(2, f"zeroshard-checkpoint-paused {phase}\n".encode())  # one write: lines never interleave
        time.sleep(PAUSE_S)


def kill_hook(rank: int, restart: int) -> Callable[[int], None]:
    """Points `kill` and `hold` for `rank` in torchrun's attempt `restart`: a function of the step
    about to run, a no-op unless a point names this rank and this is the first attempt (restart 0)."""
    point = KILL if armed(KILL) is not None else HOLD
    spec = armed(point)
    if spec is None:
        return lambda step: None
    try:
        who, at = (int(part) for part in spec.split(":"))
    except ValueError:
        raise ConfigError(f"{ENV}={point}:{spec}: expected RANK:STEP after '{point}:', e.g. {point}:1:6") from None
    if who != rank or restart:
        return lambda step: None

    def check(step: int) -> None:
        if step != at:
            return
        if point == KILL:
            os.kill(os.getpid(), signal.SIGKILL)
            return
        os.write(2, f"zeroshard-fault-held rank {rank} step {step}\n".encode())
        time.sleep(PAUSE_S)

    return check
