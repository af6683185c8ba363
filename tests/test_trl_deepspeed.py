"""The unchanged TRL scripts (tests/hf_scripts/trl_*.py) under `zeroshard launch --nproc 2` at ZeRO-3
equal the same scripts under the real DeepSpeed 0.19.8, recorded once by
`record_deepspeed.py --trl` (tests/fixtures/trl_deepspeed/figures.json, provenance inside; the
scenarios are scenarios.TRL), and DPO equals the same script as one process without DeepSpeed at
the same global batch (computed here: `--batch 8` against 2 ranks x 4). fp32 throughout (TRL's
configs default to bf16; trl_common.py turns it off). Issue 48.

Measured (zeroshard's side here under ATEN_CPU_CAPABILITY unset (AVX512 on this AMD EPYC),
=default, =avx2, and with 2 threads per rank; DeepSpeed's recorded once, AVX512, 1 thread): worst
relative loss difference against DeepSpeed 1.2e-7 (SFT; DPO and GRPO 0 to 8.6e-8), against one
process 8.8e-8; DPO chosen rewards within 7.1e-8 absolute; GRPO's completions (tokens) and rewards
equal exactly in all four. The tolerances are ~100x the worst spread, under the issue's 1e-4.
Planted bugs move the losses far beyond them (GatheredParameters write-back skipped, so the DPO
reference is never synced: 7.9e-3 at step 3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="trl is not installed (pip install 'zeroshard[test]')")

from hf_launch import ROOT, SCRIPTS, clean_env, launch  # noqa: E402

sys.path.insert(0, SCRIPTS)
from scenarios import TRL, TRL_FIGURES  # noqa: E402

pytestmark = pytest.mark.timeout(900)
with open(os.path.join(ROOT, TRL_FIGURES)) as f:
    FIGURES = json.load(f)
DS_REL = 1e-5  # against DeepSpeed's recorded losses, per step (measured: <= 1.2e-7)
ONE_REL = 1e-5  # against one process, per step (measured: <= 8.8e-8)
_RUNS: dict[str, dict] = {}


def _zeroshard(name: str, tmp_path_factory) -> dict:
    """Scenario `name` of scenarios.TRL on zeroshard (2 ranks, ZeRO-3), launched once per session."""
    if name not in _RUNS:
        script, args, _ = TRL[name]
        work = tmp_path_factory.mktemp(name)
        result, output = launch(script, ["--zero3", *args, "--out", str(work)], cwd=work, timeout=600)
        assert "zeroshard serves `import deepspeed` in this run" in output
        _RUNS[name] = result
    return _RUNS[name]


def _one_process(script: str, args: list[str], work) -> dict:
    """The script as one plain process (no launcher, no DeepSpeed config): rank 0's RESULT."""
    proc = subprocess.run([sys.executable, os.path.join(SCRIPTS, script), *args, "--out", str(work)], cwd=work,
                          env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.JSONDecoder().raw_decode(proc.stdout.split("RESULT ", 1)[1])[0]


def _close(got: list[float], want: list[float], rel: float) -> None:
    assert len(got) == len(want) and got, (got, want)
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert worst <= rel, f"worst relative difference {worst:.2e} > {rel:.0e}: {got} against {want}"


def _equals_deepspeed(name: str, tmp_path_factory) -> dict:
    got, want = _zeroshard(name, tmp_path_factory), FIGURES["runs"][name]
    assert FIGURES["provenance"]["deepspeed"] == "0.19.8" and want["args"][0] == "--zero3"
    assert want["args"][1:] == TRL[name][1], "scenarios.TRL changed since the recording: record again"
    _close(got["losses"], want["losses"], DS_REL)
    return got


@pytest.mark.recorded
def test_dpo_with_reference_sync_equals_deepspeed(tmp_path_factory):
    """DPOTrainer, a reference model (TRL's prepare_deepspeed engine, no optimizer) synced every 2
    steps (SyncRefModelCallback: GatheredParameters over policy + reference, modifier_rank=0)."""
    got = _equals_deepspeed("dpo_sync", tmp_path_factory)
    want = FIGURES["runs"]["dpo_sync"]
    # the chosen rewards are beta x small log-prob differences: absolute (measured: <= 7.1e-8)
    assert all(abs(a - b) <= 1e-6 for a, b in zip(got["rewards"], want["rewards"])), (got, want)


def test_dpo_with_reference_sync_equals_one_process(tmp_path_factory, tmp_path):
    """The same DPO run as one process without DeepSpeed, per-device batch 8 = the 2 ranks' global batch."""
    got = _zeroshard("dpo_sync", tmp_path_factory)
    one = _one_process("trl_dpo.py", [*TRL["dpo_sync"][1], "--batch", "8"], tmp_path)
    _close(got["losses"], one["losses"], ONE_REL)


@pytest.mark.slow  # a launch (~20 s)
@pytest.mark.recorded
def test_sft_equals_deepspeed(tmp_path_factory):
    _equals_deepspeed("sft", tmp_path_factory)


@pytest.mark.slow  # a launch and one process (~40 s)
@pytest.mark.recorded
def test_dpo_with_reference_equals_deepspeed_and_one_process(tmp_path_factory, tmp_path):
    got = _equals_deepspeed("dpo", tmp_path_factory)
    one = _one_process("trl_dpo.py", [*TRL["dpo"][1], "--batch", "8"], tmp_path)
    _close(got["losses"], one["losses"], ONE_REL)


@pytest.mark.slow  # a launch each (~25 s)
@pytest.mark.recorded
@pytest.mark.parametrize("name", ["grpo", "grpo_per_forward", "grpo_beta"])
def test_grpo_equals_deepspeed_token_for_token(tmp_path_factory, name):
    """GRPOTrainer with a Python reward: ds3_gather_for_generation true / false, beta 0 / 0.1 (a
    reference engine). DeepSpeed's per-forward run was recorded without prefetching (ds_comm_first.py
    says why it fails otherwise)."""
    got = _equals_deepspeed(name, tmp_path_factory)
    want = FIGURES["runs"][name]
    assert got["completions"] == want["completions"] and len(want["completions"]) == 8, (got, want)
    assert got["rewards"] == want["rewards"], (got, want)
