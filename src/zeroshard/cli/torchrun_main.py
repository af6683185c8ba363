"""torchrun as `zeroshard train` and `zeroshard launch` run it: `python -m zeroshard.cli.torchrun_main ARGS`.

The same `torch.distributed.run` (same arguments, same rendezvous, same restarts), with
three differences that make a stop or a failure read as one line from the launcher:

- it receives SIGTERM when the launcher dies (so it stops its ranks, whatever killed the
  launcher), and a stop signal before the ranks start ends it quietly;
- its own log lines ("Sending process ... closing signal", "failed (exitcode: 2)") are not printed;
- a failed rank or a stop signal ends it with an exit status (the failed rank's, or
  128 + the signal) and a record in the launcher's channel, instead of a traceback of
  `ChildFailedError` or `SignalException`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys

from zeroshard.cli import rank_guard

TORCHRUN_SIGNAL = "torchrun.signal"
FAILURES = "torchrun.failures"


def main(argv: list[str] | None = None) -> int:
    rank_guard.die_with_parent()
    try:
        from torch.distributed.elastic.multiprocessing.api import SignalException, _terminate_process_handler

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _terminate_process_handler)  # torchrun's own, before it installs it itself
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import parse_args, run

        _quiet()
        try:
            run(parse_args(sys.argv[1:] if argv is None else argv))
        except ChildFailedError as exc:
            return _failed(exc)
        except SignalException as exc:
            return _signalled(int(exc.sigval))
    except KeyboardInterrupt:  # a SIGINT before torch's handler was installed
        return _signalled(int(signal.SIGINT))
    return 0


def _quiet() -> None:
    """Silence torchrun's own log lines (its agent's and process contexts'); the launcher
    says how the run ended. torch sets their levels again as it configures logging, so
    they are disabled rather than raised in level."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.distributed.run", "torch.distributed.launcher")):
            logging.getLogger(name).disabled = True


def _record(name: str, payload) -> None:
    channel = os.environ.get(rank_guard.CHANNEL_ENV)
    if channel and os.path.isdir(channel):
        with open(os.path.join(channel, name), "w") as fh:
            json.dump(payload, fh)


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
