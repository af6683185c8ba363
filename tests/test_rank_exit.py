"""A rank whose script is over (returned, or failed with a zeroshard error it reported) and that
is stopped while the interpreter shuts down (torch's exit handlers run; torchrun stops the
other ranks with SIGTERM when one fails) exits quietly with its own status: no traceback
from inside an exit handler (cli/rank_guard.finishing)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import atexit, os, signal, sys, time

    def stopped_while_shutting_down():
        os.kill(os.getpid(), signal.SIGTERM)   # as torchrun does to the other ranks
        time.sleep(0.5)                         # the handler runs here, inside the exit handler
        print("exit handler finished", flush=True)

    atexit.register(stopped_while_shutting_down)
    if sys.argv[1] == "error":
        from zeroshard.policies.errors import ConfigError
        raise ConfigError("lr must be positive, got -1")
    print("script done", flush=True)
""")


@pytest.mark.parametrize("how, status", [("error", 2), ("done", 0)])
def test_a_stop_during_shutdown_exits_quietly_with_the_scripts_status(tmp_path, how, status):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "ZEROSHARD_CHANNEL": str(tmp_path / "channel")}
    (tmp_path / "channel").mkdir()
    done = subprocess.run([sys.executable, "-m", "zeroshard.cli.rank_main", str(script), how],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == status, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "StopRequested" not in done.stderr, done.stderr
    assert "exit handler finished" not in done.stdout  # the stop ended it, quietly
