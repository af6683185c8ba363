"""torch.compile through Accelerate on zeroshard (issue 44): an unchanged Accelerate loop
(tests/hf_scripts/accelerate_loop.py: GPT-2, ZeRO-3, gradient accumulation 2) with
Accelerate's dynamo plugin, under `zeroshard launch --nproc 2`. Accelerate calls
`engine.compile(backend, compile_kwargs)` on the DeepSpeed engine (zeroshard's drop-in), or,
with `use_regional_compilation`, compiles each repeated block in place (`module.compile()`,
compile_regions_deepspeed). Backend aot_eager (eager's kernels): the losses equal the eager
run's, computed in the same test run."""

from __future__ import annotations

import pytest

from hf_launch import launch

pytestmark = pytest.mark.timeout(900)


def _run(tmp_path, how: str) -> tuple[dict, str]:
    work = tmp_path / how
    work.mkdir()
    return launch("accelerate_loop.py", ["--compile", how, "--micro-batches", "4", "--out", str(work)], cwd=work,
                  timeout=600, env={"ACCELERATE_USE_DEEPSPEED": "true"})


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("eager"), "none")


def test_accelerate_engine_compile_equals_eager(tmp_path, eager):
    result, output = _run(tmp_path, "engine")
    assert "zeroshard: compiled" in output and "with backend aot_eager" in output, output[-3000:]
    assert result["compiled"] and not eager[0]["compiled"]
    assert result["losses"] == pytest.approx(eager[0]["losses"], rel=1e-5)
    assert result["saved_probe"] == pytest.approx(eager[0]["saved_probe"], rel=1e-5)


@pytest.mark.slow
def test_accelerate_regional_compilation_equals_eager(tmp_path, eager):
    result, output = _run(tmp_path, "regions")
    assert result["compiled"]
    assert result["losses"] == pytest.approx(eager[0]["losses"], rel=1e-5)
