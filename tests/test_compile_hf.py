"""Trainer (`torch_compile=True`) and an Accelerate loop with regional compilation, unchanged under
`zeroshard launch` with a DeepSpeed config (issue 44): losses equal the eager run of the same
script (2 ranks, stage 3). Trainer reaches `engine.compile()` through Accelerate; Accelerate's
regional compilation calls `module.compile()` on each GPT-2 block after `initialize`, tracing
torch's `Module.__call__`: zeroshard's hooks (torch.compiler.disable, stages/hooks.py) run
eagerly at graph breaks. Four launches of 20-50 s each: slow."""

from __future__ import annotations

import pytest

from hf_launch import launch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _same(got, want, tol=1e-5):
    assert len(got) == len(want) and got, (got, want)
    assert all(abs(a - b) <= tol * max(abs(b), 1.0) for a, b in zip(got, want)), (got, want)


def test_trainer_torch_compile_equals_eager(tmp_path):
    common = ["--stage", "3", "--steps", "3"]
    eager, _ = launch("trainer_gpt2.py", [*common, "--out", str(tmp_path / "e")], cwd=tmp_path, timeout=400)
    compiled, _ = launch("trainer_gpt2.py", [*common, "--compile", "aot_eager", "--out", str(tmp_path / "c")],
                         cwd=tmp_path, timeout=400)
    assert compiled["compiled"] and not eager["compiled"]
    _same(compiled["losses"], eager["losses"])
    _same([compiled["probe_loss"]], [eager["probe_loss"]])


def test_accelerate_regional_compilation_equals_eager(tmp_path):
    common = ["--stage", "3", "--gas", "2", "--micro-batches", "4"]
    eager, _ = launch("accelerate_loop.py", [*common, "--out", str(tmp_path / "e")], cwd=tmp_path, timeout=400)
    compiled, _ = launch("accelerate_loop.py", [*common, "--compile-regions", "aot_eager",
                                                "--out", str(tmp_path / "c")], cwd=tmp_path, timeout=400)
    assert compiled["compiled_blocks"] >= 2 and eager["compiled_blocks"] == 0, (compiled, eager)
    _same(compiled["losses"], eager["losses"])
