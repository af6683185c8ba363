"""The planted-bug list (bench/mutants.py, issue 28) stays applicable as the code moves: every
mutant's old text occurs exactly once in its file, so a refactor that moves a line makes this
fail here instead of the mutant turning STALE the next time someone runs the benchmark."""

from __future__ import annotations

import importlib.util
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _mutants():
    spec = importlib.util.spec_from_file_location("zeroshard_bench_mutants", os.path.join(ROOT, "bench", "mutants.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("zeroshard_bench_mutants", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MUTANTS


def test_every_mutant_applies_to_the_current_tree():
    stale = []
    for m in _mutants():
        path = os.path.join(ROOT, "src", "zeroshard", m.file)
        count = open(path, encoding="utf-8").read().count(m.old) if os.path.exists(path) else "no file"
        if count != 1:
            stale.append(f"{m.name}: {m.file}: old text found {count} time(s)")
        for test in m.tests:
            if not os.path.exists(os.path.join(ROOT, test.split("::")[0])):
                stale.append(f"{m.name}: test file {test} does not exist")
    assert not stale, "bench/mutants.py is stale (update the old text to the moved line):\n" + "\n".join(stale)
