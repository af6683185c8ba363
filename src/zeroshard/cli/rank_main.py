"""One rank of `zeroshard train` or `zeroshard launch`: `python -m zeroshard.cli.rank_main [-m] TARGET ARGS`.

torchrun starts this in every rank in place of the script itself. It installs the rank's
signal and error handling (rank_guard) before anything heavy is imported, then runs the
script (or module, with -m) as `__main__`, exactly as `python script.py ARGS` would:
same `sys.argv`, `sys.path[0]` the script's folder. What it adds:

- a stop signal ends the rank quietly with 130/143 (the launcher prints one line);
- a zeroshard error the script does not catch (a bad config, checkpoint or path) becomes
  one line for the launcher and exit status 2; any other exception keeps its traceback.
"""

from __future__ import annotations

import os
import runpy
import sys

from zeroshard.cli import rank_guard

COMMAND_ENV = "ZEROSHARD_COMMAND"


def main(argv: list[str] | None = None) -> int:
    rank_guard.install()
    status = _run(list(sys.argv[1:] if argv is None else argv))
    rank_guard.finishing(status)  # a stop signal during the interpreter's shutdown exits quietly
    return status


def _run(argv: list[str]) -> int:
    as_module = argv[:1] == ["-m"]
    if as_module:
        argv = argv[1:]
    if not argv:
        print("usage: python -m zeroshard.cli.rank_main [-m] TARGET [ARGS...]", file=sys.stderr)
        return 2
    target, rest = argv[0], argv[1:]
    try:
        sys.argv = [target, *rest]
        if as_module:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except rank_guard.StopRequested as stop:
        return rank_guard.stop_code(stop.signum)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)  # sys.exit("message") prints it and exits 1, as Python does
        return 1
    except Exception as exc:
        errors = sys.modules.get("zeroshard.policies.errors")  # None: zeroshard never ran, not ours
        if errors is None or not isinstance(exc, errors.ZeroShardError):
            raise
        rank_guard.report_error(os.environ.get(COMMAND_ENV, "zeroshard launch"), str(exc))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
