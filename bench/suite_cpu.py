"""Where the default test run's CPU goes: a pytest plugin that charges each test the whole
machine's busy CPU seconds (/proc/stat) while it ran, so the ranks, torchrun agents and CLI
interpreters a test starts are counted with it (pytest's --durations sees wall time only, and
`time` misses processes nobody waits for, such as the forkserver's ranks).

    PYTHONPATH=bench python -m pytest -q -n 0 -p suite_cpu -p no:cacheprovider
    SUITE_CPU_OUT=/tmp/cpu.json ...    # where the per-test rows go (default: suite_cpu.json)

One test at a time (`-n 0`) on an otherwise idle machine: every busy tick is the test's. The
terminal summary lists the files by CPU; the JSON holds [nodeid, wall s, CPU s] per test. A
benchmark, not a test: its figures go in bench/RESULTS.md.
"""

from __future__ import annotations

import collections
import json
import os
import time

import pytest

TOP_FILES = 25
_TICK = os.sysconf("SC_CLK_TCK")
_rows: list[tuple[str, float, float]] = []


def _busy_seconds() -> float:
    with open("/proc/stat") as fh:
        ticks = [int(x) for x in fh.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / _TICK  # all but idle and iowait


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    busy, start = _busy_seconds(), time.perf_counter()
    yield
    _rows.append((item.nodeid, time.perf_counter() - start, _busy_seconds() - busy))


def pytest_terminal_summary(terminalreporter):
    if not _rows:
        terminalreporter.write_line("suite_cpu: no test ran in this process (run it with -n 0)")
        return
    out = os.environ.get("SUITE_CPU_OUT", "suite_cpu.json")
    with open(out, "w") as fh:
        json.dump(_rows, fh)
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for nodeid, wall, cpu in _rows:
        f = files[nodeid.split("::")[0]]
        f[0] += 1
        f[1] += wall
        f[2] += cpu
    wall, cpu = sum(r[1] for r in _rows), sum(r[2] for r in _rows)
    terminalreporter.section(f"busy CPU by file (suite_cpu): {cpu:.0f} CPU-s in {wall:.0f} s of tests, rows in {out}")
    terminalreporter.write_line(f"{'CPU s':>8} {'wall s':>8} {'tests':>6}  file")
    for name, (n, w, c) in sorted(files.items(), key=lambda kv: -kv[1][2])[:TOP_FILES]:
        terminalreporter.write_line(f"{c:8.1f} {w:8.1f} {n:6d}  {name}")
