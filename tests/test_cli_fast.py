"""`zeroshard --help` and every usage error answer before torch is imported (issue 29, item 8:
each took 2-6 s, the time to import torch). Checked by what a fresh interpreter has imported,
not by timing: torch, transformers and numpy must not be among them."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from zeroshard.cli.main import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print("HEAVY", ",".join(heavy), "CODE", code)
"""


@pytest.mark.parametrize("argv", [
    ["--help"], [], ["train", "--help"], ["train", "--bogus"], ["train", "--steps", "x"], ["launch", "--help"],
    ["estimate", "--help"], ["estimate", "--nope"], ["plan", "--help"], ["bench", "--help"], ["export", "--help"],
    ["inspect", "--help"], ["nosuchcommand"],
], ids=lambda a: " ".join(a) or "no-args")
def test_help_and_usage_errors_do_not_import_torch(argv):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120)
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("HEAVY  CODE"), f"{argv}: {last}\n{proc.stderr[-2000:]}"
    assert last.endswith(("CODE 0", "CODE 2")), last
