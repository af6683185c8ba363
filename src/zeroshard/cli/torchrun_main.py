"""torchrun as `zeroshard train` and `zeroshard launch` run it: `python -m zeroshard.cli.torchrun_main ARGS`.

The same `torch.distributed.run` (same arguments, same rendezvous, same restarts), with
three differences that make a stop or a failure read as one line from the launcher:

- it receives SIGTERM when the launcher dies (so it stops its ranks, whatever killed the
  launcher), a stop signal before the ranks start ends it quietly, and its ranks are
  always stopped with SIGTERM (SIGINT would make a rank still starting Python print a
  traceback);
- its own log lines ("Sending process ... closing signal", "failed (exitcode: 2)") are not
  printed; a restart under --max-restarts is one line of ours;
- a failed rank or a stop signal ends it with an exit status (the failed rank's, or
  128 + the signal) and a record in the launcher's channel, instead of a traceback of
  `ChildFailedError` or `SignalException`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys

from zeroshard.cli import rank_guard

TORCHRUN_SIGNAL = "torchrun.signal"
FAILURES = "torchrun.failures"


_received: list[int] = []


def _on_stop(signum: int, frame) -> None:
    """A stop signal to torchrun: its ranks are told with SIGTERM whatever it got, since a rank
    still starting Python (before its own handler) ends quietly on SIGTERM but prints a
    KeyboardInterrupt traceback on SIGINT. The exit status keeps the signal received."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    _received.append(signum)
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    rank_guard.die_with_parent()
    # torchrun installs its own handlers for these when the ranks start; keep ours (SIGQUIT stays its)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGQUIT"
    try:
        for sig in rank_guard.STOP_SIGNALS:
            signal.signal(sig, _on_stop)
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        _quiet()
        _cheap_rendezvous_names()
        try:
            args = parse_args(sys.argv[1:] if argv is None else argv)
            if hasattr(args, "signals_to_handle"):  # newer torch writes its --signals-to-handle over the variable
                args.signals_to_handle = os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"]
            run(args)
        except ChildFailedError as exc:
            return _failed(exc)
        except SignalException as exc:
            return _signalled(_received[0] if _received else int(exc.sigval))
    except KeyboardInterrupt:  # a SIGINT before any handler was installed
        return _signalled(int(signal.SIGINT))
    return 0


def _quiet() -> None:
    """Silence torchrun's own log lines (its agent's and process contexts'); the launcher
    says how the run ended. torch sets their levels again as it configures logging, so
    they are disabled rather than raised in level. The two that tell of a restart
    (--max-restarts) are turned into one line of ours."""
    restarts = _Restarts()
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            log = logging.getLogger(name)
            if name in _RESTART_LOGGERS:
                log.setLevel(logging.INFO)
                log.addFilter(restarts)
            else:
                log.disabled = True


def _method_name(depth: int = 2) -> str:
    """What torch's dynamic_rendezvous.get_method_name returns (the name of the function `depth`
    frames up from it), from the frame objects: torch's builds inspect.stack() twice, reading
    the source lines of every frame, for each rendezvous event it records (0.55 s of a 2-rank
    start here, 18 stacks)."""
    try:
        return sys._getframe(depth).f_code.co_name
    except ValueError:  # fewer frames than depth
        return "no_method_name"


def _cheap_rendezvous_names() -> None:
    """Give torch's rendezvous _method_name for naming its events (only where torch's helper
    is the one _method_name reproduces: a module-level get_method_name(depth=2))."""
    import inspect

    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    helper = getattr(dynamic_rendezvous, "get_method_name", None)
    if callable(helper) and str(inspect.signature(helper)) == "(depth=2)":
        dynamic_rendezvous.get_method_name = _method_name


_RESTART_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.distributed.elastic.agent.server.api")


class _Restarts(logging.Filter):
    """Prints `zeroshard: local rank 1 was killed by SIGKILL; torchrun restarts every rank (1 of 2)`
    from torchrun's failure and restart records; lets no record through."""

    def __init__(self) -> None:
        super().__init__()
        self.failure: tuple[int, int] | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            if str(record.msg).startswith("failed (exitcode:"):
                self.failure = (int(record.args[0]), int(record.args[1]))
            elif "attempts left" in str(record.msg) and "will restart worker group" in str(record.msg):
                left, total = int(record.args[2]), int(record.args[3])
                code, rank = self.failure or (0, -1)
                how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
                print(f"zeroshard: local rank {rank} {how}; torchrun restarts every rank (restart {total - left + 1} "
                      f"of {total})", file=sys.stderr, flush=True)
        return False


def _record(name: str, payload) -> None:
    if rank_guard.channel():
        rank_guard.write_channel(name, json.dumps(payload))


def _signalled(signum: int) -> int:
    _record(TORCHRUN_SIGNAL, {"signal": signum})
    return rank_guard.stop_code(signum)


def _failed(exc) -> int:
    failures = [{"rank": int(rank), "exitcode": int(f.exitcode), "time": f.timestamp}
                for rank, f in sorted(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))]
    _record(FAILURES, failures)
    if not os.environ.get(rank_guard.CHANNEL_ENV):  # run by hand: say what torchrun would have said
        print(f"torchrun: rank(s) failed: {failures}", file=sys.stderr)
    code = failures[0]["exitcode"] if failures else 1
    return rank_guard.stop_code(-code) if code < 0 else (code or 1)


if __name__ == "__main__":
    sys.exit(main())
